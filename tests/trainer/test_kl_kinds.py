"""KL kinds (trainer/algo/kl_kinds.py): every row of the table by exact enumeration in float64.

The stored statistics are built the way the kind declares (``needs``: whose top-k is q), the loss
is the kind's own ``per_token``/``loss``. Each of the V positions of a (1, V) batch shares the same
distributions and samples the token p = position index, so Σ_p π_sample(p)·L(p) is the exact
expectation; with the importance weight the samples come from π_old.
"""

import pytest
import torch

from emapg.config import ConfigError
from trainer.config import KLConfig
from trainer.algo.grpo import LossAggregation
from trainer.algo.kl import get_kl_estimator, sampled_kl
from trainer.algo.kl_kinds import ExactKL, SampledKL, TopkKL, get_kl_kind, kl_kind_names
from trainer.algo.token_stats import token_stats_from_logits
from trainer.algo.topk_kl import exact_kl_from_hidden

from tests.trainer.test_topk_kl import V, _setup  # θ, anchor and π_old logits over a vocabulary of V = 8
SAMPLED = ["k1", "k2", "k3", "k3_ratio", "reverse_reinforce", "forward_importance", "k3+", "k1+"]


def _stats(kind, cfg, theta, ref_logits, old_logits):
    """Policy and anchor statistics as the stored-statistics pass and the policy pass build them for ``kind``."""
    needs = kind.needs(cfg)
    labels = torch.arange(V)[None]
    z, zr, zo = (x.expand(1, V, V) for x in (theta, ref_logits, old_logits))
    old = token_stats_from_logits(zo, labels, topk=needs.topk if needs.topk_of == "old" else 0)
    if needs.topk_of == "anchor":
        anchor = token_stats_from_logits(zr, labels, topk=needs.topk)
    else:
        anchor = token_stats_from_logits(zr, labels, gather_indices=old.topk_indices)
    policy = token_stats_from_logits(z, labels, gather_indices=anchor.topk_indices)
    if needs.exact is not None:  # H = 1: hidden states 1, lm_head weights = the logits
        one = torch.ones(1, V, 1, dtype=torch.float64)
        policy.exact_kl = exact_kl_from_hidden(one, theta[:, None], one, ref_logits[:, None], direction=needs.exact, chunk_size=3)
    return policy, anchor.detach(), old.logp.detach(), labels


def _expectation(kind, cfg, theta, ref_logits, old_logits):
    policy, anchor, old_logp, labels = _stats(kind, cfg, theta, ref_logits, old_logits)
    off = cfg.importance_weight and kind.uses_importance_weight
    per_tok = kind.per_token(policy, anchor, labels, cfg=cfg, old_logp=old_logp if off else None)[0]
    weights = (torch.log_softmax(old_logits, -1) if off else torch.log_softmax(theta, -1)).exp().detach()
    value = (weights * per_tok).sum()
    return value.detach(), torch.autograd.grad(value, theta)[0], per_tok.detach()


def _targets(theta, ref_logits, q):
    lp, lq = torch.log_softmax(theta, -1), torch.log_softmax(ref_logits, -1)
    rev, fwd = (lp.exp() * (lp - lq)).sum(), (lq.exp() * (lq - lp)).sum()
    g_rev = torch.autograd.grad(rev, theta, retain_graph=True)[0]
    g_fwd = torch.autograd.grad(fwd, theta, retain_graph=True)[0]
    mass = torch.softmax(theta, -1)[q].sum() if q else theta.sum() * 0
    g_mass = torch.autograd.grad(mass, theta)[0]
    return {"reverse": (rev.detach(), g_rev), "forward": (fwd.detach(), g_fwd),
            "reverse+grad_mass_q": (None, g_rev + g_mass), "forward-grad_mass_q": (None, g_fwd - g_mass),
            "zero": (None, torch.zeros(V, dtype=torch.float64))}


