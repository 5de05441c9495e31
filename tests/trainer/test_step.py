"""The pure step (trainer/step.py): compute_loss against the analytic gradient, and the PPO update.

``compute_loss`` on a tiny softmax policy (one logit vector θ shared by every position, sampled
token p = position) in float64: its gradient must equal the hand-derived PPO gradient
Σ_unclipped −A·ρ·(e_p − πθ) / N plus β times the KL kind's gradient. ``ppo_update`` runs on the
real tiny Qwen2 (micro-batch invariance, non-finite skips, gradient clipping).
"""

from __future__ import annotations

import math

import pytest
import torch

from emapg.config import load_config
from emapg.paths import CONFIG_DIR
from trainer.batch import MicroBatch, build_token_batch
from trainer.config import AlgorithmConfig, KLConfig, TrainConfig
from trainer.algo.grpo import LossAggregation, broadcast_advantages
from trainer.algo.token_stats import token_stats_from_logits
from trainer.step import compute_loss
from trainer.algo.topk_kl import exact_kl_from_hidden

V = 6


def _softmax_case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    theta = (torch.randn(V, dtype=torch.float64, generator=g)).requires_grad_(True)
    old_logits = theta.detach() + 0.6 * torch.randn(V, dtype=torch.float64, generator=g)  # some ratios clip
    ref_logits = theta.detach() + 0.5 * torch.randn(V, dtype=torch.float64, generator=g)
    labels = torch.arange(V).repeat(2, 1)  # (2, V): two rows, every token once
    mask = torch.ones(2, V, dtype=torch.float64)
    mask[1, 1] = 0  # an observation token
    adv = torch.tensor([1.5, -0.75], dtype=torch.float64)  # exact in float32 (token advantages are float32)
    ids = torch.cat([torch.zeros(2, 1, dtype=torch.long), labels], 1)  # one prompt column
    mb = MicroBatch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=mask, response_width=V, stored={})
    return theta, old_logits, ref_logits, labels, mask, adv, mb


def _analytic_pg_grad(theta, old_logits, labels, mask, adv, clip_low, clip_high):
    """∂/∂θ of token-mean PPO: −A·ρ·(e_p − π)/N on tokens where the unclipped branch is taken."""
    pi = torch.softmax(theta.detach(), -1)
    lp, lo = torch.log_softmax(theta.detach(), -1), torch.log_softmax(old_logits, -1)
    grad = torch.zeros(V, dtype=torch.float64)
    n = float(mask.sum())
    for b in range(labels.shape[0]):
        a = float(adv[b])
        for t in range(labels.shape[1]):
            if not mask[b, t]:
                continue
            p = int(labels[b, t])
            rho = math.exp(float(lp[p] - lo[p]))
            clipped = (a > 0 and rho > 1 + clip_high) or (a < 0 and rho < 1 - clip_low)
            if not clipped:
                e = torch.zeros(V, dtype=torch.float64)
                e[p] = 1.0
                grad += -a * rho * (e - pi) / n
    return grad


def _exact_kl_grad(theta, ref_logits, direction):
    lp, lq = torch.log_softmax(theta.detach(), -1), torch.log_softmax(ref_logits, -1)
    p, q = lp.exp(), lq.exp()
    if direction == "reverse":
        return p * (lp - lq - (p * (lp - lq)).sum())  # ∂/∂θ Σ p (lp − lq)
    return p - q  # ∂/∂θ Σ q (lq − lp)


