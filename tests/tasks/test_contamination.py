"""The trained-questions record (tasks.contamination): identity, round trip, stable digest, malformed files refused."""

from __future__ import annotations

import hashlib
import json

import pytest

from emapg.models import RECORD_FILES
from tasks.contamination import (
    TRAINED_QUESTIONS,
    TrainedQuestions,
    TrainedQuestionsError,
    question_hash,
    read_trained_questions,
)
from tasks.heldout import question_key


def test_identity_is_the_heldout_key_and_its_hash():
    assert question_hash("Who wrote Hamlet?") == question_hash("  who wrote   the hamlet ") \
        == hashlib.sha256(question_key("Who wrote Hamlet?").encode()).hexdigest()[:16]
    assert question_hash("who wrote hamlet") != question_hash("who wrote macbeth")
    assert TRAINED_QUESTIONS in RECORD_FILES  # emapg.models copies the record when it merges an adapter


def test_round_trip_union_and_a_digest_that_depends_only_on_the_set(tmp_path):
    a = TrainedQuestions.from_questions({"nq (train)": ["Who wrote Hamlet?", "capital of France", "who wrote hamlet"]})
    assert a.count == 2 and a.sources == ({"source": "nq (train)", "questions": 2},)
    b = TrainedQuestions.from_questions({"x.jsonl": ["CAPITAL of France!", "who wrote hamlet?"]})
    assert a.digest == b.digest and a.hashes == b.hashes  # order, case, punctuation: one set, one digest
    assert a.digest == TrainedQuestions.from_questions({"s": ["capital of france", "who wrote hamlet"]}).digest
    a.write(tmp_path)
    back = read_trained_questions(tmp_path)
    assert back == a and back.contains("Capital of France?") and not back.contains("capital of Spain")
    data = json.loads((tmp_path / TRAINED_QUESTIONS).read_text())
    assert data["question_hashes"] == sorted(a.hashes) and data["count"] == 2 and data["digest"] == a.digest
    both = a.union(TrainedQuestions.from_questions({"sft": ["capital of spain"]}))
    assert both.count == 3 and [s["source"] for s in both.sources] == ["nq (train)", "sft"]
    assert a.union(a).sources == a.sources and a.union(None) is a
    assert read_trained_questions(tmp_path / "nothing-here") is None


@pytest.mark.parametrize("damage, needle", [
    (lambda d: "{not json", "JSONDecodeError"),
    (lambda d: {**d, "version": 99}, "version 99"),
    (lambda d: {**d, "normalisation": "raw text"}, "normalisation"),
    (lambda d: {**d, "question_hashes": d["question_hashes"][:1]}, "'count' is 2"),
    (lambda d: {**d, "question_hashes": ["zz" * 8, d["question_hashes"][1]]}, "hex-digit"),
    (lambda d: {**d, "digest": "0" * 64}, "'digest' does not match"),
    (lambda d: {**d, "sources": "nq"}, "'sources'"),
    (lambda d: [d], "not a JSON object"),
])
def test_a_malformed_record_is_an_error_naming_the_file(tmp_path, damage, needle):
    TrainedQuestions.from_questions({"nq": ["a question", "another question"]}).write(tmp_path)
    path = tmp_path / TRAINED_QUESTIONS
    bad = damage(json.loads(path.read_text()))
    path.write_text(bad if isinstance(bad, str) else json.dumps(bad))
    with pytest.raises(TrainedQuestionsError, match=needle) as e:
        read_trained_questions(tmp_path)
    assert str(path) in str(e.value)
