"""GRPO advantages, PPO clipping, loss aggregation invariance and loss masks."""

import math
import uuid

import pytest
import torch

from trainer.algo.grpo import (
    AGG_MODES,
    LossAggregation,
    aggregate_loss,
    broadcast_advantages,
    compute_policy_loss,
    group_index,
    grpo_advantages,
    ppo_clip_loss,
)
from trainer.config import KLConfig
from trainer.algo.kl_kinds import get_kl_kind
from trainer.algo.token_stats import TokenStats

EPS = 1e-6


def test_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 2.0])
    ids = ["a", "a", "a", "a", "b", "b"]
    adv = grpo_advantages(rewards, ids)
    # group a: mean .75, unbiased std sqrt((3·.0625 + .5625)/3) = .5; group b: mean 1, std sqrt(2)
    want = [0.25 / (0.5 + EPS), -0.75 / (0.5 + EPS), 0.25 / (0.5 + EPS), 0.25 / (0.5 + EPS),
            -1 / (math.sqrt(2) + EPS), 1 / (math.sqrt(2) + EPS)]
    assert torch.allclose(adv, torch.tensor(want), atol=1e-6)
    biased = grpo_advantages(rewards, ids, unbiased_std=False)
    assert torch.allclose(biased[4:], torch.tensor([-1.0, 1.0]) / (1 + EPS), atol=1e-6)
    dr = grpo_advantages(rewards, ids, norm_by_std=False)
    assert torch.allclose(dr, torch.tensor([0.25, -0.75, 0.25, 0.25, -1.0, 1.0]))


def test_group_of_size_one_gets_its_reward():
    adv = grpo_advantages(torch.tensor([0.7, 1.0, 0.0]), ["x", "y", "y"])
    assert math.isclose(adv[0].item(), 0.7 / (1 + EPS), rel_tol=1e-7)  # mean 0, std 1 (paper code)
    assert grpo_advantages(torch.tensor([0.7]), ["x"], norm_by_std=False).item() == pytest.approx(0.7)


def test_unique_ids_of_any_hashable_type_interleaved():
    u1, u2 = uuid.uuid4(), uuid.uuid4()
    rewards = torch.tensor([1.0, 3.0, 0.0, 5.0])
    adv = grpo_advantages(rewards, [str(u1), u2, str(u1), u2], norm_by_std=False)
    assert adv.tolist() == [0.5, -1.0, -0.5, 1.0]
    assert group_index([("nq", 0), ("hotpotqa", 0), ("nq", 0)]).tolist() == [0, 1, 0]
    assert group_index(torch.tensor([7, 3, 7])).tolist() == [0, 1, 0]
    # Per-dataset row indices would merge groups: distinct ids keep NQ #0 and HotpotQA #0 apart.
    merged = grpo_advantages(rewards, [0, 0, 0, 0], norm_by_std=False)
    assert not torch.allclose(merged, adv)
    with pytest.raises(ValueError):
        grpo_advantages(rewards, ["a"])


def test_broadcast_advantages_respects_mask():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert broadcast_advantages(torch.tensor([2.0, -1.0]), mask).tolist() == [[2, 2, 0], [-1, 0, 0]]


