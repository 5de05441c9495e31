"""What counts as a collapsed run: a pure function of its per-step reward (and gibberish) series.

The stability benchmark (``studies/stability.py``) pre-registers this definition; a run has
collapsed at step s when either

* its mean reward stays below ``reward_fraction`` times its starting level for ``consecutive`` steps
  in a row, s the first of them (the starting level: the mean reward of the run's first ``start_steps``
  steps; a run that starts at 0 cannot collapse this way), or
* its non-text share (``response/non_text_share``) exceeds ``gibberish`` at step s;

whichever comes first. Steps are 1-based.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = ["CollapseDefinition", "collapse_step"]


@dataclass(frozen=True)
class CollapseDefinition:
    reward_fraction: float = 0.5
    consecutive: int = 3
    start_steps: int = 2
    gibberish: float = 0.5

    def __post_init__(self) -> None:
        if not 0 <= self.reward_fraction < 1 or self.consecutive < 1 or self.start_steps < 1 or not 0 <= self.gibberish <= 1:
            raise ValueError(f"invalid collapse definition {self}")

    def describe(self) -> str:
        return (f"collapsed at step s: reward/mean below {self.reward_fraction:g} x its starting level (the mean over "
                f"the first {self.start_steps} steps) for {self.consecutive} consecutive steps from s, or "
                f"response/non_text_share above {self.gibberish:g} at s; the earlier of the two")


def collapse_step(rewards: Sequence[float], non_text: Sequence[float] | None = None,
                  definition: CollapseDefinition = CollapseDefinition()) -> int | None:
    """The step at which the run of per-step mean ``rewards`` (and ``non_text`` shares) collapsed, or None."""
    d = definition
    found: list[int] = []
    if len(rewards) >= d.start_steps:
        start = sum(rewards[: d.start_steps]) / d.start_steps
        run = 0
        for step, r in enumerate(rewards, 1):
            if step > d.start_steps and r < d.reward_fraction * start:
                run += 1
                if run == d.consecutive:
                    found.append(step - d.consecutive + 1)
                    break
            else:
                run = 0
    if non_text is not None:
        found += [step for step, g in enumerate(non_text, 1) if g > d.gibberish][:1]
    return min(found) if found else None
