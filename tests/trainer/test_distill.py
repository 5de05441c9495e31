"""On-policy distillation (trainer/algo/distill.py) by exact enumeration in float64.

A (1, V) batch whose position p samples token p, all positions sharing one context (the policy's logits
θ and the teacher's logits φ): Σ_p sg(πθ(p))·L(p) is the exact expectation of the per-token loss L
under sampling from the student, and its gradient the expected gradient. Both estimators must give
KL(πθ‖π_T) and ∇KL(πθ‖π_T) exactly. The modes are checked through the trainer's own
:func:`trainer.step.compute_loss`.
"""

import pytest
import torch

from emapg.config import ConfigError, from_dict
from trainer.algo.distill import (TeacherScores, below_best_rows, distill_estimator_names, distill_loss, distill_metrics,
                                  get_distill_estimator, sampled_reverse_kl_advantage)
from trainer.algo.grpo import LossAggregation
from trainer.algo.token_stats import token_stats_from_logits
from trainer.batch import MicroBatch
from trainer.config import AlgorithmConfig, DistillConfig, KLConfig
from trainer.step import _split_distill_topk, compute_loss

V = 7


def _logits(seed):
    g = torch.Generator().manual_seed(seed)
    theta = (1.3 * torch.randn(V, dtype=torch.float64, generator=g)).requires_grad_(True)
    phi = 1.3 * torch.randn(V, dtype=torch.float64, generator=g)
    return theta, phi


def _teacher(phi, k):
    lp = torch.log_softmax(phi, -1)
    labels = torch.arange(V)[None]
    top = torch.topk(lp, k).indices if k else torch.zeros(0, dtype=torch.long)
    idx = top.expand(1, V, k)
    return TeacherScores(lp[None].clone(), lp[top].expand(1, V, k).clone(), idx), labels, idx


def _exact_kl(theta, phi):
    lp, lt = torch.log_softmax(theta, -1), torch.log_softmax(phi, -1)
    return (lp.exp() * (lp - lt)).sum()


def _expectation(name, theta, phi, k):
    teacher, labels, idx = _teacher(phi, k)
    gather = idx if get_distill_estimator(name).needs_topk else None
    policy = token_stats_from_logits(theta.expand(1, V, V), labels, gather_indices=gather)
    mask = torch.ones(1, V, dtype=torch.float64)
    per_tok = get_distill_estimator(name).per_token(policy, teacher, labels, mask)
    weights = torch.softmax(theta, -1).detach()  # sampling from the student
    value = (weights * per_tok[0]).sum()
    return value.detach(), torch.autograd.grad(value, theta)[0]


@pytest.mark.parametrize("name,k", [("sampled_reverse_kl", 0), ("topk_reverse_kl", 3), ("topk_reverse_kl", 1), ("topk_reverse_kl", V)])
@pytest.mark.parametrize("seed", [0, 1])
def test_estimators_are_the_reverse_kl_in_value_and_gradient(name, k, seed):
    theta, phi = _logits(seed)
    value, grad = _expectation(name, theta, phi, k)
    kl = _exact_kl(theta, phi)
    true_grad = torch.autograd.grad(kl, theta)[0]
    torch.testing.assert_close(value, kl.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, true_grad, rtol=1e-12, atol=1e-12)


def _coarsened_forward_kl(theta, phi, k):
    """KL(π_T‖πθ) of both distributions coarsened to the teacher's top-k tokens and one bucket for the rest, by
    enumeration over the vocabulary."""
    lp, lt = torch.log_softmax(theta, -1), torch.log_softmax(phi, -1)
    top = torch.topk(lt, k).indices
    rest = torch.ones(V, dtype=torch.bool)
    rest[top] = False
    p, pt = lp.exp(), lt.exp()
    kl = (pt[top] * (lt[top] - lp[top])).sum()
    if rest.any():
        kl = kl + pt[rest].sum() * (torch.log(pt[rest].sum()) - torch.log(p[rest].sum()))
    return kl


