"""What "a held-out question" means, for every path that must keep them out of training data.

A question's identity is its key, the SQuAD-normalised text (:func:`question_key`). Two sets of keys:

* :func:`heldout_questions` -- the fixed held-out split of every bundled QA set
  (:data:`tasks.datasets.HELDOUT_FILE`). Warm-start trajectories (:mod:`trainer.sft.data`) and the
  answerable training pool (``qa_pool``, ``scripts/build_qa_pool.py``) drop every question whose key is
  one of these, so the demo's and the benchmarks' evaluations (subsets of the held-out split) are
  untouched by training;
* :func:`evaluation_questions` -- every question of the bundled test splits (the stricter rule of the
  NQ + HotpotQA train mix, :mod:`provision.training_mix`).

One rule, here, so no two paths disagree about what is held out. A trained checkpoint additionally
records the questions it trained on (:mod:`tasks.contamination`), so ``emapg eval`` can refuse them.
"""

from __future__ import annotations

from collections.abc import Iterable

from tasks.datasets import QA_DATASETS, REGISTRY, load_dataset
from tasks.qa import normalize_answer
from tasks.task import QA, get_task


def question_key(question: str) -> str:
    """The identity of a question for the overlap check: its SQuAD-normalised text (case, punctuation,
    articles and whitespace ignored)."""
    return normalize_answer(question)


def qa_eval_sets() -> tuple[str, ...]:
    """Every registered QA dataset with a bundled test split."""
    return tuple(name for name, info in REGISTRY.items() if get_task(info.task) is QA and "test" in info.files)


def evaluation_questions(datasets: Iterable[str] | None = None) -> dict[str, str]:
    """Question key -> the first evaluation set (of ``datasets``; default :func:`qa_eval_sets`) whose
    whole test split contains it."""
    found: dict[str, str] = {}
    for name in qa_eval_sets() if datasets is None else datasets:
        for ex in load_dataset(name, split="test"):
            found.setdefault(question_key(ex.question), name)
    return found


def heldout_questions(datasets: Iterable[str] = QA_DATASETS) -> dict[str, str]:
    """Question key -> the QA set whose recorded held-out split, or recorded search slice
    (``data/qa/search_slice.json``, :mod:`tasks.multihop`), contains it."""
    from tasks.multihop import search_slice_ids

    datasets = list(datasets)
    found: dict[str, str] = {}
    for name in datasets:
        for ex in load_dataset(name, split="heldout"):
            found.setdefault(question_key(ex.question), name)
    for name, ids in search_slice_ids().items():
        if name in datasets:
            wanted = set(ids)
            for ex in load_dataset(name):
                if ex.id in wanted:
                    found.setdefault(question_key(ex.question), f"{name} (search slice)")
    return found
