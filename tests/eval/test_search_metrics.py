"""Per-slice search metrics (eval.search_metrics) and the per-search gold flags the scorer records (eval.scoring)."""

import pytest

from eval.search_metrics import by_slice, markdown_table, search_metrics, slice_report


def sample(searches, gold, em=0.0, f1=0.0):
    return {"searches": searches, "search_gold": gold, "scores": {"em": em, "f1": f1}}  # eval.scoring's shape


RECORDS = [  # q1 in the search slice, q2 in the reader slice, q3 in neither
    {"id": "q1", "samples": [sample(2, [0, 1], 1.0, 1.0), sample(1, [0]), sample(2, [0, 0], 0.0, 0.5), sample(0, [])]},
    {"id": "q2", "samples": [sample(1, [1], 1.0, 1.0), sample(1, [1], 0.0, 0.2)]},
    {"id": "q3", "samples": [sample(3, [0, 1, 1], 0.0, 0.4)]},
]
IDS = {"search": {"q1"}, "reader": {"q2"}}


def test_search_metrics_count_by_hand():
    m = search_metrics(RECORDS[0]["samples"], 1)
    assert m["searches"] == {"0": 1, "1": 1, "2": 2} and m["searches_per_question"] == pytest.approx(5 / 4, abs=1e-4)
    # first passages lacked the gold in 3 samples (the one without a search has no first passages); 2 searched again
    assert m["first_missed"] == 3 and m["searched_again_rate"] == pytest.approx(2 / 3, abs=1e-4)
    assert m["second_searches"] == 2 and m["second_holds_gold_rate"] == pytest.approx(1 / 2, abs=1e-4)
    assert m["em"] == pytest.approx(1 / 4, abs=1e-4) and m["f1"] == pytest.approx(1.5 / 4, abs=1e-4)
    empty = search_metrics([], 0)
    assert empty["searches_per_question"] is None and empty["searched_again_rate"] is None


def test_slices_partition_the_questions():
    s = by_slice(RECORDS, IDS)
    assert [s[k]["questions"] for k in ("search", "reader", "rest", "all")] == [1, 1, 1, 3]
    assert s["reader"]["searched_again_rate"] is None and s["reader"]["em"] == pytest.approx(0.5, abs=1e-4)
    assert s["rest"]["second_holds_gold_rate"] == 1.0 and s["all"]["samples"] == 7


def test_slice_report_puts_sampled_and_greedy_side_by_side():
    greedy = [{"id": r["id"], "samples": r["samples"][:1]} for r in RECORDS]
    rep = slice_report(RECORDS, greedy, IDS)
    assert rep["search"]["sampled_em"] == pytest.approx(0.25, abs=1e-4) and rep["search"]["greedy_em"] == 1.0
    assert rep["search"]["greedy_searches_per_question"] == 2.0 and rep["search"]["searches_per_question"] == 1.25
    table = markdown_table(rep)
    assert "| search | 1 | 1.25 | 0: 1, 1: 1, 2: 2 | 66.7 (3) | 50.0 (2) | 25.0 | 37.5 | 100.0 |" in table


def test_scorer_flags_each_search_with_the_gold_shown_rule():
    from eval.scoring import search_gold
    from tasks.datasets import Example

    ex = Example("x", "Is it Quiet Harbor or Tulsa Sound?", ["Quiet Harbor", "1911"], "t", {})
    assert search_gold(["Doc 1(Title: A) built in 1911", "Quiet Harbor only"], ex) == [1, 0]  # the named option is no evidence
    assert search_gold([], ex) == []
