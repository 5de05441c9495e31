"""Outcome rewards, scored exactly as evaluation scores them (a reward *is* the task's metric).

* search: SQuAD-normalised exact match of the model's last ``<answer>``
  (:func:`tasks.qa.qa_reward`) in the text the model generated (``Trajectory.model_text``). The
  paper scores prompt + response and needs >= 2 matches because its prompt carries an
  ``<answer> Beijing </answer>`` example; scoring the model's text alone and taking its last match
  is the equivalent rule (ALGORITHM.md §8.6) without the prompt's example.
* math: last ``\\boxed{}`` after ``</think>``, graded in worker processes with a
  per-item timeout (:func:`tasks.math.grade_many`); a timeout scores 0.

Rewards are scalars per trajectory (the paper puts them on the last response token;
with outcome-only GRPO advantages that is the same thing).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from tasks.math import DEFAULT_GRADER, Grader, grade_many
from tasks.qa import qa_reward

RolloutTask = Literal["search", "math"]


def search_rewards(model_texts: Sequence[str], golds: Sequence[Sequence[str]]) -> list[float]:
    return [float(qa_reward(r, g)) for r, g in zip(model_texts, golds, strict=True)]


def math_rewards(
    model_texts: Sequence[str], golds: Sequence[Any], *, timeout: float, workers: int, grader: Grader = DEFAULT_GRADER
) -> tuple[list[float], dict[str, float]]:
    """Rewards and counts of grading outcomes (timeouts, errors, missing answers)."""
    results = grade_many(list(model_texts), list(golds), timeout=timeout, workers=workers, grader=grader)
    counts = {"timeout": 0.0, "error": 0.0, "no_answer": 0.0}
    for r in results:
        key = "error" if r.reason.startswith("error") else r.reason
        if key in counts:
            counts[key] += 1
    return [float(r.correct) for r in results], counts


def compute_rewards(
    task: RolloutTask,
    model_texts: Sequence[str],
    golds: Sequence[Any],
    *,
    math_timeout: float = 10.0,
    math_workers: int = 2,
    math_grader: Grader = DEFAULT_GRADER,
) -> tuple[list[float], dict[str, float]]:
    """Per-trajectory rewards and diagnostic counts for ``task``.

    ``model_texts``: per trajectory, the text the model generated (``Trajectory.model_text``; "" for a
    trajectory that failed); ``golds``: its prompt's gold answers.
    """
    if len(model_texts) != len(golds):
        raise ValueError(f"{len(model_texts)} responses but {len(golds)} gold answers")
    if task == "search":
        return search_rewards(model_texts, golds), {}
    if task == "math":
        return math_rewards(model_texts, golds, timeout=math_timeout, workers=math_workers, grader=math_grader)
    raise ValueError(f"unknown task {task!r}")
