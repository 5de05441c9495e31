"""Target-entropy control of the entropy bonus (issue #42; ``algorithm.entropy_target``, off by default).

The policy loss subtracts ``c * H`` (``algorithm.entropy_coef``; ``H`` the aggregated token entropy of the
response tokens, :func:`trainer.algo.grpo.compute_policy_loss`). With ``algorithm.entropy_target = H*`` set, the
coefficient ``c`` is no longer fixed: after every step it is moved in log space towards holding the step's mean
token entropy (``actor/entropy``, of the policy that sampled the batch) at ``H*``::

    e      = clip((H* - H) / H*, -1, 1)                       # relative shortfall; > 0: entropy too low
    log c <- clip(log c + rate * e, log c_min, log c_max)     # c_min, c_max = algorithm.entropy_coef_range

so ``c`` grows (a stronger bonus, entropy pushed up) while the entropy is below the target and shrinks while it
is above, by at most a factor ``exp(rate)`` per step, and stays within its range. The first step uses
``algorithm.entropy_coef`` clamped into the range. Each step logs the coefficient its update used
(``actor/entropy_coef``); the state is saved in checkpoints. The coefficient is never negative: entropy above
the target only weakens the bonus to ``c_min``, it is not penalised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["EntropyController", "controller_card"]


@dataclass
class EntropyController:
    """The adapted entropy coefficient (see the module docstring)."""

    target: float
    rate: float
    coef_min: float
    coef_max: float
    coef: float

    def __post_init__(self) -> None:
        if not (self.target > 0 and self.rate > 0 and 0 < self.coef_min <= self.coef_max):
            raise ValueError(f"invalid entropy controller {self}")
        self.coef = min(max(self.coef, self.coef_min), self.coef_max)

    @classmethod
    def from_config(cls, alg: Any) -> EntropyController | None:
        """The controller of a :class:`trainer.config.AlgorithmConfig` (None when ``entropy_target`` is unset)."""
        if alg.entropy_target is None:
            return None
        low, high = alg.entropy_coef_range
        return cls(target=float(alg.entropy_target), rate=float(alg.entropy_rate), coef_min=float(low),
                   coef_max=float(high), coef=float(alg.entropy_coef))

    def update(self, entropy: float) -> float:
        """Move the coefficient after a step whose mean token entropy was ``entropy``; the new coefficient (a
        non-finite entropy leaves it unchanged)."""
        if not math.isfinite(entropy):
            return self.coef
        error = min(max((self.target - entropy) / self.target, -1.0), 1.0)
        log_c = math.log(self.coef) + self.rate * error
        self.coef = min(max(math.exp(log_c), self.coef_min), self.coef_max)
        return self.coef

    def step_config(self, cfg: Any) -> Any:
        """``cfg`` (a :class:`trainer.config.TrainConfig`) with this step's adapted ``algorithm.entropy_coef``."""
        from dataclasses import replace

        return replace(cfg, algorithm=replace(cfg.algorithm, entropy_coef=self.coef))

    def after_step(self, metrics: dict[str, float]) -> None:
        """Report the coefficient this step's update used (``actor/entropy_coef``), then adapt it to its entropy."""
        metrics["actor/entropy_coef"] = self.coef
        self.update(metrics.get("actor/entropy", math.nan))

    def state_dict(self) -> dict[str, float]:
        return {"coef": self.coef}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        if "coef" in state:
            self.coef = min(max(float(state["coef"]), self.coef_min), self.coef_max)


def controller_card(alg: Any) -> dict[str, Any]:
    """What the provenance records of the entropy bonus: the fixed coefficient, or the controller's settings."""
    if alg.entropy_target is None:
        return {"entropy_coef": alg.entropy_coef, "entropy_control": None}
    return {"entropy_coef": alg.entropy_coef, "entropy_control": {
        "target": alg.entropy_target, "rate": alg.entropy_rate, "coef_range": list(alg.entropy_coef_range),
        "rule": "log c += rate * clip((target - H) / target, -1, 1), clipped to coef_range, after each step"}}
