"""Top-k KL and exact KL: exact enumeration over a small vocabulary in float64 (§2.3–§2.4).

Each of the V "positions" of a (1, V) batch shares the same distributions and has the sampled
token p = position index, so Σ_p sg(π_sample(p))·L(p) is the exact expectation over p.
"""

import pytest
import torch

from trainer.config import KLConfig
from trainer.algo.grpo import LossAggregation
from trainer.algo.kl_kinds import get_kl_kind
from trainer.algo.kl import get_kl_estimator
from trainer.algo.token_stats import token_stats_from_hidden, token_stats_from_logits
from trainer.algo.topk_kl import exact_kl, not_in_topk_mask, topk_forward_kl, topk_kl, topk_reverse_kl

V = 8


def _setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    theta = (0.8 * torch.randn(V, dtype=torch.float64, generator=g)).requires_grad_(True)
    ref_logits = 0.8 * torch.randn(V, dtype=torch.float64, generator=g)
    old_logits = theta.detach() + 0.4 * torch.randn(V, dtype=torch.float64, generator=g)
    return theta, ref_logits, old_logits


def _expected_topk(direction, theta, ref_logits, q, *, tail_grad="paper", sample_logits=None, tail_sampling=True):
    """Exact E_p[TopkKL] and its gradient wrt theta; samples from πθ, or from π_old with IW."""
    k = len(q)
    idx = torch.tensor(q, dtype=torch.long).expand(1, V, k)
    labels = torch.arange(V)[None]
    z = theta.expand(1, V, V)
    zr = ref_logits.expand(1, V, V)
    lse, ref_lse = z.logsumexp(-1), zr.logsumexp(-1)
    logp = torch.log_softmax(theta, -1)[None]
    ref_logp = torch.log_softmax(ref_logits, -1)[None]
    old_logp = None if sample_logits is None else torch.log_softmax(sample_logits, -1)[None]
    fn = topk_reverse_kl if direction == "reverse" else topk_forward_kl
    per_pos = fn(
        logits_k=z.gather(-1, idx), logsumexp=lse, logp=logp,
        ref_logits_k=zr.gather(-1, idx), ref_logsumexp=ref_lse, ref_logp=ref_logp,
        topk_indices=idx, labels=labels, old_logp=old_logp, tail_grad=tail_grad, tail_sampling=tail_sampling,
    )[0]
    weights = (logp if old_logp is None else old_logp)[0].exp().detach()
    value = (weights * per_pos).sum()
    return value.detach(), torch.autograd.grad(value, theta)[0], per_pos.detach()


def _exact(direction, theta, ref_logits):
    lp, lq = torch.log_softmax(theta, -1), torch.log_softmax(ref_logits, -1)
    kl = (lp.exp() * (lp - lq)).sum() if direction == "reverse" else (lq.exp() * (lq - lp)).sum()
    return kl.detach(), torch.autograd.grad(kl, theta)[0]


def _grad_mass(theta, q):
    """∇πθ(q), πθ(q) = Σ_{j∈q} πθ(j)."""
    mass = torch.softmax(theta, -1)[list(q)].sum() if q else theta.sum() * 0
    return torch.autograd.grad(mass, theta)[0]


def _topk_set(logits, k):
    return sorted(torch.topk(logits.detach(), k).indices.tolist()) if k else []


