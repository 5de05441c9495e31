"""Chunked token statistics equal the naive full-logits computation, values and gradients."""

import pytest
import torch

from trainer.algo.token_stats import token_stats_from_hidden, token_stats_from_logits
from trainer.model_forward import causal_lm_token_stats

B, T, H, V = 2, 7, 6, 17


def _data(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, dtype=dtype, generator=g).requires_grad_(True)
    weight = torch.randn(V, H, dtype=dtype, generator=g).requires_grad_(True)
    bias = torch.randn(V, dtype=dtype, generator=g).requires_grad_(True)
    labels = torch.randint(0, V, (B, T), generator=g)
    gather = torch.randint(0, V, (B, T, 3), generator=g)
    coefs = torch.randn(4, B, T, dtype=dtype, generator=g)
    return hidden, weight, bias, labels, gather, coefs


def _naive(z, labels, idx, tau):
    z = z / tau
    lp = torch.log_softmax(z, -1)
    return (
        lp.gather(-1, labels[..., None])[..., 0],
        z.logsumexp(-1),
        z.gather(-1, idx),
        -(lp.exp() * lp).sum(-1),
    )


def _objective(parts, coefs):
    logp, lse, vals, ent = parts
    return (coefs[0] * logp).sum() + (coefs[1] * lse).sum() + (coefs[2, ..., None] * vals).sum() + (coefs[3] * ent).sum()


@pytest.mark.parametrize("mode", ["topk", "gather"])
@pytest.mark.parametrize("chunk", [1, 4, 100])
@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_fused_lm_head_pass_equals_naive(mode, chunk, tau):
    hidden, weight, bias, labels, gather, coefs = _data()
    kw = {"topk": 3} if mode == "topk" else {"gather_indices": gather}
    st = token_stats_from_hidden(hidden, weight, labels, bias=bias, entropy=True, temperature=tau, chunk_size=chunk, **kw)
    got = (st.logp, st.logsumexp, st.topk_logits, st.entropy)
    grads = torch.autograd.grad(_objective(got, coefs), (hidden, weight, bias))
    idx = st.topk_indices
    if mode == "topk":
        assert torch.equal(idx, torch.topk(hidden @ weight.T + bias, 3).indices)
    else:
        assert torch.equal(idx, gather)
    want = _naive(hidden @ weight.T + bias, labels, idx, tau)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-12)
    want_grads = torch.autograd.grad(_objective(want, coefs), (hidden, weight, bias))
    for a, b in zip(grads, want_grads):
        assert torch.allclose(a, b, atol=1e-10)


@pytest.mark.parametrize("chunk", [1, 5, 100])
def test_logits_pass_equals_naive(chunk):
    hidden, weight, bias, labels, gather, coefs = _data(1)
    logits = (hidden @ weight.T).detach().requires_grad_(True)
    st = token_stats_from_logits(logits, labels, gather_indices=gather, entropy=True, chunk_size=chunk, temperature=1.3)
    got = (st.logp, st.logsumexp, st.topk_logits, st.entropy)
    want = _naive(logits, labels, gather, 1.3)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-12)
    g1 = torch.autograd.grad(_objective(got, coefs), logits)[0]
    g2 = torch.autograd.grad(_objective(want, coefs), logits)[0]
    assert torch.allclose(g1, g2, atol=1e-12)


def test_only_some_outputs_used_and_no_entropy():
    hidden, weight, _, labels, _, _ = _data(2)
    st = token_stats_from_hidden(hidden, weight, labels, chunk_size=3)
    assert st.entropy is None and st.topk_logits is None and st.topk_indices is None
    g = torch.autograd.grad(st.logp.sum(), hidden)[0]
    want = torch.autograd.grad(torch.log_softmax(hidden @ weight.T, -1).gather(-1, labels[..., None]).sum(), hidden)[0]
    assert torch.allclose(g, want, atol=1e-12)


def test_bfloat16_model_matches_float32_reference():
    hidden, weight, _, labels, _, _ = _data(3, dtype=torch.float32)
    hb, wb = hidden.detach().bfloat16().requires_grad_(True), weight.detach().bfloat16().requires_grad_(True)
    st = token_stats_from_hidden(hb, wb, labels, topk=2, entropy=True, chunk_size=4)
    assert st.logp.dtype == torch.float32 and st.topk_indices.dtype == torch.int64
    (st.logp.sum() + st.entropy.sum()).backward()
    assert hb.grad.dtype == torch.bfloat16 and wb.grad.dtype == torch.bfloat16
    ref = torch.log_softmax((hb.detach() @ wb.detach().T).float(), -1).gather(-1, labels[..., None])[..., 0]
    assert torch.allclose(st.logp, ref, atol=1e-5)


def test_storage_bytes_and_detach():
    hidden, weight, _, labels, _, _ = _data(4, dtype=torch.float32)
    st = token_stats_from_hidden(hidden, weight, labels, topk=5).detach()
    assert not st.logp.requires_grad
    assert st.storage_bytes() == B * T * (4 + 4 + 5 * 4 + 5 * 8)


def test_bad_inputs_raise_clear_errors():
    hidden, weight, _, labels, gather, _ = _data()
    with pytest.raises(ValueError, match="either topk"):
        token_stats_from_hidden(hidden, weight, labels, topk=2, gather_indices=gather)
    with pytest.raises(ValueError, match="labels must lie"):
        token_stats_from_hidden(hidden, weight, labels + V)
    with pytest.raises(ValueError, match="weight must be"):
        token_stats_from_hidden(hidden, weight.T, labels)
    with pytest.raises(ValueError, match="temperature"):
        token_stats_from_logits(hidden @ weight.T, labels, temperature=0)
    with pytest.raises(ValueError, match="exceeds"):
        token_stats_from_logits(hidden @ weight.T, labels, topk=V + 1)