@pytest.mark.parametrize("kl_type", [None, "exact_reverse", "exact_forward", "k3"])
def test_compute_loss_gradient_is_the_analytic_pg_plus_beta_kl_gradient(kl_type):
    theta, old_logits, ref_logits, labels, mask, adv, mb = _softmax_case(1)
    beta = 0.3
    alg = AlgorithmConfig(clip_low=0.2, clip_high=0.28,
                          kl=KLConfig(enabled=kl_type is not None, type=kl_type or "k3", coef=beta, importance_weight=False))
    z = theta.expand(2, V, V)
    policy = token_stats_from_logits(z, labels)
    lq = torch.log_softmax(ref_logits, -1)
    stored = {"old_logp": torch.log_softmax(old_logits, -1)[labels], "advantages": broadcast_advantages(adv, mask).double(),
              "anchor_logp": lq[labels], "anchor_logsumexp": ref_logits.logsumexp(-1).expand(2, V)}
    if kl_type and kl_type.startswith("exact"):
        one = torch.ones(2, V, 1, dtype=torch.float64)
        policy.exact_kl = exact_kl_from_hidden(one, theta[:, None], one, ref_logits[:, None], direction=kl_type.split("_")[1])
    agg = LossAggregation.for_batch("token-mean", mask)
    loss, metrics = compute_loss(policy, mb, stored, alg, agg)
    grad = torch.autograd.grad(loss, theta)[0]
    want = _analytic_pg_grad(theta, old_logits, labels, mask, adv, 0.2, 0.28)
    assert float(metrics["pg_clipfrac"]) > 0  # the clipped branch is exercised
    if kl_type and kl_type.startswith("exact"):
        want = want + beta * _exact_kl_grad(theta, ref_logits, kl_type.split("_")[1])
    elif kl_type == "k3":  # per token: w − log w − 1, w = πref(p)/πθ(p) → ∂/∂θ = (1 − w)(e_p − π), token mean
        pi = torch.softmax(theta.detach(), -1)
        for b in range(2):
            for t in range(V):
                if mask[b, t]:
                    p = int(labels[b, t])
                    w = math.exp(float(lq[p] - torch.log_softmax(theta.detach(), -1)[p]))
                    e = torch.zeros(V, dtype=torch.float64)
                    e[p] = 1.0
                    want = want + beta * (1 - w) * (e - pi) / float(mask.sum())
    assert torch.allclose(grad, want, atol=1e-12, rtol=0)
    if kl_type:
        assert float(metrics["kl"]) != 0.0


def test_compute_loss_on_policy_uses_the_pass_itself_as_pi_old():
    theta, _, ref_logits, labels, mask, adv, mb = _softmax_case(2)
    policy = token_stats_from_logits(theta.expand(2, V, V), labels, entropy=True)
    stored = {"advantages": broadcast_advantages(adv, mask).double()}
    alg = AlgorithmConfig(entropy_coef=0.0, kl=KLConfig(enabled=False))
    loss, m = compute_loss(policy, mb, stored, alg, LossAggregation.for_batch("token-mean", mask))
    assert float(m["ratio_mean"]) == 1.0 and float(m["pg_clipfrac"]) == 0.0
    grad = torch.autograd.grad(loss, theta)[0]  # ρ = 1: −A (e_p − π) / N
    want = _analytic_pg_grad(theta, theta.detach(), labels, mask, adv, 0.2, 0.28)
    assert torch.allclose(grad, want, atol=1e-12, rtol=0)


# ------------------------------------------------------------------ ppo_update on the tiny Qwen2


def _update_cfg(model_dir, *extra: str) -> TrainConfig:
    return load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml", [
        f"model.policy={model_dir}", "data.prompts_per_step=2", "rollout.n_samples=4", "algorithm.mini_batch_size=8",
        "optim.lr=1e-2", "algorithm.kl.type=topk_reverse", "algorithm.kl.topk=4", "algorithm.kl.coef=0.5", *extra,
    ])


