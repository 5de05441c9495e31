"""Paired bootstrap (checked against the exact bootstrap distribution by enumeration) and the
before/after comparison of two evaluation runs' item files."""

import itertools
import json

import numpy as np
import pytest

from eval.learning import compare_learning, learning_table, verdict
from eval.significance import bootstrap_means, paired_bootstrap


def _exact_bootstrap(diffs):
    """Every one of the n^n equally likely resamples' means (float64)."""
    n = len(diffs)
    return np.array([np.mean([diffs[i] for i in idx]) for idx in itertools.product(range(n), repeat=n)])


def test_bootstrap_matches_the_exact_resampling_distribution():
    diffs = np.array([1.0, 0.0, -1.0, 1.0, 1.0])  # n=5: 3,125 resamples enumerated
    exact = _exact_bootstrap(diffs)
    sampled = bootstrap_means(diffs, resamples=200_000, seed=1)
    assert sampled.mean() == pytest.approx(exact.mean(), abs=2e-3)
    assert sampled.var() == pytest.approx(exact.var(), rel=2e-2)
    # each attainable mean (multiples of 1/5) has the exact probability, within sampling error
    values, counts = np.unique(exact, return_counts=True)
    for v, c in zip(values, counts):
        assert np.mean(np.isclose(sampled, v)) == pytest.approx(c / len(exact), abs=4e-3)


def test_paired_interval_is_the_percentile_interval_of_the_exact_distribution():
    a = [0, 0, 1, 0, 1]
    b = [1, 0, 1, 1, 0]
    d = paired_bootstrap(a, b, resamples=100_000, seed=3)
    assert d.mean == pytest.approx(1 / 5) and d.n == 5
    exact = _exact_bootstrap(np.array(b, float) - np.array(a, float))
    lo, hi = np.quantile(exact, [0.025, 0.975])
    # attainable means are multiples of 1/5: the sampled quantiles land on the exact ones
    assert d.low == pytest.approx(lo) and d.high == pytest.approx(hi)


def test_identical_runs_and_a_constant_shift():
    same = paired_bootstrap([0, 1, 1, 0], [0, 1, 1, 0])
    assert (same.mean, same.low, same.high) == (0.0, 0.0, 0.0)
    shift = paired_bootstrap([0.0, 0.0, 0.5], [0.25, 0.25, 0.75])
    assert shift.low == pytest.approx(0.25) and shift.high == pytest.approx(0.25)
    with pytest.raises(ValueError, match="equal lengths"):
        paired_bootstrap([1], [1, 0])


