"""The --quick modes of the studies that have no other end-to-end test (learning_toy, async_parity, greedy_vs_sampled),
each in a subprocess as a user runs it: the study's whole code path on tiny-qwen2, through the shared harness (a smoke
run may start from an uncommitted tree, and says so in its report)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _quick(study: str, tmp_path: Path, *args: str) -> dict:
    out = tmp_path / f"{study}.json"
    proc = subprocess.run([sys.executable, str(REPO / "studies" / f"{study}.py"), "--quick", "--out", str(out), *args],
                          capture_output=True, text=True, timeout=1500, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["provenance"]["allowed_by"] == "quick" and len(report["provenance"]["commit"]) == 40
    return report


@pytest.mark.slow
def test_learning_toy_quick(tmp_path):
    report = _quick("learning_toy", tmp_path, "--steps", "2")
    assert set(report["runs"]) == {"grpo_seed0", "emapg_seed0"} and all(len(r["reward"]) == 2 for r in report["runs"].values())
    assert 0.0 <= report["emapg_last_fifth_mean_reward"] <= 1.0 and Path(report["plot"]).is_file()


@pytest.mark.slow
def test_async_parity_quick(tmp_path):
    report = _quick("async_parity", tmp_path)
    assert report["staleness"] == [0, 1] and report["seeds"] == [0, 1]
    d = report["paired_vs_s0"]["s1"]
    assert len(d["differences"]) == 2 and d["ci95"][0] <= d["mean_difference"] <= d["ci95"][1]
    assert (tmp_path / "async_parity.png").is_file()


@pytest.mark.slow
def test_greedy_vs_sampled_quick(tmp_path):
    report = _quick("greedy_vs_sampled", tmp_path, "--work", str(tmp_path / "work"))
    assert report["mode"] == "quick" and set(report["results"]) == {"greedy", "sampled"}
    assert report["machine"]["cpus"] == os.cpu_count()


@pytest.mark.slow
def test_same_seed_twice_quick(tmp_path):
    report = _quick("same_seed_twice", tmp_path, "--work", str(tmp_path / "work"))
    row = report["conditions"]["hf"]
    assert row["trajectories"] == 16 and row["identical"] == 16  # the transformers engine repeats a seeded batch exactly


def test_same_run_twice_quick(tmp_path):
    report = _quick("same_run_twice", tmp_path, "--work", str(tmp_path / "work"))
    assert [r["step"] for r in report["steps"]] == [1, 2] and all(r["trajectories"] > 0 for r in report["steps"])
    assert all(r["weights"].get("tensors", 0) > 0 for r in report["steps"])  # every checkpoint compared
    assert not list((tmp_path / "work").glob("*/step_*"))  # then removed (a SmolLM2 run's are ~1.6 GB a step)
