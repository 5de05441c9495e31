"""The stability guard's detectors: pure functions of a step's metrics and a window of healthy steps.

A run that collapses (entropy or KL explodes, responses blow up, reward falls) usually shows it in
its step metrics several steps before the reward curve makes it obvious. Each detector watches one
kind of failure and compares the step's value with the **baseline**: the mean of that metric over
the last ``guard.window`` steps that passed the guard (tripped steps never enter the window, so a
collapse does not become the new normal; an absolute ``limit`` also catches a slow drift).

A detector (:class:`DetectorConfig`) trips when any of its enabled tests does:

* relative: ``value > ratio * baseline + delta`` for an upper detector, ``value < ratio * baseline -
  delta`` for a lower one (once ``guard.min_history`` healthy steps are in the window);
* absolute: ``value > limit`` (upper) / ``value < limit`` (lower), from the first step.

A ``gate`` restricts the relative test to values beyond an absolute level (``entropy_collapse``: a fall to a
quarter of the baseline counts only below ``gate`` nats per token).

+----------------------+---------------------------------------+-----------+
| detector             | metric(s)                             | direction |
+======================+=======================================+===========+
| ``entropy_collapse`` | ``actor/entropy``                     | below     |
| ``entropy_explosion``| ``actor/entropy``                     | above     |
| ``kl_spike``         | ``kl/mean`` (KL to the anchor)        | above     |
| ``length_blowup``    | ``response/length_mean``              | above     |
| ``format_errors``    | ``response/invalid_action_rate``,     | above     |
|                      | ``response/no_answer_rate`` (max)     |           |
| ``reward_drop``      | ``reward/mean``                       | below     |
| ``grad_norm_spike``  | ``actor/grad_norm``                   | above     |
| ``repetition``       | ``response/repeated_ngram_share``     | above     |
| ``gibberish``        | ``response/non_text_share``           | above     |
| ``length_drift``     | ``response/length_drift`` (vs start)  | above     |
| ``kl_to_start``      | ``kl/to_start``                       | above     |
+----------------------+---------------------------------------+-----------+

The last four watch the signals of :mod:`trainer.health_signals` that move before the reward does when a
policy degenerates (issue #42): looping text, token soup, a length far from the run's start, a policy far
from the one the run started with. A detector whose metric a run does not log never trips.

``nonfinite`` trips on a NaN/inf loss, gradient norm, KL, entropy or reward, or on an update that
``trainer.step`` skipped for a non-finite gradient.

What a trip does (``warn``, ``lower_lr``, ``rollback``, ``reset_to_anchor``, ``stop``) is carried
out by :mod:`trainer.recovery`; this module only decides. :class:`Guard` is the state: the window,
the events, and whether the last step passed.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Literal, Mapping

from emapg.config import ConfigError, option

Action = Literal["warn", "lower_lr", "rollback", "reset_to_anchor", "stop"]
Direction = Literal["above", "below"]

__all__ = ["Action", "DetectorConfig", "NonfiniteConfig", "GuardConfig", "GuardEvent", "Guard", "DETECTORS",
           "NONFINITE_METRICS", "check_detector", "check_nonfinite", "first_trips"]

#: detector name -> (metrics it reads, the direction that is bad)
DETECTORS: dict[str, tuple[tuple[str, ...], Direction]] = {
    "entropy_collapse": (("actor/entropy",), "below"),
    "entropy_explosion": (("actor/entropy",), "above"),
    "kl_spike": (("kl/mean",), "above"),
    "length_blowup": (("response/length_mean",), "above"),
    "format_errors": (("response/invalid_action_rate", "response/no_answer_rate"), "above"),
    "reward_drop": (("reward/mean",), "below"),
    "grad_norm_spike": (("actor/grad_norm",), "above"),
    "repetition": (("response/repeated_ngram_share",), "above"),
    "gibberish": (("response/non_text_share",), "above"),
    "length_drift": (("response/length_drift",), "above"),
    "kl_to_start": (("kl/to_start",), "above"),
}
#: every metric some detector reads, once each
WATCHED = tuple(dict.fromkeys(m for names, _ in DETECTORS.values() for m in names))
NONFINITE_METRICS = ("loss/pg", "kl/loss", "kl/mean", "actor/grad_norm", "actor/entropy", "reward/mean")


_ACTION_HELP = ("on a trip: warn, lower_lr, rollback (to the last checkpoint that passed the guard, skipping the batches "
                "since), reset_to_anchor (copy the EMA anchor into the policy), stop")
_RATIO_HELP = ("relative test: trip when value > ratio*baseline + delta (upper detectors) or value < ratio*baseline - delta "
               "(lower ones); null: no relative test")
_DELTA_HELP = "additive margin of the relative test (in the metric's unit)"
_LIMIT_HELP = "absolute test: trip when value > limit (upper) or < limit (lower); null: none"
_GATE_HELP = ("the relative test counts only beyond this absolute level (value > gate for upper detectors, < gate for lower "
              "ones): a fall from a high baseline that stays in a healthy range is not a trip; null: no gate")


@dataclass
class DetectorConfig:
    """One detector's thresholds and what a trip does (each detector below has its own defaults)."""

    enabled: bool = option(True, help="watch this failure (when guard.enabled)")
    action: Action = option("warn", help=_ACTION_HELP)
    ratio: float | None = option(None, ge=0, help=_RATIO_HELP)
    delta: float = option(0.0, ge=0, help=_DELTA_HELP)
    limit: float | None = option(None, help=_LIMIT_HELP)
    gate: float | None = option(None, help=_GATE_HELP)


