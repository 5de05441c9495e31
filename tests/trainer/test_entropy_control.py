"""Target-entropy control (trainer.entropy_control): the coefficient moves the right way by the exact log-space step,
stays in its range, survives a checkpoint; the entropy bonus's gradient through the production token statistics
equals the enumerated one on a tiny vocabulary."""

from __future__ import annotations

import math

import pytest
import torch

from emapg.config import ConfigError, load_config
from emapg.paths import CONFIG_DIR
from trainer.algo.grpo import LossAggregation, compute_policy_loss
from trainer.algo.token_stats import token_stats_from_hidden
from trainer.config import AlgorithmConfig, TrainConfig
from trainer.entropy_control import EntropyController, controller_card


def controller(coef: float = 0.01, target: float = 1.0, rate: float = 0.5) -> EntropyController:
    return EntropyController(target=target, rate=rate, coef_min=1e-4, coef_max=0.1, coef=coef)


def test_coefficient_grows_while_entropy_is_below_target_by_the_exact_step():
    c = controller()
    assert c.update(0.5) == pytest.approx(0.01 * math.exp(0.5 * 0.5), rel=1e-12)  # shortfall (1 - 0.5)/1
    assert c.update(0.0) == pytest.approx(0.01 * math.exp(0.25 + 0.5), rel=1e-12)  # full shortfall: e = 1


def test_coefficient_shrinks_while_entropy_is_above_target_and_the_error_is_clipped():
    c = controller()
    assert c.update(1.5) == pytest.approx(0.01 * math.exp(-0.25), rel=1e-12)
    before = c.coef
    assert c.update(10.0) == pytest.approx(before * math.exp(-0.5), rel=1e-12)  # e clipped to -1


def test_entropy_at_target_leaves_it_and_nonfinite_entropy_is_ignored():
    c = controller()
    held = c.update(1.0)
    assert held == pytest.approx(0.01, rel=1e-12)
    assert c.update(float("nan")) == held and c.update(float("inf")) == held


def test_coefficient_stays_in_its_range():
    c = controller()
    for _ in range(50):
        c.update(0.0)
    assert c.coef == 0.1
    for _ in range(100):
        c.update(5.0)
    assert c.coef == 1e-4


def test_holds_a_synthetic_entropy_near_target():
    """A toy plant: the entropy rises with the coefficient (H = 2 * c / (c + 0.01)); the controller settles where
    H = target (c = 0.01 for target 1.0), from either side."""
    for start in (1e-4, 0.1):
        c = controller(coef=start, rate=0.3)
        for _ in range(200):
            c.update(2 * c.coef / (c.coef + 0.01))
        assert 2 * c.coef / (c.coef + 0.01) == pytest.approx(1.0, abs=0.02)


def test_state_round_trip_and_from_config():
    c = controller()
    c.update(0.0)
    other = controller()
    other.load_state_dict(c.state_dict())
    assert other.coef == c.coef
    assert EntropyController.from_config(AlgorithmConfig()) is None
    alg = AlgorithmConfig(entropy_coef=0.0, entropy_target=0.8, entropy_rate=0.1, entropy_coef_range=[1e-3, 0.05])
    made = EntropyController.from_config(alg)
    assert (made.target, made.rate, made.coef_min, made.coef_max, made.coef) == (0.8, 0.1, 1e-3, 0.05, 1e-3)  # clamped
    card = controller_card(alg)
    assert card["entropy_control"]["target"] == 0.8 and card["entropy_control"]["coef_range"] == [1e-3, 0.05]
    assert controller_card(AlgorithmConfig())["entropy_control"] is None


def test_config_fields_and_validation():
    cfg = load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml",
                      ["algorithm.entropy_target=0.5", "algorithm.entropy_rate=0.3", "algorithm.entropy_coef_range=[0.001,0.01]"])
    assert cfg.algorithm.entropy_target == 0.5 and cfg.algorithm.entropy_coef_range == [0.001, 0.01]
    assert load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml", []).algorithm.entropy_target is None
    with pytest.raises(ConfigError):
        load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml", ["algorithm.entropy_coef_range=[0.1,0.01]"])
    with pytest.raises(ConfigError):
        load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml", ["algorithm.entropy_target=0"])


def test_entropy_bonus_gradient_equals_enumeration_on_a_tiny_vocab():
    """loss = pg - c * token-mean(H) through the production chunked token statistics (zero advantages: the PG term
    has no gradient); its gradient w.r.t. the hidden states and the lm_head equals the float64 enumeration of
    H = -sum_v p_v log p_v over the 5-token vocabulary."""
    torch.manual_seed(0)
    B, T, H, V, coef = 2, 3, 4, 5, 0.07
    hidden = torch.randn(B, T, H, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (B, T))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    stats = token_stats_from_hidden(hidden, weight, labels, entropy=True, chunk_size=2)
    agg = LossAggregation.for_batch("token-mean", mask)
    loss, metrics = compute_policy_loss(stats.logp, stats.logp.detach(), torch.zeros(B, T), mask, agg,
                                        entropy=stats.entropy, entropy_coef=coef)
    g_hidden, g_weight = torch.autograd.grad(loss, [hidden, weight])

    h2 = hidden.detach().clone().requires_grad_(True)
    w2 = weight.detach().clone().requires_grad_(True)
    logits = h2 @ w2.T
    entropy = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        for t in range(T):
            z = logits[b, t]
            p = [torch.exp(z[v] - torch.logsumexp(z, 0)) for v in range(V)]
            entropy[b, t] = -sum(pv * torch.log(pv) for pv in p)
    m = mask.to(torch.float64)
    expected_loss = -coef * (entropy * m).sum() / m.sum()
    e_hidden, e_weight = torch.autograd.grad(expected_loss, [h2, w2])
    assert float(metrics["entropy"]) == pytest.approx(float((entropy.detach() * m).sum() / m.sum()), rel=1e-6)
    assert float(loss) == pytest.approx(float(expected_loss.detach()), rel=1e-6)
    torch.testing.assert_close(g_hidden, e_hidden, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(g_weight.to(torch.float64), e_weight, rtol=1e-5, atol=1e-7)
    assert g_hidden[0, 2].abs().max() == 0  # a masked token gets no bonus