def test_ppo_clip_cases_and_dual_clip():
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0, 1.0])
    ratio = torch.tensor([1.5, 1.1, 0.5, 5.0, 1.0, 0.5])
    old = torch.zeros(6)
    logp = torch.log(ratio).requires_grad_(True)
    loss, info = ppo_clip_loss(logp, old, adv, clip_low=0.2, clip_high=0.28)
    want = [-1.28, -1.1, 0.8, 5.0, 1.0, -0.5]
    assert torch.allclose(loss, torch.tensor(want), atol=1e-6)
    assert info["clipped_high"].tolist() == [1, 0, 0, 0, 0, 0]
    assert info["clipped_low"].tolist() == [0, 0, 1, 0, 0, 0]
    grad = torch.autograd.grad(loss.sum(), logp)[0]
    assert grad[0] == 0 and grad[2] == 0  # clipped tokens get no gradient
    loss_d, info_d = ppo_clip_loss(logp, old, adv, clip_low=0.2, clip_high=0.28, dual_clip_c=3.0)
    assert torch.allclose(loss_d, torch.tensor([-1.28, -1.1, 0.8, 3.0, 1.0, -0.5]), atol=1e-6)
    assert info_d["dual_clipped"].tolist() == [0, 0, 0, 1, 0, 0]
    assert torch.autograd.grad(loss_d.sum(), logp)[0][3] == 0
    # log-ratio clamp keeps exp finite
    huge, _ = ppo_clip_loss(torch.tensor([100.0]), torch.tensor([0.0]), torch.tensor([-1.0]), log_ratio_clamp=20.0)
    assert math.isclose(huge.item(), math.exp(20.0), rel_tol=1e-6)
    with pytest.raises(ValueError):
        ppo_clip_loss(logp, old, adv, dual_clip_c=0.5)


def test_policy_loss_metrics():
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    logp = torch.log(torch.tensor([[1.5, 1.1, 0.5, 5.0]]))
    mask = torch.tensor([[1, 1, 1, 1]])
    agg = LossAggregation.for_batch("token-mean", mask)
    loss, m = compute_policy_loss(logp, torch.zeros(1, 4), adv, mask, agg, dual_clip_c=3.0, entropy=torch.ones(1, 4))
    assert m["pg_clipfrac_high"].item() == 0.25 and m["pg_clipfrac_low"].item() == 0.25
    assert m["pg_clipfrac"].item() == 0.5 and m["pg_clipfrac_dual"].item() == 0.25
    assert m["ratio_max"].item() == pytest.approx(5.0) and m["ratio_min"].item() == pytest.approx(0.5)
    assert m["ppo_kl"].item() == pytest.approx(-logp.mean().item())
    assert m["tokens"].item() == 4 and m["entropy"].item() == 1.0
    assert loss.item() == pytest.approx((-1.28 - 1.1 + 0.8 + 3.0) / 4, abs=1e-6)
    loss_e, _ = compute_policy_loss(logp, torch.zeros(1, 4), adv, mask, agg, dual_clip_c=3.0,
                                    entropy=torch.ones(1, 4), entropy_coef=0.01)
    assert loss_e.item() == pytest.approx(loss.item() - 0.01)


