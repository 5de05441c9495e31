"""Benchmarks that only run for real on hardware CI lacks still run here, on a small shape."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_step_benchmark_runs_its_code_path_on_cpu(tmp_path):
    """``benchmarks/gpu_step.py --shape tiny``: the trainer's update (anchor stats, PPO, EMA) on a
    synthetic grouped batch, GRPO and EMA-PG, results JSON written."""
    out = tmp_path / "gpu_step.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_step.py"), "--shape", "tiny", "--batch", "10", "--group", "5",
           "--prompt-len", "16", "--response-len", "32", "--micro-batch", "5", "--steps", "2", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    for mode in ("grpo", "emapg"):
        r = report["results"][mode]
        assert len(r["step_times_s"]) == 2 and r["tokens_per_s"] > 0 and r["tokens_per_step"] > 10 * 16
    assert math.isfinite(report["emapg_over_grpo_update_time_ratio"])
    # EMA-PG computed the anchor's Top-k statistics inside the training pass (on-policy, one update).
    assert report["results"]["emapg"]["phase_times_s"][0] == {}


def test_gpu_step_refuses_the_3b_shape_without_a_gpu():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_step.py")], capture_output=True, text=True,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr
