"""The training questions of a learning run on bundled QA: NQ + HotpotQA train, no evaluation question.

The paper trains its search agent on NQ train + HotpotQA train merged (ALGORITHM.md §4.6). The
bundled copies are samples (5,000 NQ rows; 100 HotpotQA train rows + 300 rows drawn from HotpotQA
*dev*, which is also the bundled HotpotQA evaluation set). :func:`write_training_mix` merges them and
drops every question that is an evaluation question (:func:`tasks.heldout.evaluation_questions`) of a
bundled evaluation set of :data:`tasks.datasets.QA_DATASETS`, so an evaluation on those sets (any
``--limit`` sample) is held out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from emapg.atomic import write_text_atomic
from tasks.datasets import QA_DATASETS, load_dataset
from tasks.heldout import evaluation_questions, question_key

TRAIN_SOURCES: tuple[str, ...] = ("nq", "hotpotqa")


@dataclass(frozen=True)
class TrainingMix:
    """The written training file and what went into it."""

    path: Path
    kept: dict[str, int]  # source dataset -> questions kept
    dropped: dict[str, int] = field(default_factory=dict)  # source dataset -> questions dropped (in an eval set)

    @property
    def size(self) -> int:
        return sum(self.kept.values())


def write_training_mix(path: str | Path, *, sources: tuple[str, ...] = TRAIN_SOURCES,
                       held_out: tuple[str, ...] = QA_DATASETS) -> TrainingMix:
    """Write the train splits of ``sources`` (each row keeps its ``data_source``) as jsonl at ``path``,
    minus every question of the ``held_out`` evaluation sets; returns the counts."""
    exclude = evaluation_questions(held_out)
    rows, kept, dropped = [], {}, {}
    for source in sources:
        examples = load_dataset(source, split="train")
        fresh = [ex for ex in examples if question_key(ex.question) not in exclude]
        kept[source], dropped[source] = len(fresh), len(examples) - len(fresh)
        rows += [{"id": f"{source}/{ex.id}", "question": ex.question, "golden_answers": list(ex.answers),
                  "data_source": source} for ex in fresh]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return TrainingMix(path, kept, dropped)