ROWS = [
    *[(f"topk_{d}", dict(topk=k, tail_grad=tg, importance_weight=iw))
      for d in ("reverse", "forward") for k in (0, 1, 3, 5) for tg in ("paper", "exact") for iw in (False, True)],
    *[(f"exact_{d}", dict(importance_weight=iw)) for d in ("reverse", "forward") for iw in (False, True)],
    *[(name, dict(importance_weight=iw)) for name in SAMPLED for iw in (False, True)],
]


@pytest.mark.parametrize("name,options", ROWS, ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items())}" for n, o in ROWS])
def test_every_kind_matches_its_row_of_the_table(name, options):
    theta, ref_logits, old_logits = _setup(3)
    cfg = KLConfig(type=name, **options)
    cfg.validate()
    kind = get_kl_kind(name)
    value_target, grad_target = kind.expected(cfg)
    needs = kind.needs(cfg)
    q = []
    if needs.topk:
        source = old_logits if needs.topk_of == "old" else ref_logits
        q = torch.topk(source, needs.topk).indices.tolist()
    targets = _targets(theta, ref_logits, q)
    value, grad, _ = _expectation(kind, cfg, theta, ref_logits, old_logits)
    assert grad_target != "none"
    if value_target in ("reverse", "forward"):
        assert torch.allclose(value, targets[value_target][0], atol=1e-12, rtol=0)
    assert torch.allclose(grad, targets[grad_target][1], atol=1e-12, rtol=0)
    if grad_target.endswith("grad_mass_q"):  # the paper's bias is real at 0 < k < V
        assert (grad - targets[grad_target.split("+")[0].split("-")[0]][1]).abs().max() > 1e-3


@pytest.mark.parametrize("direction,estimator", [("reverse", "reverse_reinforce"), ("forward", "forward_importance")])
@pytest.mark.parametrize("tail_grad", ["paper", "exact"])
def test_topk_kind_at_k0_is_the_sampled_estimator_with_iw_per_token(direction, estimator, tail_grad):
    """k = 0: q is empty, so every token is in the tail: Top-k reverse = K4 × s and Top-k forward = K5 × s
    per token (the forward exact tail drops K5's log r, whose value is 0: same value, and gradient in expectation)."""
    theta, ref_logits, old_logits = _setup(5)
    cfg = KLConfig(type=f"topk_{direction}", topk=0, tail_grad=tail_grad, importance_weight=True)
    kind = get_kl_kind(cfg.type)
    assert kind.needs(cfg).topk == 0 and kind.needs(cfg).topk_of is None
    policy, anchor, old_logp, labels = _stats(kind, cfg, theta, ref_logits, old_logits)
    got = kind.per_token(policy, anchor, labels, cfg=cfg, old_logp=old_logp)
    want = sampled_kl(estimator, policy.logp, anchor.logp, old_logp=old_logp)
    assert torch.allclose(got, want, atol=1e-14, rtol=0)
    weights = torch.softmax(old_logits, -1)
    g_got = torch.autograd.grad((weights * got[0]).sum(), theta, retain_graph=True)[0]
    g_want = torch.autograd.grad((weights * want[0]).sum(), theta, retain_graph=True)[0]
    assert torch.allclose(g_got, g_want, atol=1e-12, rtol=0)
    if tail_grad == "paper":  # the same function, so the same per-token gradient
        for p in range(V):
            a = torch.autograd.grad(got[0, p], theta, retain_graph=True)[0]
            b = torch.autograd.grad(want[0, p], theta, retain_graph=True)[0]
            assert torch.allclose(a, b, atol=1e-14, rtol=0)


def test_exact_kind_is_the_kl_at_every_token():
    theta, ref_logits, old_logits = _setup(1)
    for direction in ("reverse", "forward"):
        cfg = KLConfig(type=f"exact_{direction}")
        kind = get_kl_kind(cfg.type)
        _, _, per_tok = _expectation(kind, cfg, theta, ref_logits, old_logits)
        kl = _targets(theta, ref_logits, [])[direction][0]
        assert torch.allclose(per_tok, kl.expand(V), atol=1e-12, rtol=0)


