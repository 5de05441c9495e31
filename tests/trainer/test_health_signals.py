"""The text signals of a collapsing policy (trainer.health_signals) on hand-made responses, exact values."""

from __future__ import annotations

import pytest

from trainer.health_signals import (LengthDrift, avoids_answer, health_sums, non_text_share, probe_metrics,
                                    repeated_ngram_share, words)


def test_words_drop_markup_tags():
    assert words("<search> capital of France </search>\n<answer>Paris</answer>") == ["capital", "of", "France", "Paris"]


@pytest.mark.parametrize("text, n, expected", [
    ("the capital of France is Paris", 4, 0.0),  # 3 distinct 4-grams
    ("a b c d a b c d", 4, 1 / 5),  # abcd bcda cdab dabc abcd: one of five repeats
    ("go go go go go go", 2, 4 / 5),  # five bigrams, one distinct
    ("Paris paris PARIS", 1, 2 / 3),  # case-folded
    ("<search>x y</search><search>x y</search>", 2, 1 / 3),  # tags removed: x y x y -> (x y) (y x) (x y)
    ("too short", 4, 0.0),
    ("", 4, 0.0),
])
def test_repeated_ngram_share(text, n, expected):
    assert repeated_ngram_share(text, n) == expected


def test_a_loop_approaches_one():
    loop = " ".join(["I will search for it"] * 20)  # period 5 over 100 words: 97 four-grams, 5 distinct
    assert repeated_ngram_share(loop, 4) == 92 / 97


@pytest.mark.parametrize("text, expected", [
    ("<answer>Paris</answer>", 0.0),
    ('The U.S. "capital," COVID-19 in the 1990s; 3rd of Zürich and 東京.', 0.0),
    ("a1b2 Paris ĠĊx9q foo_bar", 3 / 4),
    ("x#@$y ... !!! Paris", 1 / 2),  # punctuation-only words are not counted
    ("a" * 31 + " b", 1 / 2),  # longer than MAX_WORD_CHARS
    ("— … !!", 0.0),  # nothing left to count
    ("<" * 64 + " Paris", 1 / 2),  # a symbol loop longer than MAX_WORD_CHARS is not text (a collapsed run's output)
    ("-" * 30 + " Paris", 0.0),  # a rule of 30 dashes is punctuation, not counted
    ("", 0.0),
])
def test_non_text_share(text, expected):
    assert non_text_share(text) == expected


@pytest.mark.parametrize("answer, avoids", [
    (None, True), ("", True), ("  the ", True),  # nothing left after normalisation
    ("I don't know.", True), ("Unknown", True), ("N/A", True), ("cannot be determined", True),
    ("Paris", False), ("none of them, Lyon", False), ("0", False),
])
def test_avoids_answer(answer, avoids):
    assert avoids_answer(answer) is avoids


def test_health_sums_of_a_batch():
    texts = ["<answer>Paris</answer>", "a b c d a b c d <answer>unknown</answer>", "a1b2 Paris"]
    answers = ["Paris", "unknown", None]
    assert health_sums(texts, answers) == {
        "health/responses": 3.0,
        "health/repeated_ngram_sum": 0.0 + 1 / 6 + 0.0,  # a b c d a b c d unknown: 6 four-grams, abcd repeats once
        "health/non_text_sum": 0.0 + 0.0 + 1 / 2,
        "health/no_answer": 2.0,
    }
    with pytest.raises(ValueError):
        health_sums(texts, answers[:2])


def test_length_drift_is_relative_to_the_first_steps():
    drift = LengthDrift(steps=2)
    assert drift(40.0) == 0.0  # the start is the first step alone
    assert drift(60.0) == 60 / 50 - 1  # the start is the mean of the first two: 50
    assert drift(100.0) == 1.0  # doubled
    assert drift(25.0) == -0.5  # halved; later steps never move the start
    restored = LengthDrift(steps=2)
    restored.load_state_dict(drift.state_dict())
    assert restored(75.0) == 0.5


def test_probe_flips_between_two_greedy_passes():
    first = [("Paris", True), ("Lyon", False), (None, False), ("The Louvre", True)]
    assert probe_metrics(None, first) == {"probe/accuracy": 0.5}
    second = [("paris.", True), ("Paris", True), (None, False), ("I don't know", False)]
    assert probe_metrics(first, second) == {
        "probe/accuracy": 0.5,
        "probe/flip_rate": 2 / 4,  # "Paris" -> "paris." is no flip (normalised); Lyon -> Paris and Louvre -> refusal are
        "probe/lost_rate": 1 / 4,
        "probe/gained_rate": 1 / 4,
    }
    with pytest.raises(ValueError):
        probe_metrics(first, second[:3])