@pytest.mark.parametrize("direction", ["reverse", "forward"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_paper_gradient_bias_is_exactly_grad_mass_of_q_and_exact_mode_removes_it(direction, k):
    theta, ref_logits, old_logits = _setup(k)
    # Reverse: q from the old/sampling policy; forward: q from the anchor (paper §2.3).
    q = _topk_set(old_logits if direction == "reverse" else ref_logits, k)
    kl, kl_grad = _exact(direction, theta, ref_logits)
    bias = _grad_mass(theta, q)
    sign = 1.0 if direction == "reverse" else -1.0
    v_paper, g_paper, _ = _expected_topk(direction, theta, ref_logits, q, tail_grad="paper")
    v_exact, g_exact, _ = _expected_topk(direction, theta, ref_logits, q, tail_grad="exact")
    assert torch.allclose(v_paper, kl, atol=1e-12, rtol=0)
    assert torch.allclose(v_exact, kl, atol=1e-12, rtol=0)
    assert torch.allclose(g_paper, kl_grad + sign * bias, atol=1e-12, rtol=0)
    assert torch.allclose(g_exact, kl_grad, atol=1e-12, rtol=0)
    assert bias.abs().max() > 1e-3  # the bias is real at 0 < k < V


@pytest.mark.parametrize("direction", ["reverse", "forward"])
@pytest.mark.parametrize("tail_grad", ["paper", "exact"])
def test_k_equals_vocab_is_the_exact_kl_per_token(direction, tail_grad):
    theta, ref_logits, _ = _setup(7)
    kl, kl_grad = _exact(direction, theta, ref_logits)
    value, grad, per_pos = _expected_topk(direction, theta, ref_logits, list(range(V)), tail_grad=tail_grad)
    assert torch.allclose(per_pos, kl.expand(V), atol=1e-12, rtol=0)  # no tail: exact at every token
    assert torch.allclose(grad, kl_grad, atol=1e-12, rtol=0)


@pytest.mark.parametrize("direction,name", [("reverse", "reverse_reinforce"), ("forward", "forward_importance")])
def test_k_zero_is_the_sampled_estimator(direction, name):
    theta, ref_logits, _ = _setup(2)
    _, grad, per_pos = _expected_topk(direction, theta, ref_logits, [], tail_grad="paper")
    logp, ref = torch.log_softmax(theta, -1), torch.log_softmax(ref_logits, -1)
    sampled = get_kl_estimator(name)(logp, ref)
    assert torch.allclose(per_pos, sampled.detach(), atol=1e-14, rtol=0)
    ref_grad = torch.autograd.grad((torch.softmax(theta, -1).detach() * sampled).sum(), theta)[0]
    assert torch.allclose(grad, ref_grad, atol=1e-12, rtol=0)


@pytest.mark.parametrize("direction", ["reverse", "forward"])
@pytest.mark.parametrize("tail_grad", ["paper", "exact"])
def test_importance_weight_on_the_tail_makes_off_policy_samples_unbiased(direction, tail_grad):
    theta, ref_logits, old_logits = _setup(4)
    q = _topk_set(old_logits, 3)
    on_v, on_g, _ = _expected_topk(direction, theta, ref_logits, q, tail_grad=tail_grad)
    off_v, off_g, _ = _expected_topk(direction, theta, ref_logits, q, tail_grad=tail_grad, sample_logits=old_logits)
    assert torch.allclose(off_v, on_v, atol=1e-12, rtol=0)
    assert torch.allclose(off_g, on_g, atol=1e-12, rtol=0)


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_importance_weight_multiplies_only_the_tail(direction):
    theta, ref_logits, old_logits = _setup(6)
    q = _topk_set(old_logits, 3)
    _, _, plain = _expected_topk(direction, theta, ref_logits, q)
    _, _, weighted = _expected_topk(direction, theta, ref_logits, q, sample_logits=old_logits)
    _, _, head = _expected_topk(direction, theta, ref_logits, q, tail_sampling=False)
    s = torch.exp(torch.log_softmax(theta.detach(), -1) - torch.log_softmax(old_logits, -1))
    in_q = torch.zeros(V, dtype=torch.bool)
    in_q[q] = True
    assert torch.allclose(weighted[in_q], plain[in_q], atol=1e-14)  # sampled token in q: head only
    assert torch.allclose(weighted[~in_q] - head[~in_q], s[~in_q] * (plain[~in_q] - head[~in_q]), atol=1e-14)


def test_truncated_kl_is_biased():
    theta, ref_logits, old_logits = _setup(1)
    q = _topk_set(old_logits, 3)
    v, _, _ = _expected_topk("reverse", theta, ref_logits, q, tail_sampling=False)
    assert abs(v - _exact("reverse", theta, ref_logits)[0]) > 1e-3


def test_not_in_topk_mask():
    labels = torch.tensor([[3, 5, 0]])
    idx = torch.tensor([[[1, 3], [2, 4], [0, 0]]])
    assert not_in_topk_mask(labels, idx).tolist() == [[False, True, False]]
    assert not_in_topk_mask(labels, idx[..., :0]).all()
    with pytest.raises(ValueError):
        not_in_topk_mask(labels, idx[0])


def test_bad_switches_raise():
    theta, ref_logits, _ = _setup(0)
    with pytest.raises(ValueError, match="tail_grad"):
        _expected_topk("reverse", theta, ref_logits, [1], tail_grad="unbiased")


def test_plumbing_old_policy_indices_through_token_stats():
    """Reverse: q = top-k of π_old, gathered by the anchor and the current policy alike."""
    g = torch.Generator().manual_seed(0)
    B, T, H, Vb, k = 2, 6, 5, 13, 4
    hidden = torch.randn(B, T, H, dtype=torch.float64, generator=g)
    w_old = torch.randn(Vb, H, dtype=torch.float64, generator=g)
    w_cur = (w_old + 0.1 * torch.randn(Vb, H, dtype=torch.float64, generator=g)).requires_grad_(True)
    w_ref = w_old + 0.2 * torch.randn(Vb, H, dtype=torch.float64, generator=g)
    labels = torch.randint(0, Vb, (B, T), generator=g)
    old = token_stats_from_hidden(hidden, w_old, labels, topk=k).detach()
    anchor = token_stats_from_hidden(hidden, w_ref, labels, gather_indices=old.topk_indices).detach()
    cur = token_stats_from_hidden(hidden, w_cur, labels, gather_indices=old.topk_indices, chunk_size=5)
    got = topk_kl("reverse", cur, anchor, labels, old_logp=old.logp)
    z, zr = hidden @ w_cur.T, hidden @ w_ref.T
    want = topk_reverse_kl(
        logits_k=z.gather(-1, old.topk_indices), logsumexp=z.logsumexp(-1),
        logp=torch.log_softmax(z, -1).gather(-1, labels[..., None])[..., 0],
        ref_logits_k=zr.gather(-1, old.topk_indices), ref_logsumexp=zr.logsumexp(-1),
        ref_logp=torch.log_softmax(zr, -1).gather(-1, labels[..., None])[..., 0],
        topk_indices=old.topk_indices, labels=labels, old_logp=old.logp,
    )
    assert torch.allclose(got, want, atol=1e-12)
    # Stored compactly (int32 indices) the anchor stats give the same result.
    assert torch.allclose(topk_kl("reverse", cur, anchor.compact(torch.float64, torch.int32), labels, old_logp=old.logp), want, atol=1e-12)
    g1 = torch.autograd.grad(got.sum(), w_cur, retain_graph=True)[0]
    g2 = torch.autograd.grad(want.sum(), w_cur)[0]
    assert torch.allclose(g1, g2, atol=1e-12)
    # Stats gathered at different indices are refused.
    other = token_stats_from_hidden(hidden, w_ref, labels, topk=k).detach()
    if not torch.equal(other.topk_indices, old.topk_indices):
        with pytest.raises(ValueError, match="different indices"):
            topk_kl("reverse", cur, other, labels)


def test_topk_kind_with_full_vocab_equals_exact_kind_loss():
    g = torch.Generator().manual_seed(1)
    B, T, Vb = 2, 5, 9
    logits = torch.randn(B, T, Vb, dtype=torch.float64, generator=g).requires_grad_(True)
    ref_logits = torch.randn(B, T, Vb, dtype=torch.float64, generator=g)
    labels = torch.randint(0, Vb, (B, T), generator=g)
    mask = torch.ones(B, T)
    mask[1, 3:] = 0
    agg = LossAggregation.for_batch("token-mean", mask)
    anchor = token_stats_from_logits(ref_logits, labels, topk=Vb).detach()
    policy = token_stats_from_logits(logits, labels, gather_indices=anchor.topk_indices)
    for direction in ("reverse", "forward"):
        cfg = KLConfig(topk=Vb, importance_weight=False)
        a, _ = get_kl_kind(f"topk_{direction}").loss(policy, anchor, labels, mask, agg, cfg=cfg)
        policy.exact_kl = exact_kl(logits, ref_logits, direction=direction)  # what the policy pass computes
        b, _ = get_kl_kind(f"exact_{direction}").loss(policy, anchor, labels, mask, agg, cfg=cfg)
        assert torch.allclose(a, b, atol=1e-12)
        ga = torch.autograd.grad(a, logits, retain_graph=True)[0]
        gb = torch.autograd.grad(b, logits, retain_graph=True)[0]
        assert torch.allclose(ga, gb, atol=1e-12)


@pytest.mark.parametrize("direction", ["reverse", "forward"])
@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_chunked_exact_kl_equals_unchunked(direction, chunk):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 7, 11, dtype=torch.float64, generator=g).requires_grad_(True)
    ref = torch.randn(3, 7, 11, dtype=torch.float64, generator=g)
    weights = torch.randn(3, 7, dtype=torch.float64, generator=g)
    got = exact_kl(logits, ref, direction=direction, chunk_size=chunk, temperature=0.9)
    lp, lq = torch.log_softmax(logits / 0.9, -1), torch.log_softmax(ref / 0.9, -1)
    want = (lp.exp() * (lp - lq)).sum(-1) if direction == "reverse" else (lq.exp() * (lq - lp)).sum(-1)
    assert torch.allclose(got, want, atol=1e-13)
    g1 = torch.autograd.grad((weights * got).sum(), logits)[0]
    g2 = torch.autograd.grad((weights * want).sum(), logits)[0]
    assert torch.allclose(g1, g2, atol=1e-13)


def test_exact_kl_float32_and_errors():
    logits = torch.randn(4, 10)
    assert torch.allclose(exact_kl(logits, logits), torch.zeros(4), atol=1e-6)
    with pytest.raises(ValueError):
        exact_kl(logits, logits[:, :5])
    with pytest.raises(ValueError):
        exact_kl(logits, logits, direction="sideways")


@pytest.mark.parametrize("direction", ["reverse", "forward"])
@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_exact_kl_from_hidden_equals_exact_kl_on_materialised_logits(direction, chunk):
    from trainer.algo.topk_kl import exact_kl_from_hidden

    g = torch.Generator().manual_seed(3)
    B, T, H, Vb = 2, 6, 5, 13
    h = torch.randn(B, T, H, dtype=torch.float64, generator=g).requires_grad_(True)
    w = torch.randn(Vb, H, dtype=torch.float64, generator=g).requires_grad_(True)
    b = torch.randn(Vb, dtype=torch.float64, generator=g).requires_grad_(True)
    hr = torch.randn(B, T, H, dtype=torch.float64, generator=g)
    wr = torch.randn(Vb, H, dtype=torch.float64, generator=g)
    br = torch.randn(Vb, dtype=torch.float64, generator=g)
    weights = torch.randn(B, T, dtype=torch.float64, generator=g)
    got = exact_kl_from_hidden(h, w, hr, wr, bias=b, ref_bias=br, direction=direction, chunk_size=chunk, temperature=0.8)
    want = exact_kl(h @ w.T + b, hr @ wr.T + br, direction=direction, temperature=0.8)
    assert torch.allclose(got, want, atol=1e-12)
    g1 = torch.autograd.grad((weights * got).sum(), (h, w, b))
    g2 = torch.autograd.grad((weights * want).sum(), (h, w, b))
    for a, c in zip(g1, g2):
        assert torch.allclose(a, c, atol=1e-10)
    with pytest.raises(ValueError):
        exact_kl_from_hidden(h, w, hr[:, :2], wr)