def _batch(seed=0, n=8, T=9):
    """Per-token losses from a differentiable parameter, varied lengths, observation holes."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(n, T, dtype=torch.float64, generator=g).requires_grad_(True)
    lengths = torch.tensor([9, 2, 5, 7, 1, 9, 3, 6])
    mask = (torch.arange(T)[None] < lengths[:, None]).to(torch.float64)
    mask[0, 3:6] = 0  # a tool observation inside the response
    mask[3, 1:3] = 0
    return theta, mask


def _full_formula(values, mask, mode, norm_length=9.0):
    seqs = (mask.sum(-1) > 0).sum()
    if mode == "token-mean":
        return (values * mask).sum() / mask.sum()
    if mode == "seq-mean-token-mean":
        return ((values * mask).sum(-1) / mask.sum(-1)).sum() / seqs
    if mode == "seq-mean-token-sum":
        return (values * mask).sum() / seqs
    return (values * mask).sum() / (seqs * norm_length)


@pytest.mark.parametrize("mode", [m for m in AGG_MODES if m != "microbatch-token-mean"])
def test_micro_batch_1_x_8_equals_8_x_1(mode):
    theta, mask = _batch()
    values = lambda: torch.sin(theta) * 2 + theta ** 2  # noqa: E731
    agg = LossAggregation.for_batch(mode, mask, num_micro_batches=8, norm_length=9.0)
    full = aggregate_loss(values(), mask, agg)
    assert torch.allclose(full, _full_formula(values(), mask, mode), atol=1e-12)
    g_full = torch.autograd.grad(full, theta)[0]
    total = sum(aggregate_loss(values()[i : i + 1], mask[i : i + 1], agg) for i in range(8))
    g_micro = torch.autograd.grad(total, theta)[0]
    assert torch.allclose(total, full, atol=1e-12)
    assert torch.allclose(g_micro, g_full, atol=1e-12)
    # Built from the list of micro-batch masks, the normaliser is the same.
    assert LossAggregation.for_batch(mode, list(mask.split(1)), norm_length=9.0).global_tokens == agg.global_tokens


def test_legacy_microbatch_mode_depends_on_the_split_when_lengths_differ():
    theta, mask = _batch()
    values = lambda: torch.sin(theta) * 2 + theta ** 2  # noqa: E731
    one = aggregate_loss(values(), mask, LossAggregation.for_batch("microbatch-token-mean", mask, num_micro_batches=1))
    agg8 = LossAggregation.for_batch("microbatch-token-mean", mask, num_micro_batches=8)
    eight = sum(aggregate_loss(values()[i : i + 1], mask[i : i + 1], agg8) for i in range(8))
    assert torch.allclose(one, _full_formula(values(), mask, "token-mean"), atol=1e-12)
    assert abs(one.item() - eight.item()) > 1e-3
    # With equal lengths and no holes it coincides with token-mean.
    full_mask = torch.ones_like(mask)
    one = aggregate_loss(values(), full_mask, LossAggregation.for_batch("microbatch-token-mean", full_mask))
    eight = sum(aggregate_loss(values()[i : i + 1], full_mask[i : i + 1], agg8) for i in range(8))
    assert torch.allclose(one, eight, atol=1e-12)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_masked_observation_tokens_get_exactly_zero_gradient(mode):
    theta, mask = _batch(1)
    values = theta.clone()
    values = values + torch.where(mask.bool(), 0.0, float("nan"))  # garbage in masked slots is ignored
    agg = LossAggregation.for_batch(mode, mask, norm_length=9.0)
    loss = aggregate_loss(values, mask, agg)
    assert torch.isfinite(loss)
    grad = torch.autograd.grad(loss, theta)[0]
    assert torch.all(grad[mask == 0] == 0)
    assert torch.all(grad[mask == 1] != 0)


@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_overflowing_ratio_at_a_masked_token_keeps_the_gradient_finite_and_exact(dual_clip):
    """log ρ = 1000 at an observation token: exp overflows to inf there, and 0·inf = NaN used to reach the
    gradient; the log ratio is masked before the exponential, so every gradient is exact."""
    logp = torch.tensor([[-1.0, 0.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.2, -1000.0, -1.9, -0.5]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]], dtype=torch.float64)
    agg = LossAggregation.for_batch("token-mean", mask)
    loss, m = compute_policy_loss(logp, old, adv, mask, agg, dual_clip_c=dual_clip)
    grad = torch.autograd.grad(loss, logp)[0]
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    # A = 1 > 0: ρ = e^0.2 > 1.28? no (1.2214), so every unmasked token takes the unclipped branch: ∂/∂logp = −ρ/3.
    rho = torch.exp(logp.detach() - old)
    want = torch.where(mask.bool(), -rho / 3, torch.zeros_like(rho))
    assert torch.equal(grad[0, 1], torch.tensor(0.0, dtype=torch.float64))
    assert torch.allclose(grad, want, atol=1e-15, rtol=0)
    assert float(m["ratio_max"]) == pytest.approx(math.exp(0.2))  # the masked token's ratio is not reported


def test_dp_size_scales_and_validation():
    theta, mask = _batch()
    agg = LossAggregation("token-mean", global_tokens=float(mask.sum()), global_seqs=8.0, dp_size=4)
    base = LossAggregation("token-mean", global_tokens=float(mask.sum()), global_seqs=8.0)
    assert torch.allclose(aggregate_loss(theta, mask, agg), 4 * aggregate_loss(theta, mask, base))
    with pytest.raises(ValueError, match="norm_length"):
        LossAggregation.for_batch("seq-mean-token-sum-norm", mask)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        LossAggregation.for_batch("token-sum", mask)


def test_kl_loss_sampled_with_importance_weight():
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(2, 5, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    ref = -torch.rand(2, 5, generator=g, dtype=torch.float64) * 3
    old = logp.detach() - 0.1
    mask = torch.ones(2, 5)
    mask[0, 4] = 0
    agg = LossAggregation.for_batch("seq-mean-token-mean", mask)
    pol, anc = TokenStats(logp, torch.zeros_like(logp)), TokenStats(ref, torch.zeros_like(ref))
    iw = KLConfig(type="low_var_kl", importance_weight=True)
    loss, m = get_kl_kind("low_var_kl").loss(pol, anc, torch.zeros(2, 5, dtype=torch.long), mask, agg, cfg=iw, old_logp=old)
    lw = ref - logp.detach()
    per = torch.exp(torch.tensor(0.1, dtype=torch.float64)) * (lw.exp() - lw - 1)
    want = ((per * mask).sum(-1) / mask.sum(-1)).mean()
    assert torch.allclose(loss, want, atol=1e-12)
    assert m["kl_iw_mean"].item() == pytest.approx(math.exp(0.1))
    with pytest.raises(ValueError, match="old_logp"):
        get_kl_kind("k3").loss(pol, anc, None, mask, agg, cfg=iw)
    with pytest.raises(KeyError, match="known"):
        get_kl_kind("k9")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_end_to_end_micro_batching_on_a_real_model(tiny_model_dir, mode):
    """PG + Top-k KL through the fused token-stats pass of a real (tiny) Qwen2: 1×8 == 8×1."""
    from transformers import AutoModelForCausalLM

    from trainer.model_forward import causal_lm_token_stats
    from trainer.algo.grpo import LossAggregation as Agg

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval()
    n, P, R = 8, 4, 6
    ids = torch.randint(3, model.config.vocab_size, (n, P + R))
    attn = torch.ones_like(ids)
    lengths = torch.tensor([6, 2, 5, 3, 6, 1, 4, 6])
    loss_mask = (torch.arange(R)[None] < lengths[:, None]).double()
    loss_mask[0, 2:4] = 0  # observation tokens
    adv = grpo_advantages(torch.tensor([1.0, 0, 1, 0, 1, 1, 0, 0]), ["a", "a", "b", "b", "c", "c", "d", "d"])
    with torch.no_grad():
        old = causal_lm_token_stats(model, ids, attn, R, topk=5).detach()
        anchor = causal_lm_token_stats(model, ids, attn, R, gather_indices=old.topk_indices).detach()
        anchor.logp = anchor.logp - 0.1  # a distinct anchor
    old_logp = old.logp - 0.05

    def step(micro: int) -> dict[str, torch.Tensor]:
        model.zero_grad()
        agg = Agg.for_batch(mode, loss_mask, num_micro_batches=n // micro)
        for s in range(0, n, micro):
            sl = slice(s, s + micro)
            stats = causal_lm_token_stats(model, ids[sl], attn[sl], R, gather_indices=old.topk_indices[sl])
            pg, _ = compute_policy_loss(stats.logp, old_logp[sl], adv[sl], loss_mask[sl], agg)
            sub = TokenStats(anchor.logp[sl], anchor.logsumexp[sl], anchor.topk_logits[sl], anchor.topk_indices[sl])
            kl, _ = get_kl_kind("topk_reverse").loss(stats, sub, ids[sl, -R:], loss_mask[sl], agg,
                                                     cfg=KLConfig(topk=5, importance_weight=True), old_logp=old_logp[sl])
            (pg + 0.5 * kl).backward()
        return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    big, small = step(8), step(1)
    assert big
    for k in big:
        assert torch.allclose(big[k], small[k], atol=1e-10, rtol=1e-8), k