def _batch(vocab: int, grouped: bool = False):
    """8 rows, ragged prompts and responses; ``grouped``: rows 0-3 and 4-7 are two GRPO groups (one prompt each)."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, vocab, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist() for _ in range(8)]
    if grouped:
        prompts = [prompts[0]] * 4 + [prompts[1] + prompts[2]] * 4  # two prompts of different lengths
    responses = [torch.randint(5, vocab, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist() for _ in range(8)]
    masks = [[1] * len(r) for r in responses]
    masks[0][1] = 0
    batch = build_token_batch(prompts, responses, masks, pad_id=0)
    adv = torch.tensor([1.0, -1.0, 0.5, 0.0, -0.5, 2.0, -2.0, 0.3])
    batch.stored["advantages"] = broadcast_advantages(adv, batch.loss_mask)
    return batch


def _run_update(model_dir, *extra, corrupt=None, float64=False, grouped=False, bf16=False):
    from trainer import distributed as D
    from trainer.policy import build_policy
    from trainer.step import ppo_update
    from trainer.stored_stats import compute_stored_stats, plan_stored_stats

    torch.manual_seed(0)
    cfg = _update_cfg(model_dir, *extra)
    policy = build_policy(cfg, D.DistInfo(), str(model_dir), bf16=bf16)
    if float64:  # the parameters in place (the optimizer keeps them); the anchor is cast to their dtype when used
        policy.model.double()
    with torch.no_grad():  # a distinct anchor, so the KL term has a gradient
        for t in policy.anchor.tensors.values():
            t.mul_(0.9)
    batch = _batch(policy.model.config.vocab_size, grouped=grouped)
    plan = plan_stored_stats(cfg, on_policy=False, fuse=False)
    compute_stored_stats(batch, plan, policy, cfg, torch.device("cpu"))
    if corrupt is not None:
        corrupt(batch)
    warnings: list[str] = []
    result = ppo_update(batch, policy, plan, cfg, D.DistInfo(), warn=warnings.append)
    assert result.sums.local()["update/tokens"] == float(batch.loss_mask.sum()) * cfg.algorithm.ppo_epochs
    return policy, result, warnings


def test_ppo_update_is_the_same_for_any_micro_batch_size(tiny_model_dir):
    """Token-mean loss normalised for the whole mini-batch: 8 micro-batches of 1 == 1 of 8 (and 2 of 4).

    AdamW with eps = 1 and lr = 1 makes the step ≈ 0.1·gradient (linear), so float-order noise in
    near-zero gradients is not blown up to lr-sized steps and the weights compare tightly."""
    from safetensors.torch import load_file

    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    weights, norms = {}, {}
    for micro in (1, 4, 8):
        policy, result, _ = _run_update(tiny_model_dir, f"algorithm.micro_batch_size={micro}", "optim.lr=1.0",
                                        "optim.eps=1.0", "optim.weight_decay=0")
        assert result.updates == 1 and result.skipped == 0
        weights[micro] = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
        norms[micro] = result.grad_norms[0]
    key = "model.layers.0.mlp.up_proj.weight"
    assert (weights[8][key] - initial[key]).abs().max() > 1e-4  # the update is real
    for micro in (1, 4):
        assert norms[micro] == pytest.approx(norms[8], rel=1e-5)
        for k, v in weights[8].items():
            torch.testing.assert_close(weights[micro][k], v, atol=1e-7, rtol=1e-5)


def test_token_budget_micro_batches_give_the_same_update_in_float64(tiny_model_dir):
    """Micro-batches packed by a token budget (rows sorted by length, index tensors, 7, 4 and 3 of them)
    give the update of one 8-row micro-batch and of 8 one-row micro-batches: float64, to rounding
    (AdamW with eps = 1 maps gradient to step one-to-one, so equal weights mean equal gradients)."""
    from trainer.batch import plan_micro_batches

    exact = ("optim.lr=1.0", "optim.eps=1.0", "optim.weight_decay=0")
    ref_policy, ref, _ = _run_update(tiny_model_dir, "algorithm.micro_batch_size=8", *exact, float64=True)
    ref_weights = ref_policy.model.state_dict()
    batch = _batch(ref_policy.model.config.vocab_size)
    for extra, n_micro in (("algorithm.micro_batch_tokens=12", 7), ("algorithm.micro_batch_tokens=24", 4),
                           ("algorithm.micro_batch_tokens=40", 3), ("algorithm.micro_batch_size=1", 8)):
        if "tokens" in extra:
            assert len(plan_micro_batches(batch, range(8), 8, int(extra.split("=")[1]))) == n_micro
        policy, result, _ = _run_update(tiny_model_dir, "algorithm.micro_batch_size=8", extra, *exact, float64=True)
        assert result.updates == 1 and result.grad_norms[0] == pytest.approx(ref.grad_norms[0], rel=1e-13, abs=0)
        sums, want = result.sums.local(), ref.sums.local()
        for key in ("update/tokens", "update/real_tokens", "update/pg_loss", "update/kl_loss", "update/clipfrac_sum"):
            assert sums[key] == pytest.approx(want[key], rel=1e-12, abs=1e-15), key
        assert sums["update/computed_tokens"] < want["update/computed_tokens"] or extra.endswith("size=1")
        for k, v in policy.model.state_dict().items():
            assert v.dtype == torch.float64
            torch.testing.assert_close(v, ref_weights[k], atol=1e-14, rtol=1e-13)


def test_shared_prompt_updates_equal_one_pass_updates_for_every_micro_batch_plan(tiny_model_dir, monkeypatch):
    """Two GRPO groups of 4 rows (prompts of different lengths, left-padded in one micro-batch; ragged right-padded
    responses), float64: with ``model.share_prompt`` (and ``share_prompt_training``) the training pass (and the stored passes) run each distinct
    prompt of a micro-batch once, and the update equals that of one-pass forwards -- one micro-batch of 8, fixed
    micro-batches of 4 (whole groups) and 2, token-budget micro-batches (planned to keep groups together).
    Qwen2's RMSNorm runs in the model dtype here (it computes in float32 otherwise, which would make sharing,
    which sums a group's gradient before the norm's backward, only float32-exact)."""
    import trainer.model_forward as L
    from transformers.models.qwen2 import modeling_qwen2

    monkeypatch.setattr(modeling_qwen2.Qwen2RMSNorm, "forward", lambda self, h: self.weight * (
        h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)))
    shared = []
    original = L._shared_prompt_hidden
    monkeypatch.setattr(L, "_shared_prompt_hidden", lambda *a: shared.append(original(*a) is not None) or original(*a))
    exact = ("optim.lr=1.0", "optim.eps=1.0", "optim.weight_decay=0")
    ref_policy, ref, _ = _run_update(tiny_model_dir, "model.share_prompt=false", "algorithm.micro_batch_size=8", *exact,
                                     float64=True, grouped=True)
    assert shared == []
    ref_weights = ref_policy.model.state_dict()
    for extra in (("algorithm.micro_batch_size=8",), ("algorithm.micro_batch_size=4",), ("algorithm.micro_batch_size=2",),
                  ("algorithm.micro_batch_size=8", "algorithm.micro_batch_tokens=40")):
        shared.clear()
        policy, result, _ = _run_update(tiny_model_dir, "model.share_prompt=true", *extra, *exact, float64=True, grouped=True)
        assert shared and all(shared), extra  # every pass found a group to share (old, anchor and training passes)
        assert result.updates == 1 and result.grad_norms[0] == pytest.approx(ref.grad_norms[0], rel=1e-12, abs=0), extra
        sums, want = result.sums.local(), ref.sums.local()
        for key in ("update/tokens", "update/pg_loss", "update/kl_loss", "update/clipfrac_sum"):
            assert sums[key] == pytest.approx(want[key], rel=1e-12, abs=1e-15), (extra, key)
        for k, v in policy.model.state_dict().items():
            torch.testing.assert_close(v, ref_weights[k], atol=1e-13, rtol=1e-12, msg=f"{extra} {k}")


def test_token_budget_planner_keeps_groups_together_when_prompts_are_shared():
    """``share_prompts``: the same budget bound, every row once, no more forwards and no more shared-prompt
    tokens than the length-sorted plan -- and, where groups fit whole without an extra forward, fewer
    (distinct prompt, micro-batch) pairs and fewer tokens."""
    from trainer.batch import _prompt_groups, plan_micro_batches

    g = torch.Generator().manual_seed(5)
    prompts, responses = [], []
    for _ in range(6):  # 6 groups of 4, search-like: long shared prompts, ragged responses
        prompt = torch.randint(5, 100, (int(torch.randint(60, 120, (1,), generator=g)),), generator=g).tolist()
        for _ in range(4):
            prompts.append(prompt)
            responses.append([9] * int(torch.randint(1, 200, (1,), generator=g)))
    batch = build_token_batch(prompts, responses, [[1] * len(r) for r in responses], pad_id=0)
    group = _prompt_groups(batch, range(24))
    assert len(set(group.values())) == 6

    def shared_cost(micro):  # what the shared-prompt forwards compute: distinct prompts once, every response
        total = 0
        for m in micro:
            mb = batch.micro(m)
            total += len({group[i] for i in m.tolist()}) * (mb.input_ids.shape[1] - mb.response_width)
            total += len(m) * mb.response_width
        return total

    gains = []
    for budget in (1200, 2400, 5000):
        plain = plan_micro_batches(batch, range(24), 4, budget)
        kept = plan_micro_batches(batch, range(24), 4, budget, share_prompts=True)
        assert sorted(i for m in kept for i in m.tolist()) == list(range(24))
        for m in kept:
            assert len(m) * batch.micro(m).input_ids.shape[1] <= budget or len(m) == 1
        assert len(kept) <= len(plain) and shared_cost(kept) <= shared_cost(plain)
        pairs = [sum(len({group[i] for i in m.tolist()}) for m in micro) for micro in (plain, kept)]
        gains.append((shared_cost(plain) - shared_cost(kept), pairs))
    assert any(gain > 0 and pairs[1] < pairs[0] for gain, pairs in gains), gains
    assert plan_micro_batches(batch, range(24), 4, 0, share_prompts=True) == plan_micro_batches(batch, range(24), 4)


def test_token_budget_planner_partitions_rows_within_the_budget():
    from trainer.batch import plan_micro_batches

    g = torch.Generator().manual_seed(3)
    prompts = [[7] * int(torch.randint(20, 40, (1,), generator=g)) for _ in range(24)]
    responses = [[9] * int(torch.randint(1, 300, (1,), generator=g)) for _ in range(24)]
    batch = build_token_batch(prompts, responses, [[1] * len(r) for r in responses], pad_id=0)
    real = batch.attention_mask.sum()

    def computed(micro):
        return sum(batch.micro(rows).input_ids.numel() for rows in micro)

    fixed = plan_micro_batches(batch, range(24), 4)
    assert fixed == [slice(i, i + 4) for i in range(0, 24, 4)]  # 0 keeps today's fixed rows
    widest = int((batch.prompt_lens.max() + batch.response_lens.max()))
    for budget in (100, 800, 2000, 4 * widest, 10_000):
        for rows in (range(24), range(8, 16)):
            micro = plan_micro_batches(batch, rows, 4, budget)
            got = sorted(i for m in micro for i in m.tolist())
            assert got == list(rows)  # every row exactly once
            for m in micro:
                width = batch.micro(m).input_ids.shape[1]
                assert len(m) * width <= budget or len(m) == 1  # within budget; a longer row goes alone
            assert len(plan_micro_batches(batch, rows, 4, budget, at_least=len(rows))) == len(rows)
    # The budget of 4 rows of the widest trajectory (fixed rows' worst case): no more forwards, far less padding.
    packed = plan_micro_batches(batch, range(24), 4, 4 * widest)
    assert len(packed) <= len(fixed)
    pad_fixed, pad_packed = 1 - float(real) / computed(fixed), 1 - float(real) / computed(packed)
    assert pad_fixed > 0.25 and pad_packed < pad_fixed / 2, (pad_fixed, pad_packed)  # measured 0.29 and 0.12


def test_ppo_update_skips_a_non_finite_step_and_changes_nothing(tiny_model_dir):
    def poison(batch):
        batch.stored["advantages"][2, 0] = float("nan")  # a trained token

    policy, result, warnings = _run_update(tiny_model_dir, "algorithm.micro_batch_size=4", corrupt=poison)
    assert result.updates == 0 and result.skipped == 1 and result.grad_norms == []
    assert len(warnings) == 1 and "update skipped" in warnings[0]
    assert all(p.grad is None for p in policy.parameters())
    assert not policy.optimizer.state  # AdamW never stepped


def test_ppo_update_masked_nan_does_not_skip(tiny_model_dir):
    """A NaN advantage on an observation token is masked out: the update goes ahead."""
    def poison(batch):
        batch.stored["advantages"][0, 1] = float("nan")  # loss_mask[0, 1] == 0

    _, result, warnings = _run_update(tiny_model_dir, "algorithm.micro_batch_size=4", corrupt=poison)
    assert result.updates == 1 and result.skipped == 0 and not warnings
    assert all(math.isfinite(g) for g in result.grad_norms)


def test_ppo_update_mini_batches_and_epochs(tiny_model_dir):
    _, result, _ = _run_update(tiny_model_dir, "algorithm.mini_batch_size=4", "algorithm.micro_batch_size=2",
                               "algorithm.ppo_epochs=2")
    assert result.updates == 4 and len(result.grad_norms) == 4  # 8 rows / 4 per step, twice


def test_ppo_update_reports_the_norm_before_clipping(tiny_model_dir):
    _, clipped, _ = _run_update(tiny_model_dir, "optim.grad_clip=1e-6")
    _, free, _ = _run_update(tiny_model_dir, "optim.grad_clip=0")
    assert clipped.grad_norms == pytest.approx(free.grad_norms, rel=1e-6) and free.grad_norms[0] > 1e-6


def test_bf16_autocast_update_on_cpu_matches_the_fp32_update(tiny_model_dir):
    """``run.precision=bf16`` on a CPU: bf16 autocast over fp32 master weights. Stated tolerance against the fp32
    reference on the same batch: the gradient norm within 5% and the weight step's direction (cosine over every
    parameter) above 0.99; the master weights stay fp32 (AdamW with eps = 1, lr = 1: step ≈ 0.1·gradient)."""
    from safetensors.torch import load_file

    initial = load_file(str(tiny_model_dir / "model.safetensors"))
    steps, norms = {}, {}
    for bf16 in (False, True):
        policy, result, _ = _run_update(tiny_model_dir, "optim.lr=1.0", "optim.eps=1.0", "optim.weight_decay=0", bf16=bf16)
        assert result.updates == 1 and result.skipped == 0
        state = policy.model.state_dict()
        assert all(v.dtype == torch.float32 for v in state.values())
        steps[bf16] = torch.cat([(state[k].detach() - initial[k]).flatten() for k in initial if k in state])
        norms[bf16] = result.grad_norms[0]
    assert norms[True] == pytest.approx(norms[False], rel=0.05)
    cosine = torch.nn.functional.cosine_similarity(steps[True], steps[False], dim=0)
    assert cosine > 0.99
    assert not torch.equal(steps[True], steps[False])  # bf16 really ran: the steps differ by rounding


def test_precision_bf16_on_cpu_runs_where_the_cpu_multiplies_bf16_natively():
    from trainer.policy import use_bf16

    cpu = torch.device("cpu")
    cfg = load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml", ["run.precision=bf16"])
    assert use_bf16(cfg, cpu, native_cpu_bf16=True) is True
    assert use_bf16(cfg, cpu, native_cpu_bf16=False) is False  # emulated bf16 is slower: fp32, with a warning
    auto = load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml", ["run.precision=auto"])
    assert use_bf16(auto, cpu, native_cpu_bf16=True) is False  # auto stays fp32 on CPU
    fp32 = load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml", ["run.precision=fp32"])
    assert use_bf16(fp32, cpu, native_cpu_bf16=True) is False
