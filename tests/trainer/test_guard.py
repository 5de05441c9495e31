"""The stability guard's detectors: each trips on its failure and stays quiet on a healthy run."""

from __future__ import annotations

import math

import pytest

from emapg.config import ConfigError, load_config
from emapg.paths import CONFIG_DIR
from trainer.config import TrainConfig
from trainer.guard import DETECTORS, Guard, GuardConfig, check_nonfinite, first_trips

HEALTHY = {
    "actor/entropy": 2.0, "kl/mean": 0.01, "response/length_mean": 40.0, "response/invalid_action_rate": 0.05,
    "response/no_answer_rate": 0.1, "reward/mean": 0.5, "actor/grad_norm": 1.0, "loss/pg": 0.1, "kl/loss": 1e-5,
    "actor/updates": 2.0, "actor/skipped_updates": 0.0, "response/repeated_ngram_share": 0.05,
    "response/non_text_share": 0.02, "response/length_drift": 0.1, "kl/to_start": 0.02,
}
# detector -> (metric, the value that trips it against the HEALTHY baseline)
TRIPS = {
    "entropy_collapse": ("actor/entropy", 0.01),  # < 0.25 * 2.0 and below the gate 0.02
    "entropy_explosion": ("actor/entropy", 9.0),  # > 4 * 2.0 + 0.5
    "kl_spike": ("kl/mean", 0.2),  # > 10 * 0.01 + 0.05
    "length_blowup": ("response/length_mean", 100.0),  # > 2 * 40 + 16
    "format_errors": ("response/invalid_action_rate", 0.5),  # > 0.05 + 0.3
    "reward_drop": ("reward/mean", 0.1),  # < 0.5 - 0.3
    "grad_norm_spike": ("actor/grad_norm", 12.0),  # > 10 * 1.0
    "repetition": ("response/repeated_ngram_share", 0.35),  # > 0.05 + 0.25
    "gibberish": ("response/non_text_share", 0.25),  # > 0.02 + 0.2
    "length_drift": ("response/length_drift", 1.2),  # > limit 1
    "kl_to_start": ("kl/to_start", 0.6),  # > limit 0.5
}
# just inside each threshold: no trip
NEAR = {
    "entropy_collapse": ("actor/entropy", 0.03), "entropy_explosion": ("actor/entropy", 8.0), "kl_spike": ("kl/mean", 0.14),
    "length_blowup": ("response/length_mean", 90.0), "format_errors": ("response/no_answer_rate", 0.3),
    "reward_drop": ("reward/mean", 0.25), "grad_norm_spike": ("actor/grad_norm", 9.0),
    "repetition": ("response/repeated_ngram_share", 0.29), "gibberish": ("response/non_text_share", 0.21),
    "length_drift": ("response/length_drift", 0.9), "kl_to_start": ("kl/to_start", 0.45),
}


def warmed_guard(**overrides) -> Guard:
    guard = Guard(GuardConfig(enabled=True, **overrides))
    for step in range(1, 4):  # min_history passing steps
        assert guard.check(step, HEALTHY) == []
    return guard


def test_every_detector_is_covered():
    assert set(TRIPS) == set(NEAR) == set(DETECTORS)


@pytest.mark.parametrize("name", list(DETECTORS))
def test_detector_trips(name):
    guard = warmed_guard()
    metric, value = TRIPS[name]
    trips = guard.check(4, {**HEALTHY, metric: value})
    assert [e.detector for e in trips] == [name], trips
    event = trips[0]
    assert event.metric == metric and event.value == value and event.step == 4 and event.action == "warn"
    assert not guard.last_passed and guard.events == trips
    assert len(guard.window[metric]) == 3  # a tripped step does not enter the baseline


@pytest.mark.parametrize("name", list(DETECTORS))
def test_detector_does_not_trip_inside_its_threshold(name):
    guard = warmed_guard()
    metric, value = NEAR[name]
    assert guard.check(4, {**HEALTHY, metric: value}) == []
    assert guard.last_passed


