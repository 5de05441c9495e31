"""Outcome rewards, scored exactly as evaluation scores them.

* search: SQuAD-normalised exact match of the response's last ``<answer>``
  (:func:`eval.qa_metrics.qa_reward`). The paper scores prompt + response and needs
  >= 2 matches because its prompt carries an ``<answer> Beijing </answer>`` example;
  scoring the response alone and taking its last match is the equivalent rule
  (ALGORITHM.md §8.6) without the prompt's example.
* math: last ``\\boxed{}`` after ``</think>``, graded in worker processes with a
  per-item timeout (:func:`eval.math_grader.grade_many`); a timeout scores 0.

Rewards are scalars per trajectory (the paper puts them on the last response token;
with outcome-only GRPO advantages that is the same thing).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

Task = Literal["search", "math"]


def search_rewards(responses: Sequence[str], golds: Sequence[Sequence[str]]) -> list[float]:
    from eval.qa_metrics import qa_reward

    return [float(qa_reward(r, g)) for r, g in zip(responses, golds, strict=True)]


def math_rewards(
    responses: Sequence[str], golds: Sequence[Any], *, timeout: float, workers: int, grader: str = "mathd_or_math_verify"
) -> tuple[list[float], dict[str, float]]:
    """Rewards and counts of grading outcomes (timeouts, errors, missing answers)."""
    from eval.math_grader import grade_many

    results = grade_many(list(responses), list(golds), timeout=timeout, workers=workers, grader=grader)
    counts = {"timeout": 0.0, "error": 0.0, "no_answer": 0.0}
    for r in results:
        key = "error" if r.reason.startswith("error") else r.reason
        if key in counts:
            counts[key] += 1
    return [float(r.correct) for r in results], counts


def compute_rewards(
    task: Task,
    responses: Sequence[str],
    golds: Sequence[Any],
    *,
    math_timeout: float = 10.0,
    math_workers: int = 2,
    math_grader: str = "mathd_or_math_verify",
) -> tuple[list[float], dict[str, float]]:
    """Per-trajectory rewards and diagnostic counts for ``task``."""
    if len(responses) != len(golds):
        raise ValueError(f"{len(responses)} responses but {len(golds)} gold answers")
    if task == "search":
        return search_rewards(responses, golds), {}
    if task == "math":
        return math_rewards(responses, golds, timeout=math_timeout, workers=math_workers, grader=math_grader)
    raise ValueError(f"unknown task {task!r}")
