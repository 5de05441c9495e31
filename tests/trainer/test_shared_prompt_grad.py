"""Prompt sharing in the differentiable training pass (``model.share_prompt_training``, trainer/model_forward.py).

The training forward runs each distinct prompt of a micro-batch once and every group member's response
block on its gathered KV cache. In float64 on the real tiny Qwen2 the loss and *every* parameter
gradient must equal those of the one-pass forward (each row's prompt run for itself) to rounding:
left-padded prompts of different lengths in one micro-batch, groups of identical prompts, a lone
prompt, ragged right-padded responses; a micro-batch where no prompt repeats takes the one-pass
path. With activation checkpointing the training pass falls back to the one-pass forward (the
checkpointed layers would drop the cache); with LoRA the adapters' gradients match too.

Qwen2's RMSNorm computes in float32 whatever the model's dtype, which would make a float64 model only
float32-exact: sharing sums a group's gradient *before* the norm's backward, the one-pass forward
after it, so the two differ by float32 rounding (amplified by the norm's projection, ~1e-3 relative
at some entries). The tests therefore run the norm in the model's dtype (same formula), so any
difference left is float64 rounding and a wrong term could not hide in it.
"""

from __future__ import annotations

import pytest
import torch

import trainer.model_forward as L
from trainer.batch import build_token_batch

GROUPS = ((7, 4), (19, 3), (3, 1))  # (prompt length, rows with that prompt)


@pytest.fixture(autouse=True)
def norm_in_model_dtype(monkeypatch):
    from transformers.models.qwen2 import modeling_qwen2

    def forward(self, hidden):  # Qwen2RMSNorm without its float32 round trip
        return self.weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(modeling_qwen2.Qwen2RMSNorm, "forward", forward)


def _model(model_dir, *, checkpointing: bool = False):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def _batch(vocab: int, groups=GROUPS, response_max: int = 9, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for plen, rows in groups:
        prompt = torch.randint(3, vocab, (plen,), generator=g).tolist()
        for _ in range(rows):
            n = int(torch.randint(1, response_max + 1, (1,), generator=g))
            prompts.append(prompt)
            responses.append(torch.randint(3, vocab, (n,), generator=g).tolist())
    return build_token_batch(prompts, responses, [[1] * len(r) for r in responses], pad_id=0)


def _loss_and_grads(model, b, share: bool, gather: torch.Tensor):
    """A loss that reads every statistic the trainer's losses read (log-prob, logsumexp, gathered
    logits, entropy), masked to the real response tokens, and its gradient for every trainable tensor."""
    model.zero_grad(set_to_none=True)
    st = L.causal_lm_token_stats(model, b.input_ids, b.attention_mask, b.response_width, gather_indices=gather,
                                 entropy=True, share_prompt=share)
    m = b.loss_mask.double()
    w = torch.linspace(-1.0, 1.5, m.numel(), dtype=torch.float64).reshape(m.shape)
    loss = (m * (w * st.logp + 0.3 * st.entropy - 0.1 * w * st.logsumexp)).sum() + 0.05 * (m[..., None] * st.topk_logits).sum()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None for g in grads.values())
    return loss.detach(), grads


def _spy(monkeypatch):
    """Record what each shared-prompt attempt returned (None: it fell back to the one-pass forward)."""
    results = []
    original = L._shared_prompt_hidden
    monkeypatch.setattr(L, "_shared_prompt_hidden", lambda *a: results.append(original(*a)) or results[-1])
    return results


def _assert_same(one, shared):
    (loss1, g1), (loss2, g2) = one, shared
    assert loss1.item() == pytest.approx(loss2.item(), rel=1e-12, abs=1e-12)
    assert g1.keys() == g2.keys()
    for name, g in g1.items():
        scale = max(1.0, float(g.abs().max()))
        torch.testing.assert_close(g2[name], g, rtol=0, atol=1e-11 * scale, msg=name)


def _gather(b, vocab: int, k: int = 3) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (*b.labels.shape, k), generator=g)