def test_relative_tests_wait_for_history_absolute_ones_do_not():
    guard = Guard(GuardConfig(enabled=True))
    assert guard.check(1, {**HEALTHY, "reward/mean": 0.0}) == []  # no baseline yet
    cfg = GuardConfig(enabled=True)
    cfg.reward_drop.limit = 0.05
    assert [e.detector for e in Guard(cfg).check(1, {**HEALTHY, "reward/mean": 0.0})] == ["reward_drop"]


@pytest.mark.parametrize(("gate", "value", "trips"), [(None, 0.3, True), (0.5, 0.3, True), (0.2, 0.3, False), (0.2, 0.1, True)])
def test_a_gate_limits_the_relative_test_to_values_beyond_it(gate, value, trips):
    """entropy_collapse at ratio 0.25 of a 2.0 baseline (bound 0.5): with a gate the fall counts only below the gate."""
    cfg = GuardConfig(enabled=True)
    cfg.entropy_collapse.gate = gate
    guard = Guard(cfg)
    for step in range(1, 4):
        guard.check(step, HEALTHY)
    assert [e.detector for e in guard.check(4, {**HEALTHY, "actor/entropy": value})] == (["entropy_collapse"] if trips else [])


def test_entropy_collapse_ignores_a_healthy_runs_low_step():
    """A healthy SmolLM2 search run's step entropy swings 0.045-0.5 nats (learning_search, 2026-12-05): its lowest
    step, far below a quarter of the window's mean, is not a collapse under the default gate."""
    guard = Guard(GuardConfig(enabled=True))
    for step, h in enumerate([0.099, 0.183, 0.181, 0.117, 0.428, 0.138, 0.342], start=1):
        assert guard.check(step, {**HEALTHY, "actor/entropy": h}) == []
    assert guard.check(8, {**HEALTHY, "actor/entropy": 0.045}) == []  # 0.045 < 0.25 x 0.213, above the gate
    assert [e.detector for e in guard.check(9, {**HEALTHY, "actor/entropy": 0.005})] == ["entropy_collapse"]


def test_an_upper_gate_and_the_absolute_limit_are_independent():
    """kl_spike's relative bound is 10 x 0.01 + 0.05 = 0.15: with a gate of 1.0, 0.5 does not trip (gated) and joins the
    baseline (bound 10 x 0.1325 + 0.05 = 1.375), 2.0 trips;
    an absolute limit trips whatever the gate."""
    cfg = GuardConfig(enabled=True)
    cfg.kl_spike.gate = 1.0
    guard = Guard(cfg)
    for step in range(1, 4):
        guard.check(step, HEALTHY)
    assert guard.check(4, {**HEALTHY, "kl/mean": 0.5}) == []
    assert [e.detector for e in guard.check(5, {**HEALTHY, "kl/mean": 2.0})] == ["kl_spike"]  # the passing 0.5 joined the baseline
    cfg.kl_spike.limit = 0.3
    assert [e.detector for e in guard.check(6, {**HEALTHY, "kl/mean": 0.5})] == ["kl_spike"]


def test_disabled_detector_and_chosen_action():
    cfg = GuardConfig(enabled=True)
    cfg.kl_spike.enabled = False
    cfg.reward_drop.action = "rollback"
    guard = Guard(cfg)
    for step in range(1, 4):
        guard.check(step, HEALTHY)
    assert guard.check(4, {**HEALTHY, "kl/mean": 5.0}) == []
    assert guard.check(5, {**HEALTHY, "reward/mean": 0.0})[0].action == "rollback"


@pytest.mark.parametrize("metric", ["loss/pg", "kl/mean", "actor/grad_norm", "actor/entropy", "reward/mean"])
def test_injected_nan_is_caught(metric):
    guard = warmed_guard()
    trips = guard.check(4, {**HEALTHY, metric: float("nan")})
    assert trips[0].detector == "nonfinite" and trips[0].metric == metric and math.isnan(trips[0].value)
    assert trips[0].action == "rollback"
    assert [e.detector for e in trips] == ["nonfinite"]  # the other detectors ignore the NaN


