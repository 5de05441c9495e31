"""The reader slice: the held-out questions whose gold answer the shipped starter is shown when it answers greedily.

Small-compute RL first teaches the policy to *read* what it retrieved (to pick the answer out of the passages), so
learning shows first on questions where the evidence reaches the model. The slice is fixed in the repository
(``data/qa/reader_slice.json``) **before** any RL run, from one greedy evaluation of the starter on the whole
recorded held-out split (``data/qa/heldout.json``, 100 questions per QA set), by :data:`RULE`, with the starter's
digest and the evaluation protocol; it is rebuilt only with the starter (``scripts/build_reader_slice.py``).
Evaluations then report the slice and the whole split side by side (:func:`eval.learning.compare_sampled` with
``only=``).

The file records, for every held-out question, the starter's greedy searches' retrieved passage ids and whether it
is in the slice, so the rule can be recomputed from the record (:func:`shown_text` rebuilds the observation the
rollout showed: Search-R1 passage format, the protocol's observation budget, then decoded as the scorer reads it).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from emapg.paths import DATA_DIR

READER_SLICE_FILE = DATA_DIR / "qa" / "reader_slice.json"

#: The rule, as recorded in the file.
RULE = ("a held-out question is in the reader slice when, in the shipped starter's greedy evaluation (protocol "
        "qa_quick: 2 turns, 64 tokens per turn, top-3 passages, 256-token observations), a gold answer occurs "
        "(SQuAD-normalised, tasks.qa.retrieval_recall) in the text of the passages it was shown")


@dataclass(frozen=True)
class ReaderSlice:
    """The recorded slice: question ids per dataset, and what it was built from."""

    ids: dict[str, list[str]]
    questions: dict[str, list[dict[str, Any]]]  # per dataset: {id, retrieved_ids, in_slice} of every held-out question
    starter: str
    starter_digest: str
    protocol: dict[str, Any]

    @property
    def size(self) -> int:
        return sum(len(v) for v in self.ids.values())


def starter_digest() -> str:
    """sha256 of the shipped starter's adapter weights (what a rebuilt starter changes)."""
    from emapg.digest import file_digest
    from emapg.models import STARTER_ADAPTER

    return file_digest(STARTER_ADAPTER / "adapter_model.safetensors")


def load_reader_slice(path: str | Path = READER_SLICE_FILE) -> ReaderSlice:
    """The recorded reader slice (:data:`READER_SLICE_FILE`)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no reader slice recorded (python scripts/build_reader_slice.py builds it)")
    data = json.loads(path.read_text())
    return ReaderSlice(ids={ds: list(v) for ds, v in data["ids"].items()}, questions=data["questions"],
                       starter=data["starter"], starter_digest=data["starter_digest"], protocol=data["protocol"])


def shown_text(passages_per_search: Sequence[Sequence[str]], tokenizer: Any, max_obs_tokens: int) -> list[str]:
    """The observation text a search rollout showed for each search, as the scorer reads it
    (:func:`eval.scoring.observation_texts`): ``passages_per_search[i]`` are the i-th search's passage contents
    (``"Title"\\ntext``) in rank order."""
    from agent.actions import format_passages, information_text, observation_ids

    out = []
    for passages in passages_per_search:
        text = information_text(format_passages([{"contents": c} for c in passages]))
        ids, _ = observation_ids(tokenizer, text, max_obs_tokens)
        out.append(tokenizer.decode(ids, skip_special_tokens=True))
    return out


def in_slice(passages_per_search: Sequence[Sequence[str]], golds: Iterable[str], tokenizer: Any, max_obs_tokens: int) -> bool:
    """:data:`RULE` for one question: a gold answer occurs in the text its greedy searches showed."""
    from tasks.qa import retrieval_recall

    return retrieval_recall(shown_text(passages_per_search, tokenizer, max_obs_tokens), list(golds)) > 0


def slice_from_eval(eval_dir: str | Path, datasets: Sequence[str], *, protocol: dict[str, Any], starter: str) -> dict[str, Any]:
    """The file's content from a greedy evaluation of the starter on the held-out split (its ``items/*.jsonl``):
    a question is in the slice when its first (greedy) sample's ``retrieval_recall`` is above zero."""
    from eval.items import read_items
    from eval.learning import _greedy_sample

    ids: dict[str, list[str]] = {}
    questions: dict[str, list[dict[str, Any]]] = {}
    for ds in datasets:
        rows = []
        for r in sorted(read_items(Path(eval_dir), ds), key=lambda r: r["id"]):
            sample, scores = _greedy_sample(r)
            rows.append({"id": r["id"], "retrieved_ids": sample.get("retrieved_ids", []), "queries": sample.get("queries", []),
                         "em": float(scores["em"]), "in_slice": float(scores.get("retrieval_recall", 0.0)) > 0})
        questions[ds] = rows
        ids[ds] = [q["id"] for q in rows if q["in_slice"]]
    return {"rule": RULE, "starter": starter, "starter_digest": starter_digest(), "protocol": protocol,
            "size": sum(len(v) for v in ids.values()), "heldout_questions": sum(len(v) for v in questions.values()),
            "ids": ids, "questions": questions}


def evaluated_in_slice(run_dir: str | Path, datasets: Sequence[str], reader: ReaderSlice) -> dict[str, list[Any]]:
    """Per dataset, the ids of the questions ``run_dir`` evaluated (its ``items/*.jsonl``) that are in the slice:
    what a comparison of a run on a sample of the held-out split can restrict itself to (every dataset is a key;
    an empty list where none of its questions is in the slice)."""
    from eval.items import read_items

    out: dict[str, list[str]] = {}
    for ds in datasets:
        wanted = {str(i) for i in reader.ids.get(ds, ())}
        out[ds] = sorted((r["id"] for r in read_items(Path(run_dir), ds) if str(r["id"]) in wanted), key=str)
    return out
