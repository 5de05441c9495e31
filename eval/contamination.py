"""The contamination guard of ``emapg eval``: never report a score on questions the model was trained on as if unseen.

Training and SFT write ``trained_questions.json`` beside the weights they save (:mod:`tasks.contamination`).
Before anything runs, :func:`check_contamination` reads the record of the model folder being evaluated and
matches every loaded question against it (same identity as the record: SQuAD-normalised text). Then:

* no record (a base model, a hub name, a folder written before the guard existed): evaluated as before;
  ``results.json`` says ``contamination.checked: false``;
* questions found in the record: refused (a :class:`emapg.errors.UserError`, exit 2) naming how many of each
  dataset, a few of them and the flag; nothing is written;
* with ``--score-trained-apart``: they are evaluated, but kept out of the per-dataset metrics and the average
  and reported apart (``results.json`` ``trained_on``, a section of ``report.md``); ``contamination.excluded_ids``
  names them, so a paired before/after comparison (:mod:`eval.learning`) leaves them out too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from emapg.errors import UserError
from tasks.contamination import TRAINED_QUESTIONS, TrainedQuestions, read_trained_questions

FLAG = "--score-trained-apart"
_EXAMPLES_SHOWN = 3


@dataclass
class ContaminationCheck:
    """The outcome of :func:`check_contamination` for one evaluation run."""

    record_file: Path | None  # the trained_questions.json read; None: the model folder has none
    record: TrainedQuestions | None
    trained_ids: dict[str, set[str]] = field(default_factory=dict)  # dataset -> ids of trained-on questions
    unchecked_because: str | None = None  # why no record was read (None when one was)

    @property
    def excluded(self) -> dict[str, int]:
        return {ds: len(ids) for ds, ids in self.trained_ids.items() if ids}

    def summary(self) -> dict[str, Any]:
        """``results.json``'s ``contamination`` section."""
        return {"checked": self.record is not None, "unchecked_because": self.unchecked_because,
                "trained_questions_file": str(self.record_file) if self.record_file is not None else None,
                "trained_questions_count": self.record.count if self.record is not None else None,
                "trained_questions_digest": self.record.digest if self.record is not None else None,
                "excluded": self.excluded,
                "excluded_ids": {ds: sorted(ids) for ds, ids in self.trained_ids.items() if ids}}

    def split(self, dataset: str, records: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """A dataset's item records as (not trained on, trained on)."""
        ids = self.trained_ids.get(dataset, set())
        return [r for r in records if r["id"] not in ids], [r for r in records if r["id"] in ids]


def check_contamination(model_path: str | None, examples: Mapping[str, Sequence[Any]], *, score_apart: bool,
                        model_label: str) -> ContaminationCheck:
    """Match ``examples`` (dataset -> :class:`tasks.datasets.Example`) against the record beside the weights at
    ``model_path`` (a folder; anything else has no record). Refuses (:class:`UserError`) when a question was
    trained on, unless ``score_apart``; also when every question of the run was (nothing unseen is left to score)."""
    folder = Path(model_path) if model_path else None
    if folder is None or not folder.is_dir():
        return ContaminationCheck(None, None, unchecked_because=f"the model {model_label} is not a local folder (a hub "
                                  "name, or a name only the engine knows), so no trained_questions.json can be read")
    record = read_trained_questions(folder)
    if record is None:
        return ContaminationCheck(None, None, unchecked_because=f"the model's folder has no {TRAINED_QUESTIONS} (a model "
                                  "not trained by emapg, or trained before it recorded its questions)")
    check = ContaminationCheck(folder / TRAINED_QUESTIONS, record,
                               {ds: {ex.id for ex in exs if record.contains(ex.question)} for ds, exs in examples.items()})
    excluded = check.excluded
    if not excluded:
        return check
    per_ds = ", ".join(f"{ds}: {n} of {len(examples[ds])}" for ds, n in excluded.items())
    shown = [ex.question for ds, exs in examples.items() for ex in exs if ex.id in check.trained_ids[ds]][:_EXAMPLES_SHOWN]
    where = f"{sum(excluded.values())} question(s) the model {model_label} was trained on ({per_ds}; per {check.record_file})"
    if not score_apart:
        raise UserError(f"refusing to score {where}, e.g. {'; '.join(repr(_short(q)) for q in shown)}. Evaluate on "
                        f"questions it was not trained on, or pass {FLAG} to score them apart from the reported "
                        "metrics (results.json `trained_on`, report.md)")
    if all(len(check.trained_ids[ds]) == len(exs) for ds, exs in examples.items()):
        raise UserError(f"every question of this run is one of the {where}: nothing unseen is left to score; "
                        "evaluate on other questions")
    return check


def _short(text: str, limit: int = 80) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