def test_shared_prompt_training_pass_has_the_one_pass_loss_and_every_gradient(tiny_model_dir, monkeypatch):
    model = _model(tiny_model_dir)
    vocab = model.config.vocab_size
    b = _batch(vocab)
    gather = _gather(b, vocab)
    calls = _spy(monkeypatch)
    one = _loss_and_grads(model, b, False, gather)
    assert calls == []
    shared = _loss_and_grads(model, b, True, gather)
    assert len(calls) == 1 and calls[0] is not None and calls[0].requires_grad  # the shared path ran, with a graph
    assert b.prompt_lens.unique().numel() == 3 and b.response_lens.unique().numel() > 2  # ragged on both sides
    _assert_same(one, shared)
    assert max(float(g.abs().max()) for g in one[1].values()) > 1e-3  # gradients are real


def test_single_token_responses_share_the_prompt_with_gradients(tiny_model_dir, monkeypatch):
    """T = 1: the prompt pass alone predicts the response (no response block runs)."""
    model = _model(tiny_model_dir)
    vocab = model.config.vocab_size
    b = _batch(vocab, groups=((5, 3), (8, 2)), response_max=1)
    gather = _gather(b, vocab)
    calls = _spy(monkeypatch)
    one, shared = _loss_and_grads(model, b, False, gather), _loss_and_grads(model, b, True, gather)
    assert len(calls) == 1 and calls[0] is not None
    _assert_same(one, shared)


def test_micro_batch_without_a_repeated_prompt_takes_the_one_pass_forward(tiny_model_dir, monkeypatch):
    model = _model(tiny_model_dir)
    vocab = model.config.vocab_size
    b = _batch(vocab, groups=((4, 1), (9, 1), (6, 1)))
    gather = _gather(b, vocab)
    calls = _spy(monkeypatch)
    one, shared = _loss_and_grads(model, b, False, gather), _loss_and_grads(model, b, True, gather)
    assert calls == [None]  # tried, nothing to share: the one-pass forward ran
    for name, g in one[1].items():
        assert torch.equal(shared[1][name], g), name  # literally the same computation
    assert torch.equal(one[0], shared[0])


def test_activation_checkpointing_falls_back_to_the_one_pass_training_forward(tiny_model_dir, monkeypatch):
    """Checkpointed layers in training mode drop the KV cache, so while autograd records the training pass
    does not share (same gradients as without checkpointing); a no-grad pass on the same model still shares."""
    plain, ckpt = _model(tiny_model_dir), _model(tiny_model_dir, checkpointing=True)
    vocab = plain.config.vocab_size
    b = _batch(vocab)
    gather = _gather(b, vocab)
    calls = _spy(monkeypatch)
    want = _loss_and_grads(plain, b, True, gather)
    assert len(calls) == 1 and calls[0] is not None
    got = _loss_and_grads(ckpt, b, True, gather)
    assert len(calls) == 1  # not attempted under checkpointing
    _assert_same(want, got)
    with torch.no_grad():
        L.causal_lm_token_stats(ckpt, b.input_ids, b.attention_mask, b.response_width, share_prompt=True)
    assert len(calls) == 2 and calls[1] is not None
    assert all(m.gradient_checkpointing for m in ckpt.model.layers)  # switched back on after the no-grad pass


def test_lora_adapter_gradients_match_with_shared_prompts(tiny_model_dir, monkeypatch):
    from trainer.config import LoraConfig
    from trainer.lora import adapter_parameters, apply_lora

    model = apply_lora(_model(tiny_model_dir), LoraConfig(enabled=True, rank=4, alpha=8.0), base_model_name_or_path=str(tiny_model_dir))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():  # B = 0 at init would make every A gradient 0
        for _, p in adapter_parameters(model):
            p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    vocab = model.config.vocab_size
    b = _batch(vocab)
    gather = _gather(b, vocab)
    calls = _spy(monkeypatch)
    one, shared = _loss_and_grads(model, b, False, gather), _loss_and_grads(model, b, True, gather)
    assert len(calls) == 1 and calls[0] is not None
    assert set(one[1]) == {n for n, _ in adapter_parameters(model)}  # only the adapters train
    _assert_same(one, shared)