@dataclass
class EntropyCollapseConfig(DetectorConfig):
    ratio: float | None = option(0.25, ge=0, help=_RATIO_HELP)
    # Measured 2026-12-05 (issue #42): on healthy SmolLM2 search runs (studies/learning_search.py, 12 steps, groups
    # of equal rewards dropped) the step's mean token entropy swings 0.045-0.5 nats from step to step (a step trains
    # 4-8 rows of different questions), so the ratio test alone tripped on 4 of 6 healthy runs; a collapsed policy
    # is near 0 nats per token.
    gate: float | None = option(0.02, help=_GATE_HELP)


@dataclass
class EntropyExplosionConfig(DetectorConfig):
    ratio: float | None = option(4.0, ge=0, help=_RATIO_HELP)
    delta: float = option(0.5, ge=0, help=_DELTA_HELP)


@dataclass
class KLSpikeConfig(DetectorConfig):
    ratio: float | None = option(10.0, ge=0, help=_RATIO_HELP)
    delta: float = option(0.05, ge=0, help=_DELTA_HELP)


@dataclass
class LengthBlowupConfig(DetectorConfig):
    ratio: float | None = option(2.0, ge=0, help=_RATIO_HELP)
    delta: float = option(16.0, ge=0, help=_DELTA_HELP)


@dataclass
class FormatErrorsConfig(DetectorConfig):
    ratio: float | None = option(1.0, ge=0, help=_RATIO_HELP)
    delta: float = option(0.3, ge=0, help=_DELTA_HELP)


@dataclass
class RewardDropConfig(DetectorConfig):
    ratio: float | None = option(1.0, ge=0, help=_RATIO_HELP)
    delta: float = option(0.3, ge=0, help=_DELTA_HELP)


@dataclass
class GradNormSpikeConfig(DetectorConfig):
    ratio: float | None = option(10.0, ge=0, help=_RATIO_HELP)


@dataclass
class RepetitionConfig(DetectorConfig):
    ratio: float | None = option(1.0, ge=0, help=_RATIO_HELP)
    delta: float = option(0.25, ge=0, help=_DELTA_HELP)
    limit: float | None = option(0.5, help=_LIMIT_HELP)


@dataclass
class GibberishConfig(DetectorConfig):
    ratio: float | None = option(1.0, ge=0, help=_RATIO_HELP)
    delta: float = option(0.2, ge=0, help=_DELTA_HELP)
    limit: float | None = option(0.3, help=_LIMIT_HELP)


@dataclass
class LengthDriftConfig(DetectorConfig):
    limit: float | None = option(1.0, help=_LIMIT_HELP)


@dataclass
class KLToStartConfig(DetectorConfig):
    limit: float | None = option(0.5, help=_LIMIT_HELP)


@dataclass
class NonfiniteConfig:
    enabled: bool = option(True, help="trip on a NaN/inf loss, gradient norm, KL, entropy or reward, or a skipped update")
    action: Action = option("rollback", help=_ACTION_HELP)


