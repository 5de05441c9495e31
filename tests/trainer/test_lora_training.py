"""Training with ``model.lora``: only the adapters train, the EMA anchor is an EMA of the adapters over the shared
base, GRPO's frozen reference is the base with the adapters off, and Top-k / exact KL see the right anchor."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from emapg.config import ConfigError, load_config
from emapg.paths import CONFIG_DIR
from trainer import lora as L
from trainer.batch import build_token_batch
from trainer.config import TrainConfig
from trainer.ema import EMAAnchor
from trainer.loop import Trainer, train
from trainer.policy import PolicyForward
from trainer.reshard import read_training_state

FAST = ["logging.progress=false", "logging.tensorboard=false", "data.prompts_per_step=2", "algorithm.mini_batch_size=4",
        "algorithm.micro_batch_size=2", "rollout.max_tokens_per_turn=8", "rollout.max_response_tokens=8", "run.save_every=0"]
LORA = ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8"]


def lora_cfg(tmp_path, model_dir, *extra: str) -> TrainConfig:
    return load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml",
                       [f"run.output_dir={tmp_path}", f"model.policy={model_dir}", *FAST, *LORA, *extra])


@pytest.fixture
def make_trainer(tmp_path, tiny_model_dir):
    made = []

    def make(*extra: str) -> Trainer:
        t = Trainer(lora_cfg(tmp_path / f"run{len(made)}", tiny_model_dir, *extra)).setup(with_engine=False)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


def _batch():
    prompts = [[3, 17, 40, 41, 9], [3, 17, 40, 41, 9], [5, 6]]
    responses = [[11, 12, 13, 14], [11, 15], [7, 8, 9]]
    return build_token_batch(prompts, responses, [[1] * len(r) for r in responses], pad_id=0)


def _perturb(model, seed, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in L.adapter_parameters(model):
            p.add_(scale * torch.randn(p.shape, generator=g))


def _plain_stats(model, mb, **kw):
    with torch.no_grad():
        return PolicyForward(model)(mb.input_ids, mb.attention_mask, mb.response_width, **kw)


def _merged_model(model_dir, peft_model, adapters: dict[str, torch.Tensor], scaling: float):
    """A plain HF model holding base + ``adapters`` (keyed as the live adapter parameters) merged."""
    state = {**peft_model.state_dict(), **{n: t.to(torch.float32) for n, t in adapters.items()}}
    plain = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    plain.load_state_dict(L.merged_state_dict(state, scaling))
    return plain


def test_only_the_adapters_train_and_b_zero_starts_at_the_base(make_trainer, tiny_model_dir):
    t = make_trainer()
    pol = t.policy
    adapters = dict(L.adapter_parameters(pol.model))
    in_optimizer = [p for g in pol.optimizer.param_groups for p in g["params"]]
    assert len(in_optimizer) == len(adapters) and {id(p) for p in in_optimizer} == {id(p) for p in adapters.values()}
    assert all(not p.requires_grad for n, p in pol.model.named_parameters() if n not in adapters)
    # The EMA anchor: fp32 copies of the adapters only (no second base).
    assert isinstance(pol.anchor, EMAAnchor)
    assert set(pol.anchor.tensors) == set(adapters) and all(a.dtype == torch.float32 for a in pol.anchor.tensors.values())
    # B = 0: the first step's log-probs are the base model's, bit for bit.
    mb = _batch().micro(slice(None))
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    want = _plain_stats(base, mb, entropy=True)
    with torch.no_grad():
        got = pol.stats(mb, entropy=True)
        anchor = pol.anchor_stats(mb)
    assert torch.equal(got.logp, want[0]) and torch.equal(got.logsumexp, want[1]) and torch.equal(got.entropy, want[4])
    torch.testing.assert_close(anchor.logp, want[0], rtol=0, atol=1e-5)  # prompts shared: same up to rounding


def test_adapter_ema_matches_the_formula_and_its_schedule(make_trainer):
    """θ_ema ← η·θ_ema + (1−η)·θ over the adapters, only after steps P, 2P (float64 reference)."""
    t = make_trainer("algorithm.ema.decay=0.9", "algorithm.ema.period=2")
    pol, anchor = t.policy, t.policy.anchor
    live = dict(L.adapter_parameters(pol.model))
    start = {n: a.double().clone() for n, a in anchor.tensors.items()}
    _perturb(pol.model, 1)
    theta1 = {n: p.detach().double().clone() for n, p in live.items()}
    assert not anchor.maybe_update(1)  # not a multiple of P
    assert all(torch.equal(anchor.tensors[n].double(), start[n]) for n in start)
    assert anchor.maybe_update(2) and not anchor.maybe_update(2)  # blended once
    for n, a in anchor.tensors.items():
        torch.testing.assert_close(a.double(), 0.9 * start[n] + 0.1 * theta1[n], rtol=0, atol=1e-7)
    _perturb(pol.model, 2)
    theta2 = {n: p.detach().double().clone() for n, p in live.items()}
    assert anchor.maybe_update(4)
    for n, a in anchor.tensors.items():
        want = 0.9 * (0.9 * start[n] + 0.1 * theta1[n]) + 0.1 * theta2[n]
        torch.testing.assert_close(a.double(), want, rtol=0, atol=1e-7)


def test_anchor_forward_is_base_plus_merged_ema_adapters(make_trainer, tiny_model_dir):
    """The anchor pass (the shared base, the anchor's adapters substituted) equals a plain model holding
    base + (alpha/r)·B_ema·A_ema; the policy pass equals one holding the policy's own adapters."""
    t = make_trainer("algorithm.ema.decay=0.5", "algorithm.ema.period=1", "model.share_prompt=false")
    pol = t.policy
    _perturb(pol.model, 3, scale=0.2)
    pol.anchor.update()
    _perturb(pol.model, 4, scale=0.2)
    mb = _batch().micro(slice(None))
    scaling = pol.lora.scaling
    anchor_model = _merged_model(tiny_model_dir, pol.model, pol.anchor.tensors, scaling)
    policy_model = _merged_model(tiny_model_dir, pol.model, {n: p.detach() for n, p in L.adapter_parameters(pol.model)}, scaling)
    with torch.no_grad():
        got, own = pol.anchor_stats(mb, topk=5), pol.stats(mb)
    want, want_own = _plain_stats(anchor_model, mb, topk=5), _plain_stats(policy_model, mb)
    # merged weights vs base + adapter path: fp32 rounding in another order; log-probs near -8 differ by ~3e-6
    # relative (2.7e-5 absolute with MKL on its AVX2 path), far below the 1e-3 between policy and anchor
    close = {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(got.logp, want[0], **close)
    torch.testing.assert_close(got.topk_logits, want[2], **close)
    assert torch.equal(got.topk_indices, want[3])
    torch.testing.assert_close(own.logp, want_own[0], **close)
    assert (own.logp - got.logp).abs().max() > 1e-3  # the two really differ


def test_exact_kl_with_lora_is_the_full_vocabulary_kl(make_trainer, tiny_model_dir):
    """exact_reverse with LoRA: the policy pass's KL against the stored anchor hidden states is Σ_v π(v)(log π(v) − log π_ema(v))
    computed from both models' full logits in float64."""
    t = make_trainer("algorithm.kl.type=exact_reverse", "algorithm.ema.decay=0.5", "algorithm.ema.period=1")
    pol = t.policy
    _perturb(pol.model, 5, scale=0.2)
    pol.anchor.update()
    _perturb(pol.model, 6, scale=0.2)
    mb = _batch().micro(slice(None))
    with torch.no_grad():
        hidden = pol.anchor_hidden(mb)
        st = pol.stats(mb, exact_kl_to=pol.exact_kl_anchor(hidden, "reverse"))
        T = mb.response_width
        logits_p = pol.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                             position_ids=(mb.attention_mask.cumsum(-1) - 1).clamp(min=0)).logits[:, -T - 1 : -1].double()
        anchor_model = _merged_model(tiny_model_dir, pol.model, pol.anchor.tensors, pol.lora.scaling)
        logits_a = anchor_model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                                position_ids=(mb.attention_mask.cumsum(-1) - 1).clamp(min=0)).logits[:, -T - 1 : -1].double()
    lp, la = logits_p.log_softmax(-1), logits_a.log_softmax(-1)
    want = (lp.exp() * (lp - la)).sum(-1)
    mask = mb.loss_mask.bool()
    torch.testing.assert_close(st.exact_kl[mask].double(), want[mask], rtol=1e-4, atol=1e-6)
    assert want[mask].min() > 1e-4


