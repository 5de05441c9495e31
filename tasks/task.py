"""The two tasks as objects: what the agent loop, the trainer, the evaluator and SFT ask of a task.

A :class:`Task` owns what differs between question answering with search and math: its datasets, its
prompt template, whether the model searches (the multi-turn loop with a retriever) or answers in one
turn, how a trajectory is graded (the reward *is* the metric), its per-item scores, its dataset-level
metrics and their names. Callers hold a task object and ask it; nobody branches on the task's name.

* :data:`QA` -- the search (QA) task: multi-turn Search-R1 loop, SQuAD exact match of the model's last
  ``<answer>`` (:mod:`tasks.qa`);
* :data:`MATH` -- the math task: one turn, the last ``\\boxed{}`` after ``</think>``, graded in killable
  worker processes with a per-item timeout (:mod:`tasks.math`); a timeout scores 0.

The names users type map to a task in one place, :func:`get_task`: ``rollout.task`` says ``search`` or
``math`` (the agent loop's word), ``emapg eval --suite`` and the dataset registry say ``qa`` or ``math``;
``search`` and ``qa`` are the same task.

Trajectories are read, never imported (``tasks`` is below ``agent``): graders take the text the model
generated (``Trajectory.scored_text``) and, for QA's retrieval recall, the passages it was shown.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tasks.datasets import MATH_DATASETS, QA_DATASETS
from tasks.math import DEFAULT_GRADER, Grader, grade_many
from tasks.qa import AnswerRule, exact_match, extract_answer, qa_scores

#: Every name a user may type for a task (``rollout.task``, ``--suite``, a dataset's registry entry).
TaskName = Literal["qa", "search", "math"]


@dataclass(frozen=True)
class Outcome:
    """One trajectory's grade, kept with it so that nothing is graded twice.

    ``answer``: the answer read from the model's text (None: none found); ``reason``: why it scored what it
    did, for the counts (math: :attr:`tasks.math.GradeResult.reason`; QA: ``""``).
    """

    reward: float
    answer: str | None = None
    reason: str = ""


@dataclass(frozen=True)
class Grading:
    """How answers are graded: math's equivalence check, seconds per item and worker processes; QA's answer rule
    (:func:`tasks.qa.extract_answer`: ``search_r1``, the paper's and evaluation's, or ``last_complete``)."""

    grader: Grader = DEFAULT_GRADER
    timeout: float = 10.0
    workers: int = 2
    qa_answer: AnswerRule = "search_r1"


class Task:
    """What differs between the tasks; see the module docstring. Subclasses are singletons (:data:`QA`,
    :data:`MATH`)."""

    #: the task's name in results files and the dataset registry ("qa" / "math")
    name: str
    #: the same task's name in ``rollout.task`` ("search" / "math")
    rollout_name: str
    #: every dataset evaluated by default (``emapg eval`` without ``--datasets``)
    datasets: tuple[str, ...]
    #: the model searches: the multi-turn loop with a retriever; else one turn, no tools
    searches: bool
    #: the headline metric of a results file
    primary_metric: str
    #: per-item scores summed over items (not averaged) in a dataset's metrics and the average
    totals: tuple[str, ...]
    #: the grader is a setting of the run (shown in reports); else the task has one fixed scorer
    grader_setting: bool

    def template(self, fmt: str) -> str:
        """The default prompt template (``agent.prompts.TEMPLATES``) for ``rollout.format`` ``fmt``."""
        raise NotImplementedError

    def grade(self, texts: Sequence[str], golds: Sequence[Any], grading: Grading = Grading(), *,
              pool: Any = None) -> list[Outcome]:
        """One :class:`Outcome` per model text against its gold answers (``pool``: a math grader pool)."""
        raise NotImplementedError

    def counts(self, outcomes: Sequence[Outcome]) -> dict[str, float]:
        """Diagnostic counts of the grading outcomes (``reward/*`` metrics of the trainer)."""
        return {}

    def sample_scores(self, texts: Sequence[str], golds: Sequence[Any], passages: Sequence[Sequence[str]],
                      grading: Grading = Grading(), *, pool: Any = None) -> list[dict[str, Any]]:
        """Per-sample fields of an evaluation item's record (prediction and scores), one per text;
        ``passages``: per text, the retrieved text the model was shown."""
        raise NotImplementedError

    def item_scores(self, samples: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """An item's ``scores`` from its samples' records."""
        raise NotImplementedError

    def aggregate(self, records: Sequence[dict[str, Any]], n: int) -> dict[str, Any]:
        """Dataset-level metrics from per-item records (``n`` samples per item)."""
        raise NotImplementedError

    def metric_names(self, n: int) -> list[str]:
        """The metrics of a results file, in report order."""
        raise NotImplementedError

    def scorer(self, grader: str) -> str:
        """What scored the run, as a results file records it."""
        raise NotImplementedError

    def notes(self, total: Callable[[str], int]) -> list[str]:
        """Task-specific warnings for a report; ``total(key)``: an item score summed over every item."""
        return []

    def scoring_line(self, protocol: dict[str, Any], grader: str) -> str:
        """A report's line on how the run was scored (``protocol``: the results file's protocol)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<task {self.name}>"


def _mean(records: Sequence[dict[str, Any]], key: str) -> float:
    return sum(r[key] for r in records) / len(records)


class QATask(Task):
    name, rollout_name, datasets, searches = "qa", "search", QA_DATASETS, True
    primary_metric, grader_setting = "em", False
    metrics = ("em", "f1", "cover_em", "retrieval_recall", "has_answer", "searches", "turns", "response_tokens")
    # a score is only as good as the rollouts behind it: a dead retriever must not pass as a low score
    totals = ("rollout_errors", "search_failures")

    def template(self, fmt: str) -> str:
        return "search_tools" if fmt == "tool_calls" else "search_r1"

    def grade(self, texts, golds, grading=Grading(), *, pool=None) -> list[Outcome]:
        """SQuAD-normalised exact match of the model's last ``<answer>`` (read by ``grading.qa_answer``)."""
        _same_length(texts, golds)
        out = []
        for text, g in zip(texts, golds):
            answer = extract_answer(text, rule=grading.qa_answer)
            out.append(Outcome(exact_match(answer, g), answer))
        return out

    def sample_scores(self, texts, golds, passages, grading=Grading(), *, pool=None) -> list[dict[str, Any]]:
        _same_length(texts, golds)
        rule = grading.qa_answer
        return [{"prediction": extract_answer(t, rule=rule), "scores": qa_scores(t, g, p, rule=rule)}
                for t, g, p in zip(texts, golds, passages)]

    def item_scores(self, samples) -> dict[str, Any]:
        scores = {k: sum(s["scores"][k] for s in samples) / len(samples) for k in samples[0]["scores"]}
        for k in ("searches", "turns", "response_tokens"):
            scores[k] = _mean(samples, k)
        scores["rollout_errors"] = sum(s["stop_reason"] == "error" for s in samples)
        scores["search_failures"] = sum(s["search_failures"] for s in samples)
        scores["n_samples"] = len(samples)
        scores["n_correct"] = sum(s["scores"]["em"] >= 1.0 for s in samples)  # exact matches among the samples
        return scores

    def aggregate(self, records, n) -> dict[str, Any]:
        """Means over questions: with ``n`` > 1 samples per question ``em`` and ``f1`` are mean@n (each question's
        mean over its samples), and ``pass@k`` (k = 2, 4, ..., n; unbiased, :mod:`tasks.passk`) is the share of
        questions with an exact match among k of the samples."""
        from tasks.passk import default_ks, mean_pass_at_k

        _some(records)
        out: dict[str, Any] = {"n_items": len(records)}
        for m in self.metrics:
            out[m] = _mean([r["scores"] for r in records], m)
        for m in self.totals:
            out[m] = sum(r["scores"][m] for r in records)
        if n > 1:
            counts = [r["scores"].get("n_correct", round(r["scores"]["em"] * n)) for r in records]
            ns = [r["scores"].get("n_samples", n) for r in records]
            for k in default_ks(n)[1:]:
                out[f"pass@{k}"] = mean_pass_at_k(counts, ns, k)
        return out

    def metric_names(self, n: int) -> list[str]:
        from tasks.passk import default_ks

        return list(self.metrics) + [f"pass@{k}" for k in default_ks(n)[1:]] + list(self.totals)

    def scorer(self, grader: str) -> str:
        return "squad_em_last_answer"

    def scoring_line(self, protocol, grader) -> str:
        if protocol.get("format", "tags") == "tool_calls":
            return ("- scoring: SQuAD-normalised exact match of the final plain-text answer (the turn without a tool "
                    "call), the paper's metric on the tool-call format")
        return "- scoring: SQuAD-normalised exact match of the response's last `<answer>` (the paper's reward)"

    def notes(self, total) -> list[str]:
        if not total("search_failures"):
            return []
        return [f"**Warning:** {total('search_failures')} search(es) failed (retriever unreachable or erroring); "
                "the model was told the search failed."]


class MathTask(Task):
    name, rollout_name, datasets, searches = "math", "math", MATH_DATASETS, False
    primary_metric, grader_setting = "pass@1", True
    metrics = ("answered", "timeouts", "response_tokens")  # after pass@k for k in default_ks(n)
    totals = ("rollout_errors",)

    def template(self, fmt: str) -> str:
        return "math"

    def grade(self, texts, golds, grading=Grading(), *, pool=None) -> list[Outcome]:
        """The last ``\\boxed{}`` after ``</think>``, graded in worker processes with a per-item timeout."""
        _same_length(texts, golds)
        results = grade_many(list(texts), list(golds), timeout=grading.timeout, workers=grading.workers,
                             grader=grading.grader, pool=pool)
        return [Outcome(float(r.correct), r.extracted, r.reason) for r in results]

    def counts(self, outcomes) -> dict[str, float]:
        """Timeouts, grading errors and texts with nothing boxed."""
        counts = {"timeout": 0.0, "error": 0.0, "no_answer": 0.0}
        for o in outcomes:
            key = "error" if o.reason.startswith("error") else o.reason
            if key in counts:
                counts[key] += 1
        return counts

    def sample_scores(self, texts, golds, passages, grading=Grading(), *, pool=None) -> list[dict[str, Any]]:
        return [{"prediction": o.answer, "correct": bool(o.reward), "grade_reason": o.reason}
                for o in self.grade(texts, golds, grading, pool=pool)]

    def item_scores(self, samples) -> dict[str, Any]:
        n, c = len(samples), sum(s["correct"] for s in samples)
        return {
            "n_samples": n,
            "n_correct": c,
            "accuracy": c / n,
            "answered": sum(s["prediction"] is not None for s in samples) / n,
            "timeouts": sum(s["grade_reason"] == "timeout" for s in samples),
            "rollout_errors": sum(s["stop_reason"] == "error" for s in samples),
            "response_tokens": _mean(samples, "response_tokens"),
        }

    def aggregate(self, records, n) -> dict[str, Any]:
        from tasks.passk import default_ks, mean_pass_at_k

        _some(records)
        out: dict[str, Any] = {"n_items": len(records)}
        scores = [r["scores"] for r in records]
        counts, ns = [s["n_correct"] for s in scores], [s["n_samples"] for s in scores]
        for k in default_ks(n):
            out[f"pass@{k}"] = mean_pass_at_k(counts, ns, k)
        out["answered"] = _mean(scores, "answered")
        out["timeouts"] = sum(s["timeouts"] for s in scores)
        out["response_tokens"] = _mean(scores, "response_tokens")
        out["rollout_errors"] = sum(s["rollout_errors"] for s in scores)
        return out

    def metric_names(self, n: int) -> list[str]:
        from tasks.passk import default_ks

        return [f"pass@{k}" for k in default_ks(n)] + list(self.metrics + self.totals)

    def scorer(self, grader: str) -> str:
        return grader

    def scoring_line(self, protocol, grader) -> str:
        return f"- grader: `{grader}` (per-item timeout {protocol['grade_timeout']} s; timeouts count as wrong)"

    def notes(self, total) -> list[str]:
        if not total("timeouts"):
            return []
        return [f"Grading: {total('timeouts')} sample(s) hit the per-item grading timeout and count as incorrect."]


def _same_length(texts: Sequence[str], golds: Sequence[Any]) -> None:
    if len(texts) != len(golds):
        raise ValueError(f"{len(texts)} responses but {len(golds)} gold answers")


def _some(records: Sequence[Any]) -> None:
    if not records:
        raise ValueError("no records to aggregate")


QA = QATask()
MATH = MathTask()
#: name -> task, every name a user may type (``search`` is the QA task's name in ``rollout.task``)
TASKS: dict[str, Task] = {"qa": QA, "search": QA, "math": MATH}


def get_task(name: str | Task) -> Task:
    """The task called ``name`` (``qa``/``search``, ``math``); a task passes through."""
    if isinstance(name, Task):
        return name
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; choose from {', '.join(TASKS)}") from None