@dataclass
class GuardConfig:
    """Stability guard (trainer.guard, trainer.recovery): per-step detectors and what each trip does."""

    enabled: bool = option(False, help="watch every step's metrics for a collapse and act on it")
    window: int = option(10, help="baseline = mean over the last N steps that passed the guard")
    min_history: int = option(3, help="relative tests start once this many passing steps are in the window")
    lr_factor: float = option(0.5, gt=0, lt=1, help="lower_lr multiplies the learning rate (and its schedule's base) by this")
    max_recoveries: int = option(3, help="after this many lower_lr/rollback/reset_to_anchor actions, the next trip stops the run")
    entropy_collapse: EntropyCollapseConfig = option(
        default_factory=EntropyCollapseConfig, help="actor/entropy below ratio*baseline - delta or below limit (the policy turned deterministic)")
    entropy_explosion: EntropyExplosionConfig = option(
        default_factory=EntropyExplosionConfig, help="actor/entropy above ratio*baseline + delta or above limit (the policy turned to noise)")
    kl_spike: KLSpikeConfig = option(default_factory=KLSpikeConfig, help="kl/mean (KL to the anchor) above ratio*baseline + delta or above limit")
    length_blowup: LengthBlowupConfig = option(
        default_factory=LengthBlowupConfig, help="response/length_mean (tokens) above ratio*baseline + delta or above limit")
    format_errors: FormatErrorsConfig = option(
        default_factory=FormatErrorsConfig,
        help="the larger of response/invalid_action_rate and response/no_answer_rate above ratio*baseline + delta or above limit")
    reward_drop: RewardDropConfig = option(default_factory=RewardDropConfig,
                                           help="reward/mean below ratio*baseline - delta (the moving window) or below limit")
    grad_norm_spike: GradNormSpikeConfig = option(
        default_factory=GradNormSpikeConfig, help="actor/grad_norm (before clipping) above ratio*baseline + delta or above limit")
    repetition: RepetitionConfig = option(
        default_factory=RepetitionConfig,
        help="response/repeated_ngram_share (the share of a response's word 4-grams that repeat one before) above "
             "ratio*baseline + delta or above limit (the policy loops)")
    gibberish: GibberishConfig = option(
        default_factory=GibberishConfig,
        help="response/non_text_share (the share of words that are not text) above ratio*baseline + delta or above limit")
    length_drift: LengthDriftConfig = option(
        default_factory=LengthDriftConfig,
        help="response/length_drift (mean response length / the run's first steps' - 1) above limit (1: doubled)")
    kl_to_start: KLToStartConfig = option(
        default_factory=KLToStartConfig,
        help="kl/to_start (exact KL(policy || the run's starting policy) per response token, logged with "
             "logging.kl_to_start) above limit")
    nonfinite: NonfiniteConfig = option(default_factory=NonfiniteConfig, help="NaN/inf values or skipped updates")

    def validate(self) -> None:
        if self.window < 1 or not 1 <= self.min_history <= self.window:
            raise ConfigError("guard.window must be >= 1 and guard.min_history in [1, guard.window]")
        if self.max_recoveries < 0:
            raise ConfigError("guard.max_recoveries must be >= 0")

    def detectors(self) -> dict[str, DetectorConfig]:
        return {name: getattr(self, name) for name in DETECTORS}

    def actions(self) -> set[str]:
        """The actions some enabled detector may take."""
        acts = {d.action for d in self.detectors().values() if d.enabled}
        return acts | ({self.nonfinite.action} if self.nonfinite.enabled else set())


@dataclass
class GuardEvent:
    """One trip: which detector, on what value against which threshold, and the action taken."""

    step: int
    detector: str
    metric: str
    value: float
    threshold: float | None  # the bound that was crossed (None for non-finite values)
    baseline: float | None
    action: Action
    detail: str = ""  # what the action did (filled in by trainer.recovery)

    def describe(self) -> str:
        if self.threshold is None:
            return f"step {self.step}: {self.detector}: {self.metric} = {self.value}"
        base = f", baseline {self.baseline:.4g}" if self.baseline is not None else ""
        return f"step {self.step}: {self.detector}: {self.metric} = {self.value:.4g} crossed {self.threshold:.4g}{base}"


