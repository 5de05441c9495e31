"""Behaviour-policy correction (trainer/algo/behavior.py) by exact enumeration in float64.

A (1, V) batch whose position p samples token p, all positions sharing one context: Σ_p μ(p)·L(p)
is then the exact expectation of the loss L under sampling from the behaviour policy μ. The loss is
the trainer's own :func:`trainer.step.compute_loss`, so the decoupled objective is checked where it
is used. Sequence-level weights are checked on all V² two-token sequences.
"""

import math

import pytest
import torch

from emapg.config import ConfigError, from_dict
from trainer.batch import MicroBatch, behavior_logp_rows
from trainer.algo.behavior import (behavior_log_ratio, behavior_weights, kl_old_logp,
                              masked_is, mismatch_stats, truncated_is)
from trainer.config import AlgorithmConfig, KLConfig
from trainer.algo.grpo import LossAggregation
from trainer.algo.kl_kinds import get_kl_kind
from trainer.algo.token_stats import token_stats_from_logits
from trainer.step import compute_loss

V = 6


def _setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    prox = 0.9 * torch.randn(V, dtype=torch.float64, generator=g)  # π_prox logits
    behav = prox + 0.7 * torch.randn(V, dtype=torch.float64, generator=g)  # μ: the engine, far enough to truncate
    adv = torch.randn(V, dtype=torch.float64, generator=g)
    return prox, behav, adv


def _alg(correction, **kw):
    return AlgorithmConfig(behavior_correction=correction, kl=KLConfig(enabled=False), clip_low=0.2, clip_high=0.28, **kw)


def _expected_grad(theta, prox, behav, adv, alg):
    """Σ_p μ(p) ∇ L(p): the gradient of the decoupled objective in expectation over μ's samples."""
    labels = torch.arange(V)[None]
    z = theta.expand(1, V, V)
    policy = token_stats_from_logits(z, labels)
    stored = {
        "advantages": adv[None].clone(),
        "old_logp": torch.log_softmax(prox, -1)[None].clone(),
        "behavior_logp": torch.log_softmax(behav, -1)[None].clone(),
    }
    # Each position is one sample: a per-position sum (token-sum over one "sequence" per sample) weighted by μ.
    per_pos_loss = []
    mu = torch.softmax(behav, -1)
    for p in range(V):
        m = torch.zeros(1, V, dtype=torch.float64)
        m[0, p] = 1.0
        one = MicroBatch(labels, torch.ones_like(labels), m, V, stored)
        loss, _ = compute_loss(policy, one, stored, alg, LossAggregation("token-mean", 1.0, 1.0))
        per_pos_loss.append(mu[p] * loss)
    total = torch.stack(per_pos_loss).sum()
    return torch.autograd.grad(total, theta)[0]


def _pg(theta, dist, adv, keep=None):
    """−Σ_a dist(a)·A(a)·∇log πθ(a) over the tokens in ``keep`` (all by default)."""
    logp = torch.log_softmax(theta, -1)
    keep = torch.ones(V, dtype=torch.bool) if keep is None else keep
    return torch.autograd.grad(-(dist.detach() * adv * logp * keep).sum(), theta)[0]


def test_exact_weight_gives_the_on_policy_gradient():
    """w = ρ (a TIS cap no ρ reaches): E_μ[∇ decoupled loss] = the on-policy policy gradient at θ = π_prox."""
    prox, behav, adv = _setup()
    theta = prox.clone().requires_grad_(True)
    got = _expected_grad(theta, prox, behav, adv, _alg("tis", behavior_cap=1e9))
    torch.testing.assert_close(got, _pg(theta, torch.softmax(prox, -1), adv), rtol=1e-12, atol=1e-12)
    # without the correction the same samples estimate μ's gradient, not π_prox's: the two differ
    uncorrected = _expected_grad(theta, prox, behav, adv, _alg("none"))
    torch.testing.assert_close(uncorrected, _pg(theta, torch.softmax(behav, -1), adv), rtol=1e-12, atol=1e-12)
    assert (uncorrected - got).abs().max() > 1e-3


