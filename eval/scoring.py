"""Scoring an evaluation batch: each question's trajectories -> its ``items/<dataset>.jsonl`` record.

The grading is the task's own (:class:`tasks.task.Task`: the training reward's functions), on the text the
model generated (``Trajectory.scored_text``), never on observation text. A record holds the item's scores
(:meth:`tasks.task.Task.item_scores`) and every sample with its prediction, scores and rollout facts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tasks.datasets import Example
from tasks.task import Grading, Task

if TYPE_CHECKING:
    from agent.rollout import Trajectory


def observation_texts(traj: Trajectory, tokenizer: Any) -> list[str]:
    """The retrieved text the model was shown (each successful search's observation)."""
    return [tokenizer.decode(ids, skip_special_tokens=True) for ids in traj.span_ids("observation", "information")]


def sample_record(traj: Trajectory, tokenizer: Any) -> dict[str, Any]:
    """What a sample's record says of its rollout (the task adds its prediction and scores)."""
    return {
        "response": traj.response_text,
        "stop_reason": traj.stop_reason,
        "turns": traj.num_turns,
        "searches": traj.num_searches,
        "queries": list(traj.queries),
        "retrieved_ids": [list(ids) for ids in traj.retrieved_ids],
        "search_failures": traj.search_failures,
        "invalid_actions": traj.invalid_actions,
        "response_tokens": len(traj.response_ids),
        "model_tokens": traj.num_model_tokens,
        "error": traj.error,
    }


def search_gold(shown: Sequence[str], example: Example) -> list[int]:
    """Per search, 1 when the passages shown hold a gold answer (:func:`tasks.qa.gold_shown`: golds the question itself
    names left out), read by :mod:`eval.search_metrics`; [] for a task without searches."""
    from tasks.qa import gold_shown

    return [int(gold_shown([text], example.answers, example.question) is not None) for text in shown]


def score_items(task: Task, examples: Sequence[Example], trajs_per_item: Sequence[Sequence[Trajectory]], tokenizer: Any,
                grading: Grading, pool: Any = None) -> list[dict[str, Any]]:
    """Per-item records of ``examples`` from their trajectories (one per sample); every sample of the batch is
    graded in one call (math: one grader-pool call)."""
    flat = [(ex, t) for ex, trajs in zip(examples, trajs_per_item, strict=True) for t in trajs]
    shown = [observation_texts(t, tokenizer) for _, t in flat]
    scored = task.sample_scores([t.scored_text for _, t in flat], [ex.answers for ex, _ in flat], shown, grading, pool=pool)
    out, i = [], 0
    for ex, trajs in zip(examples, trajs_per_item):
        samples = []
        for t in trajs:
            samples.append({**sample_record(t, tokenizer), **scored[i], "search_gold": search_gold(shown[i], ex)})
            i += 1
        out.append(_item_record(ex, trajs, tokenizer, samples, task.item_scores(samples)))
    return out


def _item_record(example: Example, trajs: Sequence[Trajectory], tokenizer: Any, samples: list[dict[str, Any]],
                 scores: dict[str, Any]) -> dict[str, Any]:
    first = samples[0]
    return {
        "id": example.id,
        "dataset": example.data_source,
        "question": example.question,
        "golds": list(example.answers),
        "prompt": tokenizer.decode(trajs[0].prompt_ids, skip_special_tokens=False),
        "prediction": first["prediction"],
        "response": first["response"],
        "searches": first["searches"],
        "turns": first["turns"],
        "scores": scores,
        "samples": samples,
    }


def notes(task: Task, records: dict[str, list[dict[str, Any]]]) -> str | None:
    """Warnings for the report: rollouts that failed, and the task's own (failed searches, grading timeouts)."""
    def total(key: str) -> int:
        return sum(r["scores"].get(key, 0) for recs in records.values() for r in recs)

    found = []
    if total("rollout_errors"):
        found.append(f"**Warning:** {total('rollout_errors')} sample(s) ended with a rollout error (see `error` in "
                     "items/*.jsonl) and score 0.")
    found += task.notes(total)
    return "\n\n".join(found) or None
