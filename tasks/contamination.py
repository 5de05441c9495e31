"""The contamination guard's record: which questions a policy was trained on.

Every ``emapg train`` checkpoint and every ``emapg sft`` output carries ``trained_questions.json``
beside its weights (in ``policy/``, the folder ``emapg eval --model`` loads): one hash per question
the run could train on. ``emapg eval`` reads it back (:func:`read_trained_questions`) and refuses to
score those questions, or scores them apart when asked (``--score-trained-apart``).

A question's identity is :func:`tasks.heldout.question_key` (SQuAD-normalised text: case,
punctuation, articles and whitespace ignored), the same rule that keeps evaluation questions out of
warm-start data; its hash is the first 16 hex digits of the key's sha256 (:func:`question_hash`).
The file lists the sorted hashes, their count, a ``digest`` (sha256 over the sorted hashes joined
by newlines: the set's identity, recorded in training provenance) and ``sources``: where the
questions came from and how many distinct questions each gave (a policy trained from another
inherits that one's record, so sources may overlap; ``count`` is the size of the union).

The file stores hashes, not text, so a checkpoint does not ship its training data; a malformed
file is an error naming the file, never silently ignored (a guard that fails open is no guard).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from emapg.atomic import write_text_atomic
from emapg.errors import UserError
from tasks.heldout import question_key

__all__ = ["TRAINED_QUESTIONS", "FORMAT_VERSION", "NORMALISATION", "TrainedQuestionsError", "TrainedQuestions",
           "question_hash", "read_trained_questions"]

TRAINED_QUESTIONS = "trained_questions.json"
FORMAT_VERSION = 1
NORMALISATION = "squad-normalised question text, sha256[:16]"
_HASH_CHARS = 16
_HEX = frozenset("0123456789abcdef")


class TrainedQuestionsError(UserError):
    """A ``trained_questions.json`` that cannot be read as a record (the message names the file)."""


def question_hash(question: str) -> str:
    """The hash of a question's identity (:func:`tasks.heldout.question_key`): sha256, 16 hex digits."""
    return hashlib.sha256(question_key(question).encode("utf-8")).hexdigest()[:_HASH_CHARS]


def _digest(hashes: Iterable[str]) -> str:
    return hashlib.sha256("\n".join(sorted(hashes)).encode("ascii")).hexdigest()


@dataclass(frozen=True)
class TrainedQuestions:
    """A set of trained-on question hashes and where they came from."""

    hashes: frozenset[str]
    sources: tuple[dict[str, Any], ...] = field(default=())  # {"source": name, "questions": distinct count}

    @classmethod
    def from_questions(cls, by_source: Mapping[str, Iterable[str]]) -> "TrainedQuestions":
        """The record of ``{source name: question texts}`` (a dataset, a file, ``"<file> (held-out loss)"``)."""
        hashes: set[str] = set()
        sources = []
        for name, questions in by_source.items():
            mine = {question_hash(q) for q in questions}
            hashes |= mine
            sources.append({"source": str(name), "questions": len(mine)})
        return cls(frozenset(hashes), tuple(sources))

    def union(self, other: "TrainedQuestions | None") -> "TrainedQuestions":
        """This record and ``other`` (e.g. the initial policy's), sources listed once each."""
        if other is None:
            return self
        sources = list(self.sources) + [s for s in other.sources if s not in self.sources]
        return TrainedQuestions(self.hashes | other.hashes, tuple(sources))

    @property
    def count(self) -> int:
        return len(self.hashes)

    @property
    def digest(self) -> str:
        return _digest(self.hashes)

    def contains(self, question: str) -> bool:
        return question_hash(question) in self.hashes

    def summary(self) -> dict[str, Any]:
        """``{count, digest}``: what provenance records (trainer_state.json, sft_record.json)."""
        return {"count": self.count, "digest": self.digest}

    def to_json(self) -> str:
        data = {"version": FORMAT_VERSION, "normalisation": NORMALISATION, "count": self.count, "digest": self.digest,
                "sources": list(self.sources), "question_hashes": sorted(self.hashes)}
        return json.dumps(data, indent=1) + "\n"

    def write(self, folder: str | Path) -> Path:
        """Write ``folder/trained_questions.json`` atomically; returns its path."""
        path = Path(folder) / TRAINED_QUESTIONS
        write_text_atomic(path, self.to_json())
        return path


def read_trained_questions(folder: str | Path) -> TrainedQuestions | None:
    """The record in ``folder/trained_questions.json``; None when the folder has none.

    Raises :class:`TrainedQuestionsError` when the file exists but is not a valid record (unreadable,
    another version or normalisation, a malformed hash, or a count or digest that does not match the hashes).
    """
    path = Path(folder) / TRAINED_QUESTIONS
    if not path.is_file():
        return None

    def bad(why: str) -> TrainedQuestionsError:
        return TrainedQuestionsError(f"{path}: not a valid trained-questions record ({why}); the contamination guard "
                                     "cannot check this model -- restore the file from the run that wrote it")

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise bad(f"{type(e).__name__}: {e}") from None
    if not isinstance(data, dict):
        raise bad("not a JSON object")
    if data.get("version") != FORMAT_VERSION:
        raise bad(f"version {data.get('version')!r}, this code reads {FORMAT_VERSION}")
    if data.get("normalisation") != NORMALISATION:
        raise bad(f"normalisation {data.get('normalisation')!r}, this code uses {NORMALISATION!r}")
    hashes = data.get("question_hashes")
    if not isinstance(hashes, list) or not all(isinstance(h, str) and len(h) == _HASH_CHARS and set(h) <= _HEX
                                               for h in hashes):
        raise bad(f"'question_hashes' must be a list of {_HASH_CHARS}-hex-digit strings")
    unique = frozenset(hashes)
    if len(unique) != len(hashes) or data.get("count") != len(unique):
        raise bad(f"'count' is {data.get('count')!r} but the file lists {len(hashes)} hashes ({len(unique)} distinct)")
    if data.get("digest") != _digest(unique):
        raise bad("'digest' does not match the listed hashes")
    sources = data.get("sources", [])
    if not isinstance(sources, list) or not all(isinstance(s, dict) and isinstance(s.get("source"), str)
                                                and isinstance(s.get("questions"), int) for s in sources):
        raise bad("'sources' must be a list of {\"source\": name, \"questions\": count}")
    return TrainedQuestions(unique, tuple(sources))