def test_frozen_reference_is_the_base_with_adapters_off(make_trainer, tiny_model_dir):
    """ema.decay = 1 (GRPO): no anchor tensors at all; the reference pass is the base model whatever the adapters."""
    t = make_trainer("algorithm.ema.decay=1.0", "algorithm.kl.type=k3")
    pol = t.policy
    assert isinstance(pol.anchor, L.AdaptersOffReference) and pol.anchor.tensors == {}
    _perturb(pol.model, 7, scale=0.3)
    mb = _batch().micro(slice(None))
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    with torch.no_grad():
        ref, own = pol.anchor_stats(mb), pol.stats(mb)
    torch.testing.assert_close(ref.logp, _plain_stats(base, mb)[0], rtol=0, atol=1e-5)
    assert (own.logp - ref.logp).abs().max() > 1e-3
    assert not pol.anchor.maybe_update(10)
    # The adapters are back on after the reference pass.
    with torch.no_grad():
        assert torch.equal(pol.stats(mb).logp, own.logp)


@pytest.mark.parametrize("kl", [["algorithm.kl.type=topk_reverse", "algorithm.ema.decay=0.5"],
                                ["algorithm.kl.type=exact_forward", "algorithm.ema.decay=0.5"],
                                ["algorithm.kl.type=k3", "algorithm.ema.decay=1.0"]])
