"""studies/search_learning.py: its per-question search records, the searched-again rate and the seed-level estimates,
on item records in the shape ``emapg eval`` writes (``items/<dataset>.jsonl``), and its --quick run end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from eval.items import append_items, items_file  # noqa: E402
from studies import search_learning as sl  # noqa: E402


def _sample(em: float, gold_flags: list[bool]) -> dict:
    return {"response": "", "stop_reason": "answer", "turns": len(gold_flags) + 1, "searches": len(gold_flags), "queries": [],
            "retrieved_ids": [], "search_failures": 0, "invalid_actions": 0, "prediction": "x", "error": None,
            "scores": {"em": em, "f1": em}, "search_gold": gold_flags}


def _eval_dir(tmp: Path, name: str, questions: dict[str, list[tuple[float, list[bool]]]]) -> Path:
    out = tmp / name
    records = []
    for qid, samples in questions.items():
        s = [_sample(em, flags) for em, flags in samples]
        records.append({"id": qid, "dataset": "hotpotqa", "question": qid, "golds": ["g"], "searches": s[0]["searches"],
                        "scores": {"em": sum(x["scores"]["em"] for x in s) / len(s), "f1": 0.0}, "samples": s})
    items_file(out, "hotpotqa").parent.mkdir(parents=True, exist_ok=True)
    append_items(out, "hotpotqa", records)
    return out


def test_search_scores_count_misses_and_second_searches(tmp_path):
    d = _eval_dir(tmp_path, "a", {
        "q1": [(1.0, [False, True]), (0.0, [False]), (0.0, [True]), (0.0, [])],  # 2 missed at first, 1 searched again
        "q2": [(0.0, [True, False])],  # first showed the gold; a second search that did not
    })  # fmt: skip
    s = sl.search_scores(d)
    assert s["em"] == {"hotpotqa/q1": 0.25, "hotpotqa/q2": 0.0}
    assert s["first_missed"] == {"hotpotqa/q1": 2.0, "hotpotqa/q2": 0.0}
    assert s["searched_again"] == {"hotpotqa/q1": 1.0, "hotpotqa/q2": 0.0}
    assert s["second"] == {"hotpotqa/q1": 1.0, "hotpotqa/q2": 1.0} and s["second_gold"] == {"hotpotqa/q1": 1.0, "hotpotqa/q2": 0.0}
    assert s["searches"] == {"hotpotqa/q1": 1.0, "hotpotqa/q2": 2.0}
    assert sl.pooled_rate(s, "searched_again", "first_missed") == 50.0 and sl.pooled_rate(s, "second_gold", "second") == 50.0
    # the rate is compared only on questions every record missed at least once
    rates, common = sl.again_rates([s, s])
    assert common == ["hotpotqa/q1"] and rates == [{"hotpotqa/q1": 0.5}, {"hotpotqa/q1": 0.5}]


def _run(search: dict, reader: dict) -> dict:
    return {"steps": 2, "train_steps": [1, 2], "train_reward": [0.1, 0.2], "informative_frac": [0.5, 0.5],
            "per_question": {"search": search, "reader_greedy": reader}}


def test_summarise_estimates_match_hand_computed(tmp_path):
    miss = [False]
    again = [False, True]
    start = sl.search_scores(_eval_dir(tmp_path, "start", {f"q{i}": [(0.0, miss)] * 2 for i in range(4)}))
    # seed 0 answers q0 and q1 (both samples) after searching again; seed 1 answers q0 only
    s0 = sl.search_scores(_eval_dir(tmp_path, "s0", {"q0": [(1.0, again)] * 2, "q1": [(1.0, again)] * 2, "q2": [(0.0, miss)] * 2,
                                                      "q3": [(0.0, miss)] * 2}))
    s1 = sl.search_scores(_eval_dir(tmp_path, "s1", {"q0": [(1.0, again)] * 2, "q1": [(0.0, miss)] * 2, "q2": [(0.0, miss)] * 2,
                                                      "q3": [(0.0, miss)] * 2}))
    reader = {"r/a": 1.0, "r/b": 0.0}
    report = {"runs": {"emapg": {"0": _run(s0, reader), "1": _run(s1, {"r/a": 1.0, "r/b": 1.0})}},
              "starter": {"search_a": start, "search_b": start, "reader_greedy": reader}}
    out = sl.summarise(report, ["emapg"], complete=True)
    b = out["emapg"]
    assert out["search_questions"] == 4 and out["search_sampled_em_start_seed_a"] == 0.0
    assert b["search_sampled_em_end_per_seed"] == [50.0, 25.0] and b["search_sampled_em_end"] == 37.5
    assert b["search_sampled_end_minus_start"]["mean"] == pytest.approx(37.5)
    low, high = b["search_sampled_end_minus_start_seed_ci"]
    assert low <= 37.5 <= high and b["search_sampled_end_minus_start_seed_level"]["per_seed"] == pytest.approx([50.0, 25.0])
    # searched again: start 0% on every question; seed 0 searched again on 2 of 4 questions' misses, seed 1 on 1 of 4
    assert b["searched_again_questions"] == 4 and b["searched_again_rate_start"] == 0.0
    assert b["searched_again_rate_end"] == pytest.approx(37.5) and b["searched_again_rate_end_per_seed"] == [50.0, 25.0]
    assert b["reader_greedy_em_end"] == 75.0 and out["reader_greedy_em_start"] == 50.0


@pytest.mark.slow
def test_search_learning_quick(tmp_path):
    out = tmp_path / "search_learning.json"
    proc = subprocess.run([sys.executable, str(REPO / "studies" / "search_learning.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=1500, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["provenance"]["allowed_by"] == "quick" and report["complete"] is True
    assert report["rollout"]["max_turns"] == sl.MAX_TURNS and report["train_set"] == sl.TRAIN_SET
    assert set(report["runs"]) == {"grpo", "emapg", "control"} and report["search_questions"] == 2
    for arm in ("grpo", "emapg", "control"):
        assert {"seeds", "search_sampled_em_start", "search_sampled_em_end", "search_sampled_end_minus_start_seed_ci"} <= set(report[arm])
    assert Path(report["plot"]).is_file()


def test_contract_file_refuses_other_settings(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "studies" / "search_learning.py"), "--seeds", "0", "1"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and "holds the protocol's run" in proc.stderr