@pytest.mark.parametrize("k", [1, 3, V])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_topk_forward_kl_is_the_coarsened_forward_kl_in_value_and_gradient_at_every_sample(k, seed):
    """The value does not depend on the sampled token: every position (each sampling a different token) gives the
    enumerated KL of the coarsened distributions, and its gradient; with k = V it is the full forward KL."""
    theta, phi = _logits(seed)
    teacher, labels, idx = _teacher(phi, k)
    policy = token_stats_from_logits(theta.expand(1, V, V), labels, gather_indices=idx)
    per_tok = get_distill_estimator("topk_forward_kl").per_token(policy, teacher, labels, torch.ones(1, V, dtype=torch.float64))
    exact = _coarsened_forward_kl(theta, phi, k)
    true_grad = torch.autograd.grad(exact, theta)[0]
    for pos in range(V):
        torch.testing.assert_close(per_tok[0, pos], exact.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(torch.autograd.grad(per_tok[0, pos], theta, retain_graph=True)[0], true_grad,
                                   rtol=1e-10, atol=1e-12)
    if k == V:
        lp, lt = torch.log_softmax(theta, -1), torch.log_softmax(phi, -1)
        torch.testing.assert_close(exact, (lt.exp() * (lt - lp)).sum(), rtol=1e-12, atol=1e-12)
    # a lower bound of the full forward KL (data processing)
    lp, lt = torch.log_softmax(theta.detach(), -1), torch.log_softmax(phi, -1)
    assert float(exact.detach()) <= float((lt.exp() * (lt - lp)).sum()) + 1e-12


def test_topk_forward_kl_keeps_its_gradient_where_the_reverse_kl_loses_it():
    """A student sure of the token the teacher rules out (the measured failure: it answers where the teacher
    searches): the reverse KL's gradient on the teacher's token shrinks with the student's probability of it, the
    forward KL's stays near -π_T(j) = -1."""
    theta = torch.tensor([12.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64, requires_grad=True)  # student: token 0
    phi = torch.tensor([0.0, 12.0, 0.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)  # teacher: token 1
    fwd = torch.autograd.grad(_coarsened_forward_kl(theta, phi, V), theta)[0][1]
    rev = torch.autograd.grad(_exact_kl(theta, phi), theta)[0][1]
    assert float(fwd) == pytest.approx(-1.0, abs=1e-3)
    assert abs(float(rev)) < 0.02 * abs(float(fwd))


def test_sampled_advantage_is_minus_the_log_ratio_and_zero_on_masked_tokens():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    tlogp = torch.tensor([[-1.5, -1.0, float("nan")]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    assert sampled_reverse_kl_advantage(logp, tlogp, mask).tolist() == [[-0.5, 1.0, 0.0]]


@pytest.mark.parametrize("name", ["sampled_reverse_kl", "topk_reverse_kl", "topk_forward_kl"])
def test_masked_tokens_are_never_distilled(name):
    """Observation/tool-output tokens (loss mask 0) contribute nothing to the value or the gradient, even
    with a teacher whose scores there are garbage (NaN)."""
    g = torch.Generator().manual_seed(3)
    T, k = 5, 2
    z = torch.randn(2, T, V, dtype=torch.float64, generator=g).requires_grad_(True)
    zt = torch.randn(2, T, V, dtype=torch.float64, generator=g)
    labels = torch.randint(0, V, (2, T), generator=g)
    mask = torch.tensor([[1, 1, 0, 0, 1], [0, 1, 1, 0, 0]], dtype=torch.float64)
    lt = torch.log_softmax(zt, -1)
    top = torch.topk(lt, k).indices
    t_logp = lt.gather(-1, labels[..., None])[..., 0]
    t_topk = lt.gather(-1, top)
    garbage = lambda x: torch.where(mask.bool().reshape(mask.shape + (1,) * (x.dim() - 2)), x, torch.full_like(x, float("nan")))  # noqa: E731
    agg = LossAggregation.for_batch("token-mean", mask)

    def run(teacher):
        policy = token_stats_from_logits(z, labels, gather_indices=top if name != "sampled_reverse_kl" else None)
        loss, m = distill_loss(name, policy, teacher, labels, mask, agg)
        return loss, torch.autograd.grad(loss, z)[0], m

    loss, grad, m = run(TeacherScores(t_logp, t_topk, top))
    loss_g, grad_g, _ = run(TeacherScores(garbage(t_logp), garbage(t_topk), top))
    assert torch.isfinite(loss_g) and torch.isfinite(grad_g).all()
    torch.testing.assert_close(loss_g, loss, rtol=0, atol=0)
    torch.testing.assert_close(grad_g, grad, rtol=0, atol=0)
    assert grad[~mask.bool()].abs().sum() == 0  # no gradient reaches a masked position's logits
    assert float(m["distill/tokens"]) == float(mask.sum())
    lp = torch.log_softmax(z.detach(), -1).gather(-1, labels[..., None])[..., 0]
    assert float(m["distill/rkl_sum"]) == pytest.approx(float(((lp - t_logp) * mask).sum()))


def test_below_best_rows():
    assert below_best_rows([1.0, 0.0, 0.0, 0.5, 0.5, 0.2], ["a", "a", "b", "b", "c", "c"]).tolist() == [
        False, True, True, False, False, True]
    assert below_best_rows([1.0, 1.0], [0, 0]).tolist() == [False, False]  # a group of equal rewards: nothing


def _loss(mode, stored_extra=None, estimator="sampled_reverse_kl", coef=0.7):
    """compute_loss on a 2-row batch: task advantages and a teacher; returns (loss, grad, metrics)."""
    g = torch.Generator().manual_seed(5)
    T = 4
    z = torch.randn(2, T, V, dtype=torch.float64, generator=g).requires_grad_(True)
    zt = torch.randn(2, T, V, dtype=torch.float64, generator=g)
    labels = torch.randint(0, V, (2, T), generator=g)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]], dtype=torch.float64)
    lt = torch.log_softmax(zt, -1)
    top = torch.topk(lt, 3).indices
    stored = {"advantages": torch.tensor([[1.0] * T, [-0.5] * T], dtype=torch.float64),
              "teacher_logp": lt.gather(-1, labels[..., None])[..., 0],
              "teacher_topk_logp": lt.gather(-1, top), "teacher_topk_indices": top, **(stored_extra or {})}
    alg = AlgorithmConfig(kl=KLConfig(enabled=False), distill=DistillConfig(
        enabled=mode is not None, teacher="t", coef=coef, mode=mode or "added", estimator=estimator))
    agg = LossAggregation.for_batch("token-mean", mask)
    mb = MicroBatch(labels, torch.ones_like(labels), mask, T, stored)
    policy = token_stats_from_logits(z, labels, gather_indices=top if estimator != "sampled_reverse_kl" else None, entropy=True)
    loss, m = compute_loss(policy, mb, stored, alg, agg)
    student = token_stats_from_logits(z, labels, gather_indices=top if estimator != "sampled_reverse_kl" else None)
    return loss, z, m, (student, labels, mask, agg, stored)


@pytest.mark.parametrize("estimator", ["sampled_reverse_kl", "topk_reverse_kl", "topk_forward_kl"])
def test_modes_through_compute_loss(estimator):
    from trainer.algo.distill import teacher_from_stored

    task, _, _, _ = _loss(None, estimator=estimator)  # distillation off: the task's policy loss
    added, z, m, (student, labels, mask, agg, stored) = _loss("added", estimator=estimator)
    dl, _ = distill_loss(estimator, student, teacher_from_stored(stored), labels, mask, agg)
    torch.testing.assert_close(added, task + 0.7 * dl, rtol=1e-12, atol=1e-12)
    assert float(m["distill/tokens"]) == 6.0
    alone, _, _, _ = _loss("alone", estimator=estimator)
    torch.testing.assert_close(alone, 0.7 * dl, rtol=1e-12, atol=1e-12)
    rows = torch.tensor([[0.0] * 4, [1.0] * 4], dtype=torch.float64)  # only row 1 is below its group's best
    below, _, mb, _ = _loss("below_best", {"distill_rows": rows}, estimator=estimator)
    dl1, _ = distill_loss(estimator, student, teacher_from_stored(stored), labels, mask, agg, row_weights=rows)
    torch.testing.assert_close(below, task + 0.7 * dl1, rtol=1e-12, atol=1e-12)
    assert float(mb["distill/tokens"]) == 3.0


def test_policy_view_split_keeps_the_kl_q_and_the_teachers_topk():
    g = torch.Generator().manual_seed(2)
    z = torch.randn(1, 3, V, dtype=torch.float64, generator=g)
    labels = torch.randint(0, V, (1, 3), generator=g)
    q = torch.randint(0, V, (1, 3, 2), generator=g)
    t = torch.randint(0, V, (1, 3, 3), generator=g)
    both = token_stats_from_logits(z, labels, gather_indices=torch.cat([q, t], -1))
    alg = AlgorithmConfig(distill=DistillConfig(enabled=True, teacher="x", estimator="topk_reverse_kl"))
    kl_view, student = _split_distill_topk(both, {"teacher_topk_indices": t}, alg)
    torch.testing.assert_close(kl_view.topk_logits, z.gather(-1, q))
    assert torch.equal(kl_view.topk_indices, q) and torch.equal(student.topk_indices, t)
    torch.testing.assert_close(student.topk_logits, z.gather(-1, t))


def test_registry_config_and_metrics():
    assert distill_estimator_names() == ["sampled_reverse_kl", "topk_forward_kl", "topk_reverse_kl"]
    with pytest.raises(KeyError, match="unknown distillation estimator 'k9'"):
        get_distill_estimator("k9")
    assert not AlgorithmConfig().distill.enabled  # off by default
    with pytest.raises(ConfigError, match="exactly one of distill.teacher"):
        from_dict(AlgorithmConfig, {"distill": {"enabled": True}})
    with pytest.raises(ConfigError, match="exactly one of distill.teacher"):
        from_dict(AlgorithmConfig, {"distill": {"enabled": True, "teacher": "a", "teacher_urls": ["http://x:1"]}})
    with pytest.raises(ConfigError, match="distill.estimator"):
        from_dict(AlgorithmConfig, {"distill": {"enabled": True, "teacher": "a", "estimator": "forward"}})
    out = distill_metrics({"distill/tokens": 4.0, "distill/rkl_sum": 2.0, "distill/value_sum": 1.0, "distill/loss": 3.0,
                           "update/tokens": 8.0}, world_size=1, steps=2)
    assert out == {"distill/reverse_kl": 0.5, "distill/value_mean": 0.25, "distill/loss": 1.5, "distill/tokens": 4.0,
                   "distill/token_frac": 0.5}


# --- off-policy: the engine (μ) sampled the tokens, not π_old -----------------------------------------------------
# One V-token state sampled from μ: position p samples token p under its own one-token mask, so Σ_p μ(p)·loss(p) is
# the exact expectation over the engine's samples of what compute_loss returns, and its gradient the expected gradient.


def _behaviour_setup(seed, theta_offset):
    g = torch.Generator().manual_seed(seed)
    prox = 1.1 * torch.randn(V, dtype=torch.float64, generator=g)  # π_old (the proximal policy) logits
    behav = prox + 0.9 * torch.randn(V, dtype=torch.float64, generator=g)  # μ: the engine, far from π_old
    phi = 1.3 * torch.randn(V, dtype=torch.float64, generator=g)  # the teacher
    theta = (prox + theta_offset * torch.randn(V, dtype=torch.float64, generator=g)).requires_grad_(True)
    return prox, behav, phi, theta


def _expected_under_engine(estimator, theta, prox, behav, phi, *, correction, stored_old, k=3, band=(0.0, 1e12)):
    """Σ_p μ(p)·compute_loss(p) and its gradient in θ (distillation alone, coef 1, no KL term)."""
    teacher, labels, idx = _teacher(phi, k)
    gather = idx if get_distill_estimator(estimator).needs_topk else None
    policy = token_stats_from_logits(theta.expand(1, V, V), labels, gather_indices=gather, entropy=True)
    stored = {"advantages": torch.zeros(1, V, dtype=torch.float64), "behavior_logp": torch.log_softmax(behav, -1)[None].clone(),
              "teacher_logp": teacher.logp, "teacher_topk_logp": teacher.topk_logp, "teacher_topk_indices": teacher.topk_indices}
    if stored_old:  # a separate π_old pass; else the training pass's own log-probs are π_old (θ = π_old)
        stored["old_logp"] = torch.log_softmax(prox, -1)[None].clone()
    alg = AlgorithmConfig(kl=KLConfig(enabled=False), behavior_correction=correction, behavior_cap=1e12,
                          behavior_band=list(band),
                          distill=DistillConfig(enabled=True, teacher="t", coef=1.0, mode="alone", estimator=estimator))
    mu = torch.softmax(behav, -1)
    total = 0.0
    for p in range(V):
        m = torch.zeros(1, V, dtype=torch.float64)
        m[0, p] = 1.0
        loss, _ = compute_loss(policy, MicroBatch(labels, torch.ones_like(labels), m, V, stored), stored, alg,
                               LossAggregation("token-mean", 1.0, 1.0))
        total = total + mu[p] * loss
    return total.detach(), torch.autograd.grad(total, theta)[0]


def _uncorrected_under_engine(estimator, theta, prox, behav, phi, k=3):
    """What distill_loss gave before the fix: the π_old importance weight alone on μ's samples (no w)."""
    teacher, labels, idx = _teacher(phi, k)
    gather = idx if get_distill_estimator(estimator).needs_topk else None
    policy = token_stats_from_logits(theta.expand(1, V, V), labels, gather_indices=gather)
    old = torch.log_softmax(prox, -1)[None]
    mu = torch.softmax(behav, -1)
    total = 0.0
    for p in range(V):
        m = torch.zeros(1, V, dtype=torch.float64)
        m[0, p] = 1.0
        loss, _ = distill_loss(estimator, policy, teacher, labels, m, LossAggregation("token-mean", 1.0, 1.0), old_logp=old)
        total = total + mu[p] * loss
    return total.detach(), torch.autograd.grad(total, theta)[0]


@pytest.mark.parametrize("estimator,k", [("sampled_reverse_kl", 0), ("topk_reverse_kl", 3), ("topk_reverse_kl", 1)])
@pytest.mark.parametrize("correction", ["tis", "mis"])  # w = ρ exactly: a cap no ρ reaches, a band holding every ρ
@pytest.mark.parametrize("stored_old,offset", [(False, 0.0), (True, 0.0), (True, 0.2)])
@pytest.mark.parametrize("seed", [0, 1])
def test_reverse_kl_estimators_are_unbiased_off_policy_with_the_behaviour_weights(estimator, k, correction, stored_old, offset, seed):
    """Tokens from μ ≠ π_old, weighted by w = ρ = π_old/μ: the expected value and gradient are KL(πθ‖π_T) and
    ∇KL(πθ‖π_T), as on-policy (θ = π_old on the one-pass path; any θ with a stored π_old)."""
    prox, behav, phi, theta = _behaviour_setup(seed, offset)
    value, grad = _expected_under_engine(estimator, theta, prox, behav, phi, correction=correction, stored_old=stored_old, k=k)
    kl = _exact_kl(theta, phi)
    torch.testing.assert_close(value, kl.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, torch.autograd.grad(kl, theta)[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("estimator,k", [("sampled_reverse_kl", 0), ("topk_reverse_kl", 3)])
def test_without_the_behaviour_weights_the_estimators_were_biased_off_policy(estimator, k):
    """The code before the fix (π_old's importance weight, not w) on μ's samples: off in value and gradient."""
    prox, behav, phi, theta = _behaviour_setup(0, 0.0)
    value, grad = _uncorrected_under_engine(estimator, theta, prox, behav, phi, k=k)
    kl = _exact_kl(theta, phi)
    true_grad = torch.autograd.grad(kl, theta)[0]
    assert abs(float(value - kl.detach())) > 0.02 * float(kl.detach())
    assert float((grad - true_grad).abs().max()) > 0.02


@pytest.mark.parametrize("correction", ["none", "tis", "mis"])
@pytest.mark.parametrize("stored_old", [False, True])
def test_topk_forward_kl_is_unaffected_by_the_behaviour_policy(correction, stored_old):
    """No sampled term: every sample gives the coarsened forward KL and its gradient, so any sampling distribution
    and any weights give them in expectation (μ sums to 1)."""
    prox, behav, phi, theta = _behaviour_setup(2, 0.1 if stored_old else 0.0)
    value, grad = _expected_under_engine("topk_forward_kl", theta, prox, behav, phi, correction=correction,
                                         stored_old=stored_old, k=3, band=(0.0, 1e12))
    exact = _coarsened_forward_kl(theta, phi, 3)
    torch.testing.assert_close(value, exact.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, torch.autograd.grad(exact, theta)[0], rtol=1e-10, atol=1e-12)
