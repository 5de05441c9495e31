"""A training run's provenance, saved in every checkpoint's ``trainer_state.json`` (``provenance``).

``retriever_fingerprints``: the index fingerprint each retriever URL serves (:mod:`retriever.fingerprint`,
read from ``GET /health`` at every save, so a server swapped to another index mid-run shows); and the
protocol card (:func:`provision.provenance.protocol_card`): the rollout settings (sampling, max turns,
top-k, budgets), the template's hash, the training data's file hash and the hash of its examples,
the initial policy's hash and package versions; ``trained_questions`` ({count, digest}): the questions the
run can train on (:func:`trained_questions`, written in full as ``trained_questions.json`` beside the weights).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from emapg.config import to_dict
from provision.provenance import dataset_card, model_card, protocol_card
from tasks.contamination import TRAINED_QUESTIONS, TrainedQuestions, read_trained_questions

__all__ = ["train_provenance", "refreshed", "trained_questions"]


def train_provenance(cfg: Any, retriever: Any, examples: list[Any], model_path: str) -> dict[str, Any]:
    """The provenance of a run of ``cfg`` (a :class:`trainer.config.TrainConfig`) over ``examples``."""
    from agent.rollout import RolloutConfig

    r = cfg.rollout
    agent_fields = {k: v for k, v in to_dict(r).items() if k in RolloutConfig.__dataclass_fields__}
    train = Path(cfg.data.train).expanduser()
    data = dataset_card(cfg.data.train, examples, split=cfg.data.split, path=str(train) if train.is_file() else None)
    card = protocol_card({**agent_fields, "seed": cfg.run.seed}, template=r.template_name,
                         datasets={cfg.data.train: data}, model=model_card(cfg.model.policy, model_path))
    return refreshed({"protocol_card": card}, retriever)


def trained_questions(cfg: Any, examples: list[Any], model_path: str) -> TrainedQuestions:
    """Every question (math: problem) the run of ``cfg`` can sample -- all of ``examples``, its training set --
    united with the record of the initial policy at ``model_path`` when that folder has one (an RL run from an
    SFT'd policy inherits its warm-start questions; a resumed run its own)."""
    train = Path(cfg.data.train).expanduser()
    source = train.name if train.is_file() else f"{cfg.data.train} ({cfg.data.split})"
    mine = TrainedQuestions.from_questions({source: (ex.question for ex in examples)})
    initial = Path(model_path)
    return mine.union(read_trained_questions(initial) if initial.is_dir() else None)


def record_files(record: TrainedQuestions) -> dict[str, str]:
    """Files saved with every checkpoint: the trained-questions ``record`` in ``policy/`` (what ``emapg eval --model``
    loads) and in the checkpoint folder."""
    text = record.to_json()
    return {TRAINED_QUESTIONS: text, f"policy/{TRAINED_QUESTIONS}": text}


def refreshed(provenance: dict[str, Any], retriever: Any) -> dict[str, Any]:
    """``provenance`` with the retriever's per-URL fingerprints read now (none for the math task)."""
    return {**provenance, "retriever_fingerprints": retriever.fingerprints() if retriever is not None else {}}
