"""The reader slice: the held-out questions whose gold answer the shipped starter is shown when it answers greedily.

Small-compute RL first teaches the policy to *read* what it retrieved (to pick the answer out of the passages), so
learning shows first on questions where the evidence reaches the model. The slice is fixed in the repository
(``data/qa/reader_slice.json``) **before** any RL run, from one greedy evaluation of the starter on the whole
recorded held-out split (``data/qa/heldout.json``, 100 questions per QA set), by a rule of :data:`RULES` (new slices:
:data:`RULE`; the file records its own), with the starter's
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

_EVAL = ("a held-out question is in the reader slice when, in the shipped starter's greedy evaluation (protocol "
         "qa_quick: 2 turns, 64 tokens per turn, top-3 passages, 256-token observations), ")
#: The rules by name, each as a slice file records it. ``gold_in_passages`` is the recorded slice's
#: (``data/qa/reader_slice.json``, kept as recorded); ``gold_not_in_question`` (issue #54) leaves out the gold answers
#: that the question itself contains: a comparison question names its answer, so a passage naming it is no evidence.
RULES: dict[str, str] = {
    "gold_in_passages": _EVAL + "a gold answer occurs (SQuAD-normalised, tasks.qa.retrieval_recall) in the text of "
                                "the passages it was shown",
    "gold_not_in_question": _EVAL + "a gold answer that the question does not contain occurs (SQuAD-normalised, "
                                    "token-bounded, tasks.qa.gold_shown) in the text of the passages it was shown",
}
#: The rule of slices built from now on (:func:`slice_from_eval`).
RULE_NAME = "gold_not_in_question"
RULE = RULES[RULE_NAME]


def rule_name(rule: str) -> str:
    """The name of a recorded rule's text (a :data:`RULES` value)."""
    for name, text in RULES.items():
        if text == rule:
            return name
    raise ValueError(f"unknown reader-slice rule {rule[:80]!r}...; known: {', '.join(RULES)}")


@dataclass(frozen=True)
class ReaderSlice:
    """The recorded slice: question ids per dataset, and what it was built from."""

    ids: dict[str, list[str]]
    questions: dict[str, list[dict[str, Any]]]  # per dataset: {id, retrieved_ids, in_slice} of every held-out question
    starter: str
    starter_digest: str
    protocol: dict[str, Any]
    rule: str = RULES["gold_in_passages"]  # the text the file records (one of RULES)

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
                       starter=data["starter"], starter_digest=data["starter_digest"], protocol=data["protocol"],
                       rule=data["rule"])


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


def in_slice(passages_per_search: Sequence[Sequence[str]], question: str, golds: Iterable[str], tokenizer: Any,
             max_obs_tokens: int, *, rule: str = RULE_NAME) -> bool:
    """Rule ``rule`` (a :data:`RULES` name) for one question: a gold answer (``gold_not_in_question``: one the question
    does not contain) occurs in the text its greedy searches showed."""
    from tasks.qa import gold_shown, retrieval_recall

    shown = shown_text(passages_per_search, tokenizer, max_obs_tokens)
    if rule == "gold_in_passages":
        return retrieval_recall(shown, list(golds)) > 0
    if rule == "gold_not_in_question":
        return gold_shown(shown, list(golds), question) is not None
    raise ValueError(f"unknown reader-slice rule {rule!r}; known: {', '.join(RULES)}")


def corpus_passages(ids: Iterable[str], corpus: str | Path | None = None) -> dict[str, str]:
    """The contents (``"Title"\ntext``) of the passages ``ids`` in ``corpus`` (default: the bundled corpus, which the
    slice's evaluation searched); every id must be there."""
    from emapg.paths import BUNDLED_CORPUS
    from retriever.corpus import iter_corpus

    wanted = set(ids)
    found = {p.id: p.contents for p in iter_corpus(corpus or BUNDLED_CORPUS) if p.id in wanted}
    missing = wanted - set(found)
    if missing:
        raise KeyError(f"{len(missing)} passage ids are not in the corpus, e.g. {sorted(missing)[:3]}")
    return found


def slice_from_eval(eval_dir: str | Path, datasets: Sequence[str], *, protocol: dict[str, Any], starter: str,
                    tokenizer: Any, corpus: str | Path | None = None) -> dict[str, Any]:
    """The file's content from a greedy evaluation of the starter on the held-out split (its ``items/*.jsonl``):
    :data:`RULE` on each question's first (greedy) sample, recomputed from its retrieved passage ids exactly as the
    record is checked (:func:`in_slice`: the passages from ``corpus``, cut to the protocol's observation budget by
    the starter's ``tokenizer``)."""
    from eval.items import read_items
    from eval.learning import _greedy_sample

    records = {ds: sorted(read_items(Path(eval_dir), ds), key=lambda r: r["id"]) for ds in datasets}
    greedy = {ds: [(r, *_greedy_sample(r)) for r in rows] for ds, rows in records.items()}
    passages = corpus_passages({pid for rows in greedy.values() for _, s, _ in rows
                                for ids in s.get("retrieved_ids", []) for pid in ids}, corpus)
    ids: dict[str, list[str]] = {}
    questions: dict[str, list[dict[str, Any]]] = {}
    for ds, rows in greedy.items():
        out = []
        for r, sample, scores in rows:
            retrieved = sample.get("retrieved_ids", [])
            shown = in_slice([[passages[pid] for pid in search] for search in retrieved], r["question"], r["golds"],
                             tokenizer, int(protocol["max_obs_tokens"]))
            out.append({"id": r["id"], "retrieved_ids": retrieved, "queries": sample.get("queries", []),
                        "em": float(scores["em"]), "in_slice": shown})
        questions[ds] = out
        ids[ds] = [q["id"] for q in out if q["in_slice"]]
    return {"rule": RULE, "starter": starter, "starter_digest": starter_digest(), "protocol": protocol,
            "size": sum(len(v) for v in ids.values()), "heldout_questions": sum(len(v) for v in questions.values()),
            "ids": ids, "questions": questions}


def recompute(recorded: ReaderSlice, tokenizer: Any, *, rule: str, corpus: str | Path | None = None) -> dict[str, dict[str, bool]]:
    """Every recorded question's membership by ``rule`` (a :data:`RULES` name), recomputed from its recorded greedy
    searches' passages: ``{dataset: {id: in_slice}}``. The recorded file is only read."""
    from tasks.datasets import load_dataset

    wanted = {pid for rows in recorded.questions.values() for q in rows for ids in q["retrieved_ids"] for pid in ids}
    passages = corpus_passages(wanted, corpus)
    budget = int(recorded.protocol["max_obs_tokens"])
    out: dict[str, dict[str, bool]] = {}
    for ds, rows in recorded.questions.items():
        examples = {ex.id: ex for ex in load_dataset(ds, split="heldout")}
        out[ds] = {q["id"]: in_slice([[passages[pid] for pid in ids] for ids in q["retrieved_ids"]], examples[q["id"]].question,
                                     examples[q["id"]].answers, tokenizer, budget, rule=rule) for q in rows}
    return out


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