def _write_run(root, name, scores):
    items = root / name / "items"
    items.mkdir(parents=True)
    for ds, values in scores.items():
        rows = [{"id": f"{ds}-{i}", "scores": {"em": em}, "samples": [{"stop_reason": "answer" if ans else "max_turns"}]}
                for i, (em, ans) in enumerate(values)]
        (items / f"{ds}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root / name


def test_compare_learning_pools_questions_and_pairs_by_id(tmp_path):
    base = _write_run(tmp_path, "base", {"nq": [(0, 1), (0, 0)], "bamboogle": [(1, 1), (0, 0), (0, 0), (0, 1)]})
    trained = _write_run(tmp_path, "trained", {"nq": [(1, 1), (0, 1)], "bamboogle": [(1, 1), (1, 1), (0, 1), (0, 1)]})
    c = compare_learning(base, trained, ["nq", "bamboogle"], resamples=2000)
    assert c["datasets"]["nq"]["base"] == 0.0 and c["datasets"]["nq"]["trained"] == 50.0
    assert c["pooled"]["n"] == 6
    assert c["pooled"]["base"] == pytest.approx(100 / 6) and c["pooled"]["trained"] == pytest.approx(50.0)
    assert c["pooled"]["difference"]["mean"] == pytest.approx(100 * 2 / 6)
    assert c["pooled"]["format_rate"] == {"base": 50.0, "trained": 100.0}
    table = learning_table(c)
    assert "| nq | 2 | 0.0 | 50.0 | +50.0 [" in table and "| **pooled** | **6** |" in table
    assert "interval" in verdict(c["pooled"]["difference"])


def test_compare_learning_refuses_different_questions(tmp_path):
    base = _write_run(tmp_path, "base", {"nq": [(0, 1), (0, 0)]})
    trained = _write_run(tmp_path, "trained", {"nq": [(1, 1)]})
    with pytest.raises(ValueError, match="different questions"):
        compare_learning(base, trained, ["nq"])


def test_miss_breakdown_counts_each_questions_greedy_answer(tmp_path):
    """Right / wrong with the gold shown / wrong without it, from each question's first sample; searches counted."""
    from eval.learning import miss_breakdown

    def sample(em, shown, searches):
        return {"scores": {"em": em, "retrieval_recall": shown}, "searches": searches}

    rows = {"nq": [[sample(1.0, 1.0, 1)], [sample(0.0, 1.0, 1), sample(1.0, 1.0, 1)], [sample(0.0, 0.0, 2)]],
            "bamboogle": [[sample(0.0, 0.0, 1)], [sample(0.0, 1.0, 0)]]}
    items = tmp_path / "run" / "items"
    items.mkdir(parents=True)
    for ds, questions in rows.items():
        lines = [json.dumps({"id": f"{ds}-{i}", "scores": {"em": 0.5}, "samples": s}) + "\n" for i, s in enumerate(questions)]
        (items / f"{ds}.jsonl").write_text("".join(lines))
    b = miss_breakdown(tmp_path / "run", ["nq", "bamboogle"])
    # nq-1's second sample is right, but the greedy (first) one is the answer that counts
    assert (b.questions, b.right, b.wrong_shown, b.wrong_not_shown) == (5, 1, 2, 2)
    assert b.searches == {0: 1, 1: 3, 2: 1}
    line = b.lines("starter")[0]
    assert "1 right (20.0%)" in line and "**2 wrong although a gold answer was in the passages shown** (40.0%)" in line
    assert "0 searches: 1, 1 search: 3, 2 searches: 1" in line


def test_question_kind_tells_yes_no_options_named_in_the_question_and_open_questions():
    from eval.learning import question_kind

    assert question_kind("Are both films from the same country?", ["Yes"]) == "yes/no"
    assert question_kind("Which film came first, Once A Gentleman or The Girl In White?", ["Once a gentleman"]) == "option in question"
    # whole words only, after SQuAD normalisation: "Art" is not named in "Who painted Arthur's portrait?"
    assert question_kind("Who painted Arthur's portrait?", ["Art"]) == "open"
    assert question_kind("Where does US highway 1 start?", ["Key West, Florida", ""]) == "open"


def test_answer_changes_counts_transitions_changed_answers_and_kinds(tmp_path):
    """Each question's first sample is its greedy answer; an answer that changes only in case or punctuation has
    not changed, nor has no answer twice; questions either run scored apart as trained on are left out."""
    from eval.learning import answer_changes

    def write(name, answers, excluded=()):
        items = tmp_path / name / "items"
        items.mkdir(parents=True)
        rows = []
        for i, (question, golds, prediction, em) in enumerate(answers):
            rows.append({"id": f"nq-{i}", "question": question, "golds": golds, "scores": {"em": 0.5},
                         "samples": [{"prediction": prediction, "scores": {"em": em}}, {"prediction": "x", "scores": {"em": 1.0}}]})
        (items / "nq.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tmp_path / name / "results.json").write_text(json.dumps({"contamination": {"excluded_ids": {"nq": list(excluded)}}}))
        return tmp_path / name

    qs = [("Ulm or Bonn, which is older?", ["Ulm"]), ("Same country?", ["yes"]), ("Who wrote it?", ["Woody Allen"]),
          ("Capital?", ["Amqui"]), ("Year?", ["1999"]), ("Trained on?", ["z"])]
    base = write("base", [(*qs[0], "Ulm", 1.0), (*qs[1], "yes", 1.0), (*qs[2], "Woody Allen", 1.0), (*qs[3], "Paris", 0.0),
                          (*qs[4], None, 0.0), (*qs[5], "z", 1.0)])
    trained = write("trained", [(*qs[0], "Bonn", 0.0), (*qs[1], "Yes.", 1.0), (*qs[2], "Woody Allen", 1.0),
                                (*qs[3], "Amqui", 1.0), (*qs[4], None, 0.0), (*qs[5], "y", 0.0)], excluded=["nq-5"])
    c = answer_changes(base, trained, ["nq"])
    assert (c.questions, c.changed, c.kept_right, c.lost, c.gained, c.kept_wrong) == (5, 2, 2, 1, 1, 1)
    assert c.by_kind == {"yes/no": {"questions": 1, "start_right": 1, "trained_right": 1, "lost": 0, "gained": 0},
                         "option in question": {"questions": 1, "start_right": 1, "trained_right": 0, "lost": 1, "gained": 0},
                         "open": {"questions": 3, "start_right": 1, "trained_right": 2, "lost": 0, "gained": 1}}
    assert "changed on 2 of 5 questions: 1 wrong → right, 1 right → wrong" in c.lines()[0]
    assert "option in question: 1 questions, right 1 → 0 (lost 1, gained 0)" in c.lines()[1]