def _value(metrics: Mapping[str, float], name: str) -> float | None:
    v = metrics.get(name)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def check_detector(name: str, cfg: DetectorConfig, metrics: Mapping[str, float], baselines: Mapping[str, float | None],
                   step: int) -> GuardEvent | None:
    """The trip of detector ``name`` at ``step``, or None. ``baselines[metric]``: the window mean (None
    while the window is shorter than ``min_history``). Non-finite values are :func:`check_nonfinite`'s."""
    names, direction = DETECTORS[name]
    worst: GuardEvent | None = None
    for metric in names:
        value = _value(metrics, metric)
        if value is None or not math.isfinite(value):
            continue
        base = baselines.get(metric)
        bounds = []
        if cfg.limit is not None:
            bounds.append(cfg.limit)
        gated_out = cfg.gate is not None and ((value <= cfg.gate) if direction == "above" else (value >= cfg.gate))
        if cfg.ratio is not None and base is not None and not gated_out:
            bounds.append(cfg.ratio * base + cfg.delta if direction == "above" else cfg.ratio * base - cfg.delta)
        for bound in bounds:
            if (value > bound) if direction == "above" else (value < bound):
                worst = worst or GuardEvent(step, name, metric, value, bound, base, cfg.action)
                break
    return worst


def check_nonfinite(cfg: NonfiniteConfig, metrics: Mapping[str, float], step: int) -> GuardEvent | None:
    """A NaN/inf among :data:`NONFINITE_METRICS`, or an update skipped for a non-finite gradient."""
    for metric in NONFINITE_METRICS:
        value = _value(metrics, metric)
        if value is not None and not math.isfinite(value) and not (metric == "actor/grad_norm" and metrics.get("actor/updates") == 0):
            return GuardEvent(step, "nonfinite", metric, value, None, None, cfg.action)
    skipped = _value(metrics, "actor/skipped_updates")
    if skipped:
        return GuardEvent(step, "nonfinite", "actor/skipped_updates", skipped, None, None, cfg.action)
    return None


class Guard:
    """The detectors' state over a run: the window of passing steps, every event, the last verdict."""

    def __init__(self, cfg: GuardConfig) -> None:
        self.cfg = cfg
        self.window: dict[str, deque[float]] = {}
        self.events: list[GuardEvent] = []
        self.last_passed = True
        self.recoveries = 0

    def baselines(self) -> dict[str, float | None]:
        return {m: (sum(v) / len(v) if len(v) >= self.cfg.min_history else None) for m, v in self.window.items()}

    def check(self, step: int, metrics: Mapping[str, float]) -> list[GuardEvent]:
        """The trips of ``step`` (in detector order, the non-finite check first); a step without any
        enters the window."""
        trips: list[GuardEvent] = []
        if self.cfg.nonfinite.enabled:
            event = check_nonfinite(self.cfg.nonfinite, metrics, step)
            if event is not None:
                trips.append(event)
        base = self.baselines()
        for name, det in self.cfg.detectors().items():
            if det.enabled:
                event = check_detector(name, det, metrics, base, step)
                if event is not None:
                    trips.append(event)
        self.last_passed = not trips
        if not trips:
            for metric in WATCHED:
                value = _value(metrics, metric)
                if value is not None and math.isfinite(value):
                    self.window.setdefault(metric, deque(maxlen=self.cfg.window)).append(value)
        self.events += trips
        return trips

    def state_dict(self) -> dict:
        return {"window": {m: list(v) for m, v in self.window.items()}, "recoveries": self.recoveries,
                "events": len(self.events), "passed": self.last_passed}

    def load_state_dict(self, state: Mapping) -> None:
        self.window = {m: deque(v, maxlen=self.cfg.window) for m, v in state.get("window", {}).items()}
        self.recoveries = int(state.get("recoveries", 0))


def first_trips(history: list[Mapping[str, float]], cfg: GuardConfig) -> dict[str, int | None]:
    """Per enabled detector, the first step (1-based index into ``history``, a run's step metrics) at which it
    alone would have tripped, replayed with its own window (None: never). What the stability benchmark's
    lead times and false-trip rates are computed from."""
    out: dict[str, int | None] = {}
    for name, det in cfg.detectors().items():
        if not det.enabled:
            continue
        alone = Guard(cfg)
        out[name] = None
        for step, metrics in enumerate(history, 1):
            base = alone.baselines()
            event = check_detector(name, det, metrics, base, step)
            if event is not None:
                out[name] = step
                break
            for metric in DETECTORS[name][0]:
                value = _value(metrics, metric)
                if value is not None and math.isfinite(value):
                    alone.window.setdefault(metric, deque(maxlen=cfg.window)).append(value)
    return out
