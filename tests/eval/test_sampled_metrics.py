"""Sampled scoring (issue #41's instrument): mean@k exact match and token F1, pass@k, paired across two evaluations
and restricted to a slice; every number below is computed by hand."""

import json

import pytest

from eval.learning import compare_sampled, paired_items, question_score
from tasks.passk import pass_at_k
from tasks.task import get_task


def _sample(text: str, golds: list[str]) -> dict:
    """A real QA sample record: the task's own scores of ``text``, plus the rollout facts item_scores reads."""
    (scored,) = get_task("qa").sample_scores([text], [golds], [[]])
    return {**scored, "stop_reason": "answer", "searches": 1, "turns": 2, "response_tokens": 10, "search_failures": 0}


def _record(qid: str, golds: list[str], answers: list[str]) -> dict:
    samples = [_sample(f"<answer>{a}</answer>", golds) for a in answers]
    return {"id": qid, "golds": golds, "scores": get_task("qa").item_scores(samples), "samples": samples}


def test_item_scores_are_the_mean_over_samples_and_pass_at_k_counts_exact_matches():
    r = _record("q", ["Paris"], ["Paris", "paris.", "Lyon", "the city of Paris"])
    # EM per sample: 1, 1, 0, 0 -> mean@4 0.5; F1: 1, 1, 0, 2*(1/3*1)/(1/3+1) = 0.5 -> mean 0.625
    assert r["scores"]["em"] == pytest.approx(0.5)
    assert r["scores"]["f1"] == pytest.approx((1 + 1 + 0 + 0.5) / 4)
    assert r["scores"]["n_correct"] == 2 and r["scores"]["n_samples"] == 4
    assert question_score(r, "pass") == 1.0 and question_score(r, "em") == 0.5
    wrong = _record("w", ["Paris"], ["Lyon"] * 4)
    assert question_score(wrong, "pass") == 0.0


def test_aggregate_reports_pass_at_k_only_with_several_samples():
    task = get_task("qa")
    recs = [_record("a", ["x"], ["x", "y", "y", "y"]), _record("b", ["x"], ["y"] * 4), _record("c", ["x"], ["x"] * 4)]
    agg = task.aggregate(recs, 4)
    # pass@2 per question: 1 - C(4-c, 2)/C(4, 2): c=1 -> 1 - 3/6 = 0.5; c=0 -> 0; c=4 -> 1
    assert agg["pass@2"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert agg["pass@4"] == pytest.approx((1 + 0 + 1) / 3)
    assert agg["pass@2"] == pytest.approx(sum(pass_at_k(4, c, 2) for c in (1, 0, 4)) / 3)
    assert agg["em"] == pytest.approx((0.25 + 0 + 1) / 3)
    assert task.metric_names(4)[:2] == ["em", "f1"] and "pass@4" in task.metric_names(4)
    assert "pass@2" not in task.aggregate(recs[:1], 1) and "pass@1" not in task.metric_names(1)


def _write(root, name, records_by_ds):
    items = root / name / "items"
    items.mkdir(parents=True)
    for ds, recs in records_by_ds.items():
        (items / f"{ds}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return root / name


def test_compare_sampled_pairs_mean_em_f1_and_pass_and_restricts_to_a_slice(tmp_path):
    base = _write(tmp_path, "base", {"nq": [_record("1", ["a"], ["a", "b"]), _record("2", ["a"], ["b", "b"]),
                                            _record("3", ["a"], ["a", "a"])],
                                     "popqa": [_record("4", ["a"], ["b", "b"])]})
    trained = _write(tmp_path, "trained", {"nq": [_record("1", ["a"], ["a", "a"]), _record("2", ["a"], ["a", "b"]),
                                                  _record("3", ["a"], ["a", "b"])],
                                           "popqa": [_record("4", ["a"], ["a", "a"])]})
    cmp = compare_sampled(base, trained, ["nq", "popqa"], resamples=2000)
    # mean@2 EM per question: base 0.5, 0, 1, 0 -> 37.5%; trained 1, 0.5, 0.5, 1 -> 75%
    assert cmp["mean_em"]["pooled"]["base"] == pytest.approx(37.5) and cmp["mean_em"]["pooled"]["trained"] == pytest.approx(75.0)
    assert cmp["mean_em"]["pooled"]["difference"]["mean"] == pytest.approx(37.5)
    # pass@2 per question: base 1, 0, 1, 0 -> 50%; trained 1, 1, 1, 1 -> 100%
    assert cmp["pass"]["pooled"]["base"] == pytest.approx(50.0) and cmp["pass"]["pooled"]["trained"] == pytest.approx(100.0)
    assert cmp["mean_f1"]["pooled"]["base"] == pytest.approx(37.5)  # single-token answers: F1 = EM
    assert cmp["samples"] == {"base": 2, "trained": 2}
    # the slice: only nq questions 1 and 2 (popqa has none in it and is left out)
    sliced = compare_sampled(base, trained, ["nq", "popqa"], only={"nq": ["1", "2"]}, resamples=2000)
    assert sliced["mean_em"]["pooled"]["n"] == 2 and set(sliced["mean_em"]["datasets"]) == {"nq"}
    assert sliced["mean_em"]["pooled"]["base"] == pytest.approx(25.0) and sliced["mean_em"]["pooled"]["trained"] == pytest.approx(75.0)
    with pytest.raises(ValueError, match="not evaluated"):
        paired_items(base, trained, ["nq"], only={"nq": ["1", "99"]})


@pytest.mark.parametrize("where", ["results.json", "run.json"])
def test_the_sampling_protocol_names_a_recorded_slice_so_other_questions_do_not_pair(tmp_path, where):
    """Two runs answer alike but compare like for like only on the same questions: a run restricted to a recorded
    slice (``emapg eval --slice``) says so; ``none`` (every question) and an older record without the key say nothing."""
    from eval.learning import sampling_protocol

    greedy = {"n": 1, "temperature": 0.0, "top_p": 1.0}
    sampled = {"n": 2, "temperature": 1.0, "top_p": 1.0}
    cases = [(greedy, "search", "greedy, search slice"), (greedy, "none", "greedy"), (greedy, None, "greedy"),
             (sampled, "reader", "sampled mean@2 (T=1, top_p=1), reader slice"), (sampled, "none", "sampled mean@2 (T=1, top_p=1)")]
    for i, (protocol, slice_name, expected) in enumerate(cases):
        record = {"protocol": protocol, **({"slice": slice_name} if slice_name is not None else {})}
        run = tmp_path / f"run{i}"
        run.mkdir()
        (run / where).write_text(json.dumps(record if where == "results.json" else {"fingerprint": record}))
        assert sampling_protocol(run) == expected