def test_decoupled_gradient_away_from_the_proximal_policy():
    """θ ≠ π_prox inside the clip band: E_μ[∇ w·(πθ/π_prox)·A] = ∇ Σ_a πθ(a) A(a) (the surrogate's exact gradient)."""
    prox, behav, adv = _setup(1)
    theta = (prox + 0.03 * torch.randn(V, dtype=torch.float64, generator=torch.Generator().manual_seed(5))).requires_grad_(True)
    r = torch.softmax(theta, -1) / torch.softmax(prox, -1)
    assert ((r > 0.8) & (r < 1.28)).all()  # no clipping: the objective is the plain surrogate
    got = _expected_grad(theta, prox, behav, adv, _alg("mis", behavior_band=[0.0, 1e9]))
    want = torch.autograd.grad(-(torch.softmax(theta, -1) * adv).sum(), theta)[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_tis_bias_equals_its_formula():
    """E_μ[∇ TIS loss] − on-policy gradient = Σ_a (π_prox(a) − C·μ(a))₊ · A(a) · ∇log πθ(a)."""
    prox, behav, adv = _setup(2)
    theta = prox.clone().requires_grad_(True)
    cap = 1.3
    pi, mu = torch.softmax(prox, -1), torch.softmax(behav, -1)
    assert ((pi / mu) > cap).any(), "the setup must truncate some token"
    got = _expected_grad(theta, prox, behav, adv, _alg("tis", behavior_cap=cap))
    excess = (pi - cap * mu).clamp(min=0)
    bias = -_pg(theta, excess, adv)  # + Σ excess·A·∇log π
    torch.testing.assert_close(got - _pg(theta, pi, adv), bias, rtol=1e-12, atol=1e-12)
    assert bias.abs().max() > 1e-4


def test_mis_keeps_the_tokens_in_the_band():
    """E_μ[∇ MIS loss] = −Σ_{a: low ≤ ρ ≤ high} π_prox(a)·A(a)·∇log πθ(a)."""
    prox, behav, adv = _setup(3)
    theta = prox.clone().requires_grad_(True)
    band = (0.7, 1.4)
    pi, mu = torch.softmax(prox, -1), torch.softmax(behav, -1)
    rho = pi / mu
    keep = (rho >= band[0]) & (rho <= band[1])
    assert keep.any() and not keep.all()
    got = _expected_grad(theta, prox, behav, adv, _alg("mis", behavior_band=list(band)))
    torch.testing.assert_close(got, _pg(theta, pi, adv, keep), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("correction", ["tis", "mis"])
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_behaviour_equal_to_proximal_is_todays_objective(correction, level):
    """μ = π_prox: the loss, its gradient and the KL are bit-for-bit those without a behaviour policy."""
    g = torch.Generator().manual_seed(4)
    B, T = 3, 5
    theta = torch.randn(B, T, V, dtype=torch.float64, generator=g).requires_grad_(True)
    labels = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.3).to(torch.float64)
    old = token_stats_from_logits((theta + 0.1 * torch.randn(B, T, V, dtype=torch.float64, generator=g)).detach(), labels, topk=3)
    ref = token_stats_from_logits(torch.randn(B, T, V, dtype=torch.float64, generator=g), labels, gather_indices=old.topk_indices)
    base = {"advantages": torch.randn(B, T, dtype=torch.float64, generator=g) * mask, "old_logp": old.logp,
            "anchor_logp": ref.logp, "anchor_logsumexp": ref.logsumexp, "anchor_topk_logits": ref.topk_logits, "topk_indices": old.topk_indices}
    kl = KLConfig(type="topk_reverse", topk=3, importance_weight=True, coef=0.1)
    agg = LossAggregation.for_batch("token-mean", mask)

    def run(stored, alg):
        policy = token_stats_from_logits(theta, labels, gather_indices=old.topk_indices)
        loss, metrics = compute_loss(policy, MicroBatch(labels, torch.ones_like(labels), mask, T, stored), stored, alg, agg)
        return loss, torch.autograd.grad(loss, theta)[0], metrics

    today = run(base, AlgorithmConfig(kl=kl))
    same = run({**base, "behavior_logp": old.logp.clone()},
               AlgorithmConfig(kl=kl, behavior_correction=correction, behavior_level=level, behavior_cap=1.5))
    assert torch.equal(today[0], same[0]) and torch.equal(today[1], same[1])
    assert float(same[2]["behavior/abs_diff_max"]) == 0.0 and float(same[2]["behavior/masked"]) == 0.0


def test_sequence_weight_is_unbiased_for_sequence_returns_token_weight_is_not():
    """Two-token sequences (V² of them), the second token's distribution depending on the first, reward
    per sequence: the sequence-level exact weight Π_t ρ_t gives the on-policy REINFORCE gradient; the
    token-level one does not (it corrects each token's choice but not the prefix it was taken in)."""
    g = torch.Generator().manual_seed(6)
    n = 4
    prox = torch.randn(1 + n, n, dtype=torch.float64, generator=g)  # row 0: first token; row 1+a: second after a
    behav = prox + 0.6 * torch.randn(1 + n, n, dtype=torch.float64, generator=g)
    reward = torch.randn(n, n, dtype=torch.float64, generator=g)
    theta = prox.clone().requires_grad_(True)
    lp, lp_prox, lp_mu = (torch.log_softmax(x, -1) for x in (theta, prox, behav))
    seqs = [(a, b) for a in range(n) for b in range(n)]

    def expected(level):
        lp = torch.log_softmax(theta, -1)
        total = 0
        for a, b in seqs:
            logp = torch.stack([lp[0, a], lp[1 + a, b]])[None]
            prox_t = torch.stack([lp_prox[0, a], lp_prox[1 + a, b]])[None]
            mu_t = torch.stack([lp_mu[0, a], lp_mu[1 + a, b]])[None]
            w = behavior_weights("tis", prox_t, mu_t, torch.ones(1, 2), level=level, cap=1e9).weights
            mu_seq = (lp_mu[0, a] + lp_mu[1 + a, b]).exp()
            total = total + mu_seq * (-(w * reward[a, b] * logp).sum())
        return torch.autograd.grad(total, theta)[0]

    p_seq = torch.stack([(lp[0, a] + lp[1 + a, b]).exp() for a, b in seqs])
    true = torch.autograd.grad(-(p_seq * reward.flatten()).sum(), theta)[0]
    torch.testing.assert_close(expected("sequence"), true, rtol=1e-12, atol=1e-12)
    assert (expected("token") - true).abs().max() > 1e-3


def _topk_tail_expectation(theta, ref_logits, prox, behav_probs, q, w_fn):
    """Σ_p μ(p)·TopkReverseKL(p) with the tail's IW from kl_old_logp(π_prox, w), and its gradient."""
    kind = get_kl_kind("topk_reverse")
    cfg = KLConfig(type="topk_reverse", topk=len(q), importance_weight=True, tail_grad="exact")
    labels = torch.arange(V)[None]
    idx = torch.tensor(q).expand(1, V, len(q))
    policy = token_stats_from_logits(theta.expand(1, V, V), labels, gather_indices=idx)
    anchor = token_stats_from_logits(ref_logits.expand(1, V, V), labels, gather_indices=idx).detach()
    prox_logp = torch.log_softmax(prox, -1)[None]
    with torch.no_grad():
        behav_logp = torch.where(behav_probs > 0, behav_probs.log(), torch.full_like(behav_probs, -1e4))[None]
        w = w_fn(prox_logp, behav_logp)
    per_tok = kind.per_token(policy, anchor, labels, cfg=cfg, old_logp=kl_old_logp(prox_logp, w))[0]
    value = (behav_probs * per_tok).sum()
    return value.detach(), torch.autograd.grad(value, theta)[0]


def test_topk_tail_with_behaviour_weight_is_unbiased_under_full_support():
    """EMA-PG: q = π_prox's top-k, tail IW (πθ/π_prox)·ρ with ρ = π_prox/μ → E_μ = KL(πθ‖π_ref), value and gradient."""
    g = torch.Generator().manual_seed(7)
    prox = torch.randn(V, dtype=torch.float64, generator=g)
    theta = (prox + 0.2 * torch.randn(V, dtype=torch.float64, generator=g)).requires_grad_(True)
    ref = torch.randn(V, dtype=torch.float64, generator=g)
    mu = torch.softmax(prox + 0.8 * torch.randn(V, dtype=torch.float64, generator=g), -1)
    q = torch.topk(prox, 2).indices.tolist()
    exact = lambda p, b: behavior_weights("tis", p, b, torch.ones(1, V), cap=1e9).weights  # noqa: E731
    value, grad = _topk_tail_expectation(theta, ref, prox, mu, q, exact)
    lp, lr = torch.log_softmax(theta, -1), torch.log_softmax(ref, -1)
    kl = (lp.exp() * (lp - lr)).sum()
    torch.testing.assert_close(value, kl.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, torch.autograd.grad(kl, theta)[0], rtol=1e-10, atol=1e-12)
    # without the behaviour weight (w = 1) the μ-sampled tail is biased
    ones = lambda p, b: torch.ones(1, V, dtype=torch.float64)  # noqa: E731
    biased, _ = _topk_tail_expectation(theta, ref, prox, mu, q, ones)
    assert abs(float(biased - kl.detach())) > 1e-4


def test_topk_tail_misses_what_the_engine_never_samples():
    """A nucleus (top-p) engine never samples some tail tokens: the corrected estimate misses exactly their part."""
    g = torch.Generator().manual_seed(8)
    prox = torch.randn(V, dtype=torch.float64, generator=g)
    theta = prox.clone().requires_grad_(True)
    ref = torch.randn(V, dtype=torch.float64, generator=g)
    q = torch.topk(prox, 2).indices.tolist()
    never = torch.argsort(prox)[:2]  # the two least likely tokens are outside the nucleus
    mu = torch.softmax(prox, -1).clone()
    mu[never] = 0
    mu = mu / mu.sum()
    exact = lambda p, b: behavior_weights("tis", p, b, torch.ones(1, V), cap=1e9).weights  # noqa: E731
    value, _ = _topk_tail_expectation(theta, ref, prox, mu, q, exact)
    lp, lr = torch.log_softmax(theta.detach(), -1), torch.log_softmax(ref, -1)
    terms = lp.exp() * (lp - lr)
    torch.testing.assert_close(value, terms.sum() - terms[never].sum(), rtol=1e-10, atol=1e-12)


def test_perturbed_engine_logprobs_weights_truncation_masking():
    """An engine whose log-probs are shifted by known amounts: every weight, flag and metric is what the rule says."""
    prox = torch.log(torch.tensor([[0.5, 0.2, 0.1, 0.3], [0.4, 0.4, 0.25, 0.1]], dtype=torch.float64))
    shift = torch.tensor([[0.0, math.log(3.0), -math.log(4.0), 0.5], [-1.0, 0.1, 2.0, 0.0]], dtype=torch.float64)
    behav = prox + shift  # ρ = exp(−shift)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float64)
    rho = torch.exp(-shift)
    tis = truncated_is(behavior_log_ratio(prox, behav, mask), mask, cap=2.0, band=(0.5, 2.0))
    torch.testing.assert_close(tis.weights, torch.where(mask.bool(), rho.clamp(max=2.0), 0 * rho))
    assert tis.truncated.tolist() == [[False, False, True, False], [True, False, False, False]]
    mis = masked_is(behavior_log_ratio(prox, behav, mask), mask, cap=2.0, band=(0.5, 2.0))
    keep = mask.bool() & (rho >= 0.5) & (rho <= 2.0)
    torch.testing.assert_close(mis.weights, torch.where(keep, rho, 0 * rho))
    assert mis.masked.tolist() == [[False, True, True, False], [True, False, False, False]]
    # sequence level: row 0 has ρ = 1·(1/3)·4 = 4/3 (kept, in the band), row 1 ρ = e·e^−0.1 (masked)
    seq = behavior_weights("mis", prox, behav, mask, level="sequence", band=(0.5, 2.0))
    torch.testing.assert_close(seq.weights[0], torch.tensor([4 / 3, 4 / 3, 4 / 3, 0.0], dtype=torch.float64))
    assert seq.weights[1].abs().sum() == 0 and seq.masked[1].tolist() == [True, True, False, False]
    geo = behavior_log_ratio(prox, behav, mask, "geometric")
    torch.testing.assert_close(geo[1, :2], torch.full((2,), (1.0 - 0.1) / 2, dtype=torch.float64))
    stats = mismatch_stats(prox, behav, mask)
    d = shift[mask.bool()]
    assert float(stats["abs_diff_max"]) == pytest.approx(float(d.abs().max()))
    assert float(stats["abs_diff_sum"]) == pytest.approx(float(d.abs().sum()))
    assert float(stats["k3_sum"]) == pytest.approx(float((torch.exp(-d) - 1 + d).sum()))
    # a masked token's tail IW is zero to float precision
    s = torch.exp(torch.clamp(prox - kl_old_logp(prox, mis.weights), -20, 20))
    assert float(s[0, 1]) < 1e-8 and float(s[0, 0]) == pytest.approx(1.0)


def test_behavior_rows_and_config_checks():
    from agent.rollout import Trajectory

    trajs = [Trajectory("u", "g", 0, i, "q", None, [1], response_ids=r, sampling_logprobs=lp)
             for i, (r, lp) in enumerate([([3, 4], [-0.5, -1.0]), ([], [-1.0]), ([5], [-2.0])])]
    rows = behavior_logp_rows(trajs, 3)
    assert rows.tolist() == [[-0.5, -1.0, 0.0], [0.0, 0.0, 0.0], [-2.0, 0.0, 0.0]]
    with pytest.raises(ConfigError, match="behavior_band"):
        AlgorithmConfig(behavior_band=[1.2, 2.0]).validate()
    with pytest.raises(ConfigError, match="behavior_cap: expected a finite number >= 1, got 0.5"):  # the declared range
        from_dict(AlgorithmConfig, {"behavior_cap": 0.5})


@pytest.mark.parametrize("level,correction", [("geometric", "mis"), ("sequence", "mis"), ("sequence", "tis")])
def test_sequence_level_masks_and_truncation_by_enumeration(level, correction):
    """All V² two-token sequences: geometric/sequence masking drops exactly the sequences whose ratio
    (the geometric mean (ρ₁ρ₂)^½, or the product ρ₁ρ₂) leaves the band, sequence TIS clips the product at
    the cap; the expected gradient is Σ_s μ(s)·w(s)·R(s)·∇log πθ(s) over what is kept; the metrics count the drops."""
    from trainer.algo.behavior import drop_counts

    g = torch.Generator().manual_seed(11)
    n, low, high, cap = 4, 0.8, 1.25, 1.3
    prox = torch.randn(1 + n, n, dtype=torch.float64, generator=g)
    behav = prox + 0.5 * torch.randn(1 + n, n, dtype=torch.float64, generator=g)
    reward = torch.randn(n, n, dtype=torch.float64, generator=g)
    theta = prox.clone().requires_grad_(True)
    lp_prox, lp_mu = torch.log_softmax(prox, -1), torch.log_softmax(behav, -1)
    seqs = [(a, b) for a in range(n) for b in range(n)]
    prox_t = torch.stack([torch.stack([lp_prox[0, a], lp_prox[1 + a, b]]) for a, b in seqs])  # (n², 2)
    mu_t = torch.stack([torch.stack([lp_mu[0, a], lp_mu[1 + a, b]]) for a, b in seqs])
    mask = torch.ones(n * n, 2, dtype=torch.float64)
    bw = behavior_weights(correction, prox_t, mu_t, mask, level=level, cap=cap, band=(low, high))
    lp = torch.log_softmax(theta, -1)
    logp = torch.stack([torch.stack([lp[0, a], lp[1 + a, b]]) for a, b in seqs])
    mu_seq = mu_t.sum(-1).exp()
    got = torch.autograd.grad((mu_seq[:, None] * -(bw.weights * reward.flatten()[:, None] * logp)).sum(), theta)[0]
    # independent: the ratio per sequence, the rule applied to it
    rho = [math.exp(float(prox_t[i].sum() - mu_t[i].sum())) for i in range(n * n)]
    rho = [r ** 0.5 for r in rho] if level == "geometric" else rho
    if correction == "mis":
        w = [r if low <= r <= high else 0.0 for r in rho]
    else:
        w = [min(r, cap) for r in rho]
    lp = torch.log_softmax(theta, -1)
    seq_logp = torch.stack([lp[0, a] + lp[1 + a, b] for a, b in seqs])
    want = torch.autograd.grad(-(mu_seq * torch.tensor(w, dtype=torch.float64) * reward.flatten() * seq_logp).sum(), theta)[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    dropped = sum(1 for r in rho if not low <= r <= high) if correction == "mis" else 0
    truncated = sum(1 for r in rho if r > cap) if correction == "tis" else 0
    assert 0 < dropped + truncated < n * n  # the band and the cap bind on some sequences, not all
    counts = drop_counts(bw, mask)
    assert float(counts["behavior/sequences"]) == n * n
    assert float(counts["behavior/masked_seqs"]) == dropped == float(counts["behavior/partly_masked_seqs"])
    assert float(counts["behavior/truncated_seqs"]) == truncated
    assert int(bw.masked.sum()) == 2 * dropped


def test_token_band_masking_counts_tokens_and_sequences():
    """IcePop-style token masking (mis, token level): each token outside the band is dropped alone; the
    metrics count dropped tokens, sequences with a drop, and sequences dropped whole."""
    from trainer.algo.behavior import behavior_correction, behavior_metrics

    prox = torch.zeros(3, 3, dtype=torch.float64)
    shift = torch.tensor([[0.0, 1.0, 0.0], [2.0, -2.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)  # ρ = e^−shift
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0]], dtype=torch.float64)
    term = behavior_correction(prox, {"behavior_logp": prox + shift}, mask, _alg("mis", behavior_band=[0.5, 2.0]))
    assert term.weights.tolist() == [[1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    m = {k: float(v) for k, v in term.metrics.items()}
    assert (m["behavior/masked"], m["behavior/sequences"], m["behavior/masked_seqs"], m["behavior/partly_masked_seqs"]) == (3, 3, 1, 2)
    out = behavior_metrics(m)
    assert out["behavior/masked_frac"] == pytest.approx(3 / 7)
    assert out["behavior/masked_seq_frac"] == pytest.approx(1 / 3) and out["behavior/partly_masked_seq_frac"] == pytest.approx(2 / 3)


def test_a_rejected_token_stays_in_the_normaliser():
    """MIS drops a token (w = 0): it adds nothing to the loss but still counts in the token-mean normaliser (unlike
    verl's rollout correction; docs/ALGORITHM.md §3.3): the loss is the kept token's term over both tokens."""
    prox, behav, adv = _setup(3)
    labels = torch.tensor([[0, 1]])
    theta = prox.clone().requires_grad_(True)
    policy = token_stats_from_logits(theta.expand(1, 2, V), labels)
    lp_prox, lp_behav = torch.log_softmax(prox, -1), torch.log_softmax(behav, -1)
    behav_row = lp_behav[:2].clone()
    behav_row[1] = lp_prox[1] + math.log(10.0)  # ρ = 0.1 on token 1: outside the band, dropped
    stored = {"advantages": adv[None, :2].clone(), "old_logp": lp_prox[None, :2].clone(), "behavior_logp": behav_row[None]}
    alg = _alg("mis", behavior_band=[0.2, 5.0])
    both = torch.ones(1, 2, dtype=torch.float64)
    loss, m = compute_loss(policy, MicroBatch(labels, torch.ones_like(labels), both, 2, stored), stored, alg,
                           LossAggregation.for_batch("token-mean", both))
    assert float(m["behavior/masked"]) == 1.0
    first = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    kept = lambda n: compute_loss(policy, MicroBatch(labels, torch.ones_like(labels), first, 2, stored), stored, alg,  # noqa: E731
                                  LossAggregation("token-mean", n, 1.0))[0]
    torch.testing.assert_close(loss, kept(2.0), rtol=1e-12, atol=1e-12)  # N = 2: the rejected token counts
    assert abs(float((loss - kept(1.0)).detach())) > 1e-6  # verl's N = 1 would double it