def test_loss_aggregates_and_reports_metrics():
    theta, ref_logits, old_logits = _setup(2)
    cfg = KLConfig(type="topk_reverse", topk=3, importance_weight=True)
    kind = get_kl_kind(cfg.type)
    policy, anchor, old_logp, labels = _stats(kind, cfg, theta, ref_logits, old_logits)
    mask = torch.ones(1, V)
    mask[0, :2] = 0
    agg = LossAggregation.for_batch("token-mean", mask)
    loss, m = kind.loss(policy, anchor, labels, mask, agg, cfg=cfg, old_logp=old_logp)
    per_tok = kind.per_token(policy, anchor, labels, cfg=cfg, old_logp=old_logp)
    assert torch.allclose(loss, (per_tok * mask).sum() / mask.sum(), atol=1e-14)
    in_q = torch.isin(torch.arange(V), torch.topk(old_logits, 3).indices)
    assert m["kl_tail_frac"].item() == pytest.approx(float((~in_q[2:]).double().mean()))
    s = torch.exp(torch.log_softmax(theta.detach(), -1) - torch.log_softmax(old_logits, -1))[2:]
    assert m["kl_iw_mean"].item() == pytest.approx(float(s.mean()), rel=1e-6)
    assert m["kl_iw_max"].item() == pytest.approx(float(s.max()), rel=1e-6)


def test_registry_names_and_kinds():
    names = kl_kind_names()
    assert names[:4] == ["topk_reverse", "topk_forward", "exact_reverse", "exact_forward"]
    assert {"k1", "k3", "low_var_kl", "k5"} <= set(names)
    assert isinstance(get_kl_kind("topk_forward"), TopkKL) and isinstance(get_kl_kind("exact_reverse"), ExactKL)
    k3p = get_kl_kind("k3+")
    assert isinstance(k3p, SampledKL) and k3p.expected(KLConfig(type="k3+")) == ("reverse", "reverse")
    assert get_kl_kind("low_var_kl").estimator.name == get_kl_estimator("k3").name
    with pytest.raises(KeyError, match="topk_reverse"):
        get_kl_kind("k7")


def test_what_each_kind_needs_stored():
    assert get_kl_kind("topk_reverse").needs(KLConfig(topk=32)).topk_of == "old"
    assert get_kl_kind("topk_forward").needs(KLConfig(type="topk_forward", topk=32)).topk_of == "anchor"
    assert get_kl_kind("topk_forward").needs(KLConfig(type="topk_forward", topk=0)).topk == 0
    assert get_kl_kind("exact_forward").needs(KLConfig(type="exact_forward")).exact == "forward"
    k3 = get_kl_kind("k3").needs(KLConfig(type="k3"))
    assert k3.anchor_tokens and not k3.topk and k3.exact is None


def test_kind_validation_names_the_key():
    with pytest.raises(ConfigError, match="algorithm.kl.topk must be >= 0"):
        KLConfig(type="topk_forward", topk=-1).validate()
    with pytest.raises(ConfigError, match="algorithm.kl.tail_sampling=false leaves no KL term"):
        KLConfig(topk=0, tail_sampling=False).validate()
    KLConfig(topk=0, tail_sampling=False, enabled=False).validate()  # no KL term asked for
    KLConfig(type="k3", topk=-1).validate()  # k is a Top-k setting


def test_exact_kind_without_the_policy_exact_kl_is_refused():
    theta, ref_logits, old_logits = _setup(0)
    stats = token_stats_from_logits(theta.expand(1, V, V), torch.arange(V)[None])
    with pytest.raises(ValueError, match="exact_kl"):
        get_kl_kind("exact_reverse").per_token(stats, stats.detach(), torch.arange(V)[None], cfg=KLConfig(), old_logp=None)