def test_skipped_update_is_nonfinite_and_healthy_is_not():
    cfg = GuardConfig(enabled=True).nonfinite
    event = check_nonfinite(cfg, {**HEALTHY, "actor/skipped_updates": 1.0, "actor/grad_norm": float("nan"), "actor/updates": 0.0}, 7)
    assert event.metric == "actor/skipped_updates" and event.step == 7
    assert check_nonfinite(cfg, HEALTHY, 7) is None
    assert check_nonfinite(cfg, {**HEALTHY, "loss/pg": float("inf")}, 7).metric == "loss/pg"


def test_window_is_a_moving_mean_of_passing_steps():
    guard = Guard(GuardConfig(enabled=True, window=3, min_history=2))
    for step, r in enumerate([0.9, 0.9, 0.75, 0.6, 0.5], 1):  # a slow decline: each step passes against the last 3
        assert guard.check(step, {**HEALTHY, "reward/mean": r}) == []
    assert list(guard.window["reward/mean"]) == [0.75, 0.6, 0.5]
    assert guard.check(6, {**HEALTHY, "reward/mean": 0.2})[0].baseline == pytest.approx(0.6167, abs=1e-4)
    state = guard.state_dict()
    other = Guard(GuardConfig(enabled=True, window=3, min_history=2))
    other.load_state_dict(state)
    assert other.baselines()["reward/mean"] == pytest.approx((0.75 + 0.6 + 0.5) / 3)


def test_guard_config_in_train_config():
    cfg = load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml", ["guard.enabled=true", "guard.kl_spike.action=stop"])
    assert cfg.guard.enabled and cfg.guard.kl_spike.action == "stop" and cfg.guard.kl_spike.ratio == 10.0
    assert not load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml", []).guard.enabled  # off by default
    with pytest.raises(ConfigError, match="guard"):
        load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml", ["guard.min_history=20"])
    with pytest.raises(ConfigError, match="action"):
        load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml", ["guard.kl_spike.action=panic"])


def degenerating(n: int = 12, start: int = 6) -> list[dict[str, float]]:
    """A synthetic run that degenerates from step ``start``: the text loops and turns to soup, the length and the
    KL to the start grow, while the reward holds for two more steps and then falls."""
    out = []
    for step in range(1, n + 1):
        k = max(step - start + 1, 0)  # steps into the degeneration
        out.append({**HEALTHY, "response/repeated_ngram_share": 0.05 + 0.15 * k, "response/non_text_share": 0.02 + 0.12 * k,
                    "response/length_drift": 0.1 + 0.3 * k, "kl/to_start": 0.02 + 0.15 * k,
                    "reward/mean": 0.5 if k < 3 else 0.05})
    return out


def test_the_text_signals_trip_before_the_reward_on_an_injected_degeneration():
    trips = first_trips(degenerating(), GuardConfig(enabled=True))
    # degeneration from step 6 (k = 1, 2, 3, ... at steps 6, 7, 8, ...); the reward falls at step 8
    assert trips["reward_drop"] == 8
    assert trips["repetition"] == 7  # 0.35 > 0.05 + 0.25 (relative test)
    assert trips["gibberish"] == 7  # 0.26 > 0.04 + 0.2: the window mean holds step 6's 0.14
    assert trips["length_drift"] == 9  # 1.3 > 1; 1.0 at step 8 is not above
    assert trips["kl_to_start"] == 9  # 0.62 > 0.5
    assert trips["entropy_collapse"] is None and trips["kl_spike"] is None


def test_the_text_signals_stay_quiet_on_a_healthy_run():
    healthy = [{**HEALTHY, "response/repeated_ngram_share": 0.05 + 0.01 * (s % 3), "response/length_drift": 0.05 * (s % 4),
                "reward/mean": 0.5 + 0.05 * (s % 2)} for s in range(20)]
    assert all(step is None for step in first_trips(healthy, GuardConfig(enabled=True)).values())
    # a metric the run does not log never trips its detector
    assert first_trips([{"reward/mean": 0.5}] * 5, GuardConfig(enabled=True))["kl_to_start"] is None