def test_empty_batch():
    hidden = torch.zeros(0, 3, H, requires_grad=True)
    st = token_stats_from_hidden(hidden, torch.randn(V, H), torch.zeros(0, 3, dtype=torch.long), topk=2, entropy=True)
    assert st.logp.shape == (0, 3) and st.topk_logits.shape == (0, 3, 2)


def test_causal_lm_pass_equals_the_models_own_logits(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    vocab = model.config.vocab_size
    prompt_len, resp = 5, 4
    ids = torch.randint(3, vocab, (2, prompt_len + resp))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left-padded prompt
    ids[0, :2] = 0
    st = causal_lm_token_stats(model, ids, mask, resp, topk=3, entropy=True, chunk_size=3)
    loss = st.logp.sum() + 0.1 * st.entropy.sum()
    loss.backward()
    got_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -resp - 1 : -1].float()
    lp = torch.log_softmax(logits, -1)
    want_logp = lp.gather(-1, ids[:, -resp:, None])[..., 0]
    want_ent = -(lp.exp() * lp).sum(-1)
    assert torch.allclose(st.logp, want_logp, atol=1e-5)
    assert torch.allclose(st.entropy, want_ent, atol=1e-5)
    assert torch.equal(st.topk_indices, torch.topk(logits, 3).indices)
    (want_logp.sum() + 0.1 * want_ent.sum()).backward()
    assert got_grads
    for n, p in model.named_parameters():
        if p.grad is not None:
            assert torch.allclose(got_grads[n], p.grad, atol=1e-5, rtol=1e-4), n


@pytest.mark.parametrize("response_max,checkpointing", [(1, False), (12, False), (12, True)])
def test_shared_prompt_pass_equals_one_pass(tiny_model_dir, response_max, checkpointing, monkeypatch):
    """Groups of rows with one prompt (left-padded to different widths), a lone row, ragged
    right-padded responses: prompt-once + KV cache gives the one-pass statistics, also on a
    training-mode model with activation checkpointing (whose layers would drop the cache)."""
    from transformers import AutoModelForCausalLM

    from trainer.batch import build_token_batch

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts, responses = [], []
    for plen, group in ((7, 4), (19, 3), (3, 1)):
        prompt = torch.randint(3, vocab, (plen,), generator=g).tolist()
        for _ in range(group):
            n = int(torch.randint(1, response_max + 1, (1,), generator=g))
            prompts.append(prompt)
            responses.append(torch.randint(3, vocab, (n,), generator=g).tolist())
    b = build_token_batch(prompts, responses, [[1] * len(r) for r in responses], pad_id=0)
    real = b.loss_mask.bool()
    import trainer.model_forward as L

    shared_hidden = []
    original = L._shared_prompt_hidden
    monkeypatch.setattr(L, "_shared_prompt_hidden", lambda *a: shared_hidden.append(original(*a)) or shared_hidden[-1])
    with torch.no_grad():
        one = causal_lm_token_stats(model, b.input_ids, b.attention_mask, b.response_width, topk=4, entropy=True)
        shared = causal_lm_token_stats(
            model, b.input_ids, b.attention_mask, b.response_width, topk=4, entropy=True, share_prompt=True
        )
    assert len(shared_hidden) == 1 and shared_hidden[0] is not None  # the shared path ran, no fallback
    for field in ("logp", "logsumexp", "entropy", "topk_logits"):
        assert torch.allclose(getattr(one, field)[real], getattr(shared, field)[real], atol=1e-5), field
    assert torch.equal(one.topk_indices[real], shared.topk_indices[real])


def test_shared_prompt_is_used_while_autograd_records(tiny_model_dir, monkeypatch):
    """The KV-cache path also serves the differentiable training pass (its gradients:
    tests/trainer/test_shared_prompt_grad.py) and no-grad passes alike."""
    from transformers import AutoModelForCausalLM

    import trainer.model_forward as L

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = torch.randint(3, model.config.vocab_size, (1, 6)).repeat(4, 1)
    mask = torch.ones_like(ids)
    calls = []
    original = L._shared_prompt_hidden
    monkeypatch.setattr(L, "_shared_prompt_hidden", lambda *a: calls.append(1) or original(*a))
    st = L.causal_lm_token_stats(model, ids, mask, 2, share_prompt=True)
    assert st.logp.requires_grad and calls == [1]
    with torch.no_grad():
        L.causal_lm_token_stats(model, ids, mask, 2, share_prompt=True)
    assert calls == [1, 1]


def test_compact_storage_bf16_int32_round_trips_as_gather_indices():
    hidden, weight, _, labels, _, _ = _data(5, dtype=torch.float32)
    full = token_stats_from_hidden(hidden, weight, labels, topk=4)
    small = full.compact(torch.bfloat16, torch.int32)
    assert small.topk_indices.dtype == torch.int32 and small.topk_logits.dtype == torch.bfloat16
    assert small.storage_bytes() == B * T * (4 + 4 + 4 * 2 + 4 * 4)
    again = token_stats_from_hidden(hidden, weight, labels, gather_indices=small.topk_indices)
    assert torch.equal(again.topk_logits, full.topk_logits)
    with pytest.raises(ValueError):
        full.compact(index_dtype=torch.int16)