def test_exact_kl_to_a_shared_prompt_anchor_pass_is_exactly_zero_at_the_anchor(tiny_model_dir):
    """The exact KL's anchor hidden states come from a no-grad pass that shares prompts like the training
    pass does, so at policy = anchor they round alike: KL and its gradient are exactly 0 (not rounding noise)."""
    from trainer.algo.topk_kl import exact_kl_from_hidden

    model = _model(tiny_model_dir)
    b = _batch(model.config.vocab_size)
    args = (model, b.input_ids, b.attention_mask, b.response_width)
    with torch.no_grad():
        anchor, head = L.causal_lm_hidden(*args, share_prompt=True)
    hidden, head = L.causal_lm_hidden(*args, share_prompt=True)
    kl = exact_kl_from_hidden(hidden, head.weight, anchor, head.weight.detach(), direction="reverse")
    assert torch.equal(hidden.detach(), anchor)
    assert float(kl.detach().abs().max()) == 0.0
    kl.sum().backward()
    assert all(float(p.grad.abs().max()) == 0.0 for p in model.parameters())


def _layer_weights(model):
    return [p for n, p in model.named_parameters() if ".layers." in n and p.requires_grad]


def _second_backward_peak(model, b, gather) -> int:
    """Live tensor bytes above the start at the peak of a backward that adds into existing gradients (the second
    micro-batch of an accumulation), from the torch profiler's CPU allocation records."""
    from torch.profiler import ProfilerActivity, profile

    from trainer.plan.probe import live_peak

    def loss():
        st = L.causal_lm_token_stats(model, b.input_ids, b.attention_mask, b.response_width, gather_indices=gather,
                                     entropy=True, share_prompt=True)
        return (b.loss_mask.to(st.logp.dtype) * st.logp).sum()

    model.zero_grad(set_to_none=True)
    loss().backward()  # the first micro-batch: every .grad exists now
    second = loss()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        second.backward()
    return live_peak(prof)[0]


def test_each_weight_gradient_is_added_when_built_not_held_for_the_prompt_pass(tiny_model_dir, monkeypatch):
    """The shared prompt's pass and the response block are separate graphs (``_PromptCut``): a decoder weight's
    response-block gradient is added into ``.grad`` as soon as it is built, and the prompt pass's follows in its own
    backward. Without the cut the engine holds every layer's response gradient until the prompt pass's backward adds
    its own -- under accumulation all of them beside ``.grad`` at once. Measured here: the second micro-batch's peak
    falls by at least half of the layers' gradient bytes, and each weight's gradient is added twice (once per pass)."""
    model = _model(tiny_model_dir).float()
    vocab = model.config.vocab_size
    b = _batch(vocab, groups=((24, 4), (24, 4)), response_max=24)
    gather = _gather(b, vocab)
    adds = {}
    handles = [p.register_post_accumulate_grad_hook(lambda p: adds.__setitem__(id(p), adds.get(id(p), 0) + 1))
               for p in _layer_weights(model)]
    cut_peak = _second_backward_peak(model, b, gather)
    assert set(adds.values()) == {4}  # two backwards, each adding the response block's and the prompt pass's part
    adds.clear()
    monkeypatch.setattr(L, "_cut_at_the_prompt", lambda body, cache, last_prompt: last_prompt)  # one graph
    held_peak = _second_backward_peak(model, b, gather)
    assert set(adds.values()) == {2}
    for h in handles:
        h.remove()
    layer_grad_bytes = sum(p.numel() * p.element_size() for p in _layer_weights(model))
    assert held_peak - cut_peak >= layer_grad_bytes // 2, (held_peak, cut_peak, layer_grad_bytes)


def test_autograd_grad_through_a_shared_prompt_pass_is_refused(tiny_model_dir):
    """The prompt part's gradient is a nested backward into ``.grad``, so ``torch.autograd.grad`` (which must return it
    instead) is refused with a message rather than silently missing the prompt's share."""
    model = _model(tiny_model_dir)
    b = _batch(model.config.vocab_size)
    hidden, _ = L.causal_lm_hidden(model, b.input_ids, b.attention_mask, b.response_width, share_prompt=True)
    with pytest.raises(RuntimeError, match="share_prompt=False"):
        torch.autograd.grad(hidden.sum(), list(model.parameters()))
    hidden, _ = L.causal_lm_hidden(model, b.input_ids, b.attention_mask, b.response_width, share_prompt=False)
    assert all(g is not None for g in torch.autograd.grad(hidden.sum(), list(model.parameters())[1:]))
