"""benchmarks/stability.py's pieces (intervals, the summary of synthetic runs, the plot) and its --quick mode end to end."""

from __future__ import annotations

import json

import pytest

from benchmarks.stability import ARMS, CONTRACT_ARMS, GUARDED, newcombe, plot, run_record, summarise, wilson
from tests.trainer.test_guard import HEALTHY, degenerating


def test_wilson_interval_matches_published_values():
    assert wilson(0, 5) == pytest.approx([0.0, 0.4345], abs=1e-4)
    assert wilson(5, 10) == pytest.approx([0.2366, 0.7634], abs=1e-4)
    assert wilson(0, 0) == [0.0, 1.0]


def test_newcombe_difference_interval_matches_newcombe_1998():
    assert newcombe(56, 70, 48, 80) == pytest.approx([0.0524, 0.3339], abs=1e-4)  # his example, method 10


def test_the_arms_are_the_two_algorithms_and_their_halves():
    assert "algorithm.kl.type=k3" in ARMS["grpo"] and "algorithm.ema.decay=1.0" in ARMS["grpo"]
    assert "algorithm.kl.type=topk_reverse" in ARMS["emapg"] and "algorithm.ema.decay=0.9" in ARMS["emapg"]
    assert "algorithm.kl.type=k3" in ARMS["ema_k3"] and "algorithm.ema.decay=0.9" in ARMS["ema_k3"]
    assert "algorithm.kl.type=topk_reverse" in ARMS["frozen_topk"] and "algorithm.ema.decay=1.0" in ARMS["frozen_topk"]
    assert set(CONTRACT_ARMS) == set(ARMS)


def test_the_protocol_is_written_in_the_docstring():
    import benchmarks.stability as st

    doc = st.__doc__
    assert "PRE-REGISTERED PROTOCOL" in doc and "Collapse" in doc and "Wilson" in doc and "sweep" in doc


def healthy_run(n: int = 12) -> list[dict[str, float]]:
    return [{**HEALTHY, "response/length_drift": 0.0} for _ in range(n)]


def test_summary_of_synthetic_runs():
    collapsing, healthy = run_record(degenerating()), run_record(healthy_run())
    assert collapsing["collapse_step"] == 8 and healthy["collapse_step"] is None  # reward 0.5 -> 0.05 from step 8
    runs = {"grpo": {0: collapsing, 1: collapsing, 2: healthy}, "emapg": {0: healthy, 1: healthy, 2: healthy},
            GUARDED: {0: collapsing}}
    s = summarise(runs)
    assert "consecutive" in s["collapse_definition"]
    assert s["grpo"]["seeds"] == [0, 1, 2] and s["grpo"]["collapse_rate"] == 2 / 3
    assert s["grpo"]["collapse_rate_ci"] == wilson(2, 3) and s["grpo"]["steps_to_collapse"] == [8, 8]
    assert s["emapg"]["collapse_rate"] == 0.0 and s["emapg"]["minus_grpo_collapse_rate_ci"] == newcombe(0, 3, 2, 3)
    signals = {x["name"]: x for x in s["signals"]}
    # the guarded arm is left out: 2 collapsed and 4 healthy runs
    assert s["runs_pooled"] == {"collapsed": 2, "healthy": 4}
    assert signals["repetition"]["median_lead_steps"] == 1 and signals["repetition"]["false_trip_rate"] == 0.0
    assert signals["reward_drop"]["median_lead_steps"] == 0  # the reward itself trips when it falls
    assert signals["kl_to_start"]["median_lead_steps"] == -1 and signals["kl_to_start"]["seen_2_ahead_frac"] == 0.0


def test_plot_draws_every_arm(tmp_path):
    from matplotlib.image import imread

    runs = {"grpo": {0: run_record(degenerating()), 1: run_record(healthy_run())}, "emapg": {0: run_record(healthy_run())}}
    img = imread(plot(runs, tmp_path / "stability.png", "synthetic"))
    assert img.shape[0] > 300 and img.shape[1] > 300


@pytest.mark.slow
def test_quick_mode_runs_to_the_end_and_writes_the_contract_keys(tmp_path):
    """The whole benchmark on tiny-qwen2 (5 arms x 2 seeds x 3 steps, the toy task): it must not fail at its end,
    where the report is put together, after hours of default-mode training."""
    import os
    import subprocess
    import sys

    from emapg.paths import REPO_ROOT

    out = tmp_path / "stability.json"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "stability.py"), "--quick", "--out", str(out),
                           "--work", str(tmp_path / "work")], capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert isinstance(report["collapse_definition"], str) and report["stress"] == {
        "lr": 1e-3, "beta": 0.001, "steps": 3, "chosen_by": "argument"}
    for arm in CONTRACT_ARMS:
        r = report[arm]
        assert r["seeds"] == [0, 1] and 0.0 <= r["collapse_rate"] <= 1.0
        assert len(r["collapse_rate_ci"]) == 2 and r["collapse_rate_ci"][0] <= r["collapse_rate"] <= r["collapse_rate_ci"][1]
    assert {s["name"] for s in report["signals"]} >= {"repetition", "gibberish", "length_drift", "kl_to_start", "reward_drop"}
    for s in report["signals"]:
        assert {"name", "median_lead_steps", "false_trip_rate"} <= set(s)
    run = report["toy"]["runs"]["emapg"]["0"]
    assert len(run["reward"]) == 3 and all(x is not None for x in run["kl_to_start"])
    assert out.with_suffix(".png").is_file()