def test_a_lora_run_trains_and_checkpoints_peft_adapters(tmp_path, tiny_model_dir, kl):
    """Two steps through the real loop and the transformers engine (which serves base + adapters): the base stays
    put, the adapters move, the checkpoint's policy/ is a peft adapter folder and state/ holds the EMA adapters."""
    cfg = lora_cfg(tmp_path / "run", tiny_model_dir, "run.total_steps=2", "algorithm.ema.period=1", "optim.lr=5e-2", *kl)
    history = train(cfg)
    assert [h["actor/updates"] for h in history] == [2.0, 2.0]
    policy = tmp_path / "run" / "step_2" / "policy"
    assert L.is_adapter_folder(policy) and not (policy / "model.safetensors").exists()
    assert L.adapter_base_model(policy) == str(tiny_model_dir)
    adapters = load_file(str(policy / L.ADAPTER_WEIGHTS))
    assert adapters and all(".lora_A." in k or ".lora_B." in k for k in adapters)
    state = read_training_state(tmp_path / "run" / "step_2")
    anchor = state.get("anchor", {})
    if cfg.algorithm.ema.decay == 1.0:
        assert anchor == {}
    else:
        assert len(anchor) == len(adapters) and all(".lora_" in k for k in anchor)
    assert len(state["optimizer"]["state"]) == len(adapters)


def test_bad_lora_input_fails_before_any_model_or_rollout(tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError, match=r"model\.lora\.rank"):
        lora_cfg(tmp_path, tiny_model_dir, "model.lora.rank=0")
    trainer = Trainer(lora_cfg(tmp_path / "r", tiny_model_dir, "model.lora.target_modules=[qkv_proj]"))
    try:
        with pytest.raises(ConfigError, match=r"model\.lora\.target_modules \['qkv_proj'\] match no linear layer"):
            trainer.setup()
        assert trainer.engine is None
    finally:
        trainer.close()


def test_merged_engine_weights_also_resume(tmp_path, tiny_model_dir):
    """``model.lora.engine_weights=merged``: the engine gets the merged full weights (also after a resume, when
    it starts from the adapter folder and then takes full weights, dropping the adapters it served)."""
    cfg = lora_cfg(tmp_path / "run", tiny_model_dir, "run.total_steps=1", "model.lora.engine_weights=merged",
                   "optim.lr=5e-2", "algorithm.kl.type=topk_reverse", "run.save_every=1")
    train(cfg)
    cfg2 = lora_cfg(tmp_path / "run", tiny_model_dir, "run.total_steps=3", "model.lora.engine_weights=merged",
                    "optim.lr=5e-2", "algorithm.kl.type=topk_reverse", "run.save_every=1")
    trainer = Trainer(cfg2, resume=tmp_path / "run").setup()
    try:
        assert trainer.step == 1 and trainer.engine_session.lora_config is None
        pushed = trainer.policy.export_weights(all_ranks=True)
        assert "model.layers.0.self_attn.q_proj.weight" in pushed and not any(".lora_" in k for k in pushed)
        trainer.train()
        assert L.is_adapter_folder(tmp_path / "run" / "step_3" / "policy")
        assert not hasattr(trainer.engine.model, "peft_config")  # serving the merged weights of step 2
    finally:
        trainer.close()
