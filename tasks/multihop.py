"""Multi-hop questions whose supporting paragraphs are known: what a second search can look for.

``data/qa/multihop/questions.jsonl`` (written by ``scripts/build_search_data.py`` from ``../shared/data``) holds
the multi-hop questions whose supporting paragraphs are in the bundled corpus:

* HotpotQA dev questions of RPT's three files (bridge and comparison), with their two supporting titles
  (``source`` ``hotpotqa_rpt_dev|test|train``; ids are the bundled ``hotpotqa-dev-<row>`` ids);
* the 100 MuSiQue *train* questions of HippoRAG's sample, with their decompositions (sub-question, answer) and
  supporting titles (``musique_train``; ids ``musique-train-<id>``, no bundled evaluation set holds them);
* the corpus-aligned 2Wiki dev questions (``2wiki_aligned``; the bundled ``2wikimultihopqa-dev-<row>`` ids; the
  matched title only, no second hop known).

Each row: ``id``, ``question``, ``golden_answers``, ``source``, ``type`` (``bridge``/``comparison``, ``2hop``...,
``2wiki``), ``support_titles`` and ``decomposition`` (``[{"question", "answer"}]``, MuSiQue only).
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from emapg.paths import DATA_DIR
from tasks.datasets import DatasetError

MULTIHOP_FILE = DATA_DIR / "qa" / "multihop" / "questions.jsonl"


@dataclass(frozen=True)
class MultiHopQuestion:
    """One question and what is known about the paragraphs that answer it."""

    id: str
    question: str
    answers: list[str]
    source: str
    type: str
    support_titles: list[str] = field(default_factory=list)
    decomposition: list[dict[str, str]] = field(default_factory=list)  # [{"question", "answer"}], "#1" = hop 1's answer

    def to_row(self) -> dict:
        return {"id": self.id, "question": self.question, "golden_answers": self.answers, "source": self.source,
                "type": self.type, "support_titles": self.support_titles, "decomposition": self.decomposition}


def from_row(row: dict, where: str = "") -> MultiHopQuestion:
    """A row of a multi-hop file (``id``, ``question``, ``golden_answers`` required; the rest optional)."""
    try:
        answers = row["golden_answers"]
        return MultiHopQuestion(str(row["id"]), str(row["question"]).strip(),
                                [answers] if isinstance(answers, str) else [str(a) for a in answers],
                                str(row.get("source", "")), str(row.get("type", "")),
                                [str(t) for t in row.get("support_titles") or []],
                                [{"question": str(d["question"]), "answer": str(d["answer"])}
                                 for d in row.get("decomposition") or []])
    except (KeyError, TypeError) as e:
        raise DatasetError(f"{where}: a multi-hop row needs id, question and golden_answers ({e})") from None


def load_multihop(path: str | Path = MULTIHOP_FILE) -> list[MultiHopQuestion]:
    """The bundled multi-hop questions (or a user's jsonl(.gz) of the same layout)."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no multi-hop file (python scripts/build_search_data.py --shared ../shared/data)")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [from_row(json.loads(line), f"{path}:{n}") for n, line in enumerate(f, 1) if line.strip()]


_PAREN_RE = re.compile(r"\s*\([^)]*\)\s*$")


def entity_name(title: str) -> str:
    """A Wikipedia title as a name appears in text: its trailing disambiguation dropped ("X (band)" -> "X")."""
    return _PAREN_RE.sub("", title).strip()


SEARCH_SLICE_FILE = DATA_DIR / "qa" / "search_slice.json"
STARTERS_DIR = DATA_DIR / "starter"


def search_slice_ids(path: str | Path = SEARCH_SLICE_FILE) -> dict[str, list[str]]:
    """The recorded search slice's question ids per dataset ({} when none is recorded)."""
    path = Path(path)
    if not path.is_file():
        return {}
    record = json.loads(path.read_text())
    return {record["dataset"]: list(record["ids"])}


def starter_digests() -> dict[str, str]:
    """sha256 of every shipped starter's adapter weights (``data/starter/<name>/adapter_model.safetensors``)."""
    from emapg.digest import file_digest

    return {p.parent.name: file_digest(p) for p in sorted(STARTERS_DIR.glob("*/adapter_model.safetensors"))}
