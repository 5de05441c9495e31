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


def test_retriever_load_benchmark_writes_its_ratios(tmp_path):
    """``benchmarks/retriever_load.py`` on a 32-passage index with windows of a fraction of a second:
    the contract keys (batched/unbatched and single/batch-of-32 at 32 clients) are numbers, every
    round of the ceiling and the GRPO-repeat row are there, and the query cache answered repeats."""
    out = tmp_path / "retriever_load.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "retriever_load.py"), "--quick", "--passages", "32", "--levels", "32",
           "--duration", "0.5", "--warmup", "0.2", "--rounds", "2", "--out", str(out)]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    for key in ("batched_over_unbatched_qps_ratio_c32", "single_over_batch32_ceiling_c32", "single_over_encoder_ceiling_c32"):
        assert isinstance(report[key], float) and report[key] > 0, key
    fp32 = report["ceiling"]["fp32"]
    assert len(fp32["rounds"]) == 2 and fp32["single_over_batch32"]["min"] <= report["single_over_batch32_ceiling_c32"] <= fp32["single_over_batch32"]["max"]
    for r in fp32["rounds"]:
        assert r["single_c32"]["errors"] == 0 and r["single_c32"]["requests"] > 0 and r["batch32_c1"]["requests"] > 0
        assert r["batch32_c1"]["mean_batch_size"] == 32.0  # every micro-batch of the ceiling holds one 32-query request
    assert report["unbatched"]["levels"]["32"]["mean_batch_size"] == 1.0
    grpo = report["grpo_repeats"]
    # groups of 5: one miss per group, the other four are answered from the cache
    assert grpo["cache_on"]["query_cache_hit_fraction"] > 0.5 and grpo["cache_off"]["query_cache_hit_fraction"] == 0.0
    assert "single/batch-of-32" in proc.stdout
