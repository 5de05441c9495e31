"""What "an evaluation question" means, for every path that must keep them out of training data.

Warm-start trajectories (:mod:`trainer.sft_data`) and the RL training mix
(:mod:`provision.training_mix`) both drop a training question when its key -- SQuAD-normalised
text -- equals the key of a question in a bundled evaluation (test) split. One rule, here, so the
two can never disagree about what is held out.
"""

from __future__ import annotations

from collections.abc import Iterable

from tasks.datasets import REGISTRY, load_dataset
from tasks.qa import normalize_answer


def question_key(question: str) -> str:
    """The identity of a question for the overlap check: its SQuAD-normalised text (case, punctuation,
    articles and whitespace ignored)."""
    return normalize_answer(question)


def qa_eval_sets() -> tuple[str, ...]:
    """Every registered QA dataset with a bundled test split."""
    return tuple(name for name, info in REGISTRY.items() if info.task == "qa" and "test" in info.files)


def evaluation_questions(datasets: Iterable[str] | None = None) -> dict[str, str]:
    """Question key -> the first evaluation set (of ``datasets``; default :func:`qa_eval_sets`) whose
    whole test split contains it."""
    found: dict[str, str] = {}
    for name in qa_eval_sets() if datasets is None else datasets:
        for ex in load_dataset(name, split="test"):
            found.setdefault(question_key(ex.question), name)
    return found
