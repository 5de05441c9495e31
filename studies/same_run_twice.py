"""The same run twice: where two training runs of one seed part (issue 53, item 5).

Question. The learning benchmark ran some seeds twice and scored them differently (control seed 0: 15.1, then 12.7;
GRPO seed 2: 19.2, then 17.5). ``studies/same_seed_twice.py`` found one step's rollout batch bit-identical twice on
the same servers, so generation from given weights repeats. The recorded training rewards of those runs agree for
the first two steps and part at step 3 or 4. Which stage of which step parts them first: the batch (generation or
retrieval from the weights the engine holds), the update (the loss and gradient on an identical batch), or the weights
after an identical update?

Method. The same training run (the learning benchmark's settings: ``configs/demo_search_smollm2.yaml``, the shipped
starter, ``qa_pool``, one arm, seed 0, ``--steps`` steps, a checkpoint after every step, every trajectory logged)
is run twice, each as its own ``emapg train`` process (as a user would run it: its own hash seed, its own threads), on
one shared retriever and one shared generation server (as the studies run). Per step it compares:

* the batch: every trajectory's response, queries, passages and reward (``samples.jsonl``);
* the update: every logged metric of the step (loss, gradient norm, KL, ...; ``metrics.jsonl``), exactly;
* the weights after the step: every tensor of the checkpoint's ``policy/``, bit for bit (largest absolute difference).

The first stage that differs names the cause: weights that differ after an identical batch and identical metrics
(or an identical batch and different metrics) are an update that does not repeat; a batch that differs after
identical weights is the engine or the retriever (the weights it holds, its state from the run before).

    python studies/same_run_twice.py                 # ~10 min on 2 cores
    python studies/same_run_twice.py --quick         # tiny-qwen2, 2k-passage index, hf engine, 2 steps

Writes ``benchmarks/results/same_run_twice.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from studies import harness  # noqa: E402
from studies.harness import RESULTS  # noqa: E402
from studies.learning_search import ALGOS  # noqa: E402

#: the per-trajectory fields of ``samples.jsonl`` that make up the batch
BATCH_FIELDS = ("group_id", "reward", "response", "queries", "retrieved_ids", "answer", "response_tokens")
#: metrics that measure the machine, not the computation
TIMING_PREFIXES = ("time/", "perf/", "throughput/", "memory/", "mem/", "eta")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """A run's jsonl records (:func:`emapg.jsonl.read_jsonl`: a line cut by a kill mid-write is skipped); none if absent."""
    from emapg.jsonl import read_jsonl as read

    return read(path) if path.is_file() else []


def batches(run_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """Each step's logged trajectories (the batch fields only)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for row in read_jsonl(run_dir / "samples.jsonl"):
        out.setdefault(int(row["step"]), []).append({k: row.get(k) for k in BATCH_FIELDS})
    return out


def step_metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    """Each step's logged metrics, timings left out."""
    return {int(m["step"]): {k: v for k, v in m.items() if k != "step" and not k.startswith(TIMING_PREFIXES)}
            for m in read_jsonl(run_dir / "metrics.jsonl")}


def same_number(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def weights_difference(a: Path, b: Path) -> dict[str, Any]:
    """Bit-for-bit comparison of two ``policy/`` folders' safetensors: tensors that differ and the largest |a - b|."""
    import torch
    from safetensors.torch import load_file

    files = sorted(p.name for p in a.glob("*.safetensors"))
    if not files or files != sorted(p.name for p in b.glob("*.safetensors")):
        return {"error": f"different or no safetensors files: {files}"}
    differ, total, largest = 0, 0, 0.0
    for name in files:
        ta, tb = load_file(str(a / name)), load_file(str(b / name))
        for key, x in ta.items():
            total += 1
            y = tb[key]
            if not torch.equal(x, y):
                differ += 1
                largest = max(largest, float((x.double() - y.double()).abs().max()))
    return {"tensors": total, "tensors_differ": differ, "max_abs_diff": largest}


def compare_runs(first: Path, second: Path, steps: int) -> dict[str, Any]:
    """Per step: batch identical, metrics identical (and which differ), weights after the step identical; and the first
    stage that differs."""
    from trainer.checkpoint import step_dir_name

    ba, bb = batches(first), batches(second)
    ma, mb = step_metrics(first), step_metrics(second)
    rows, first_difference = [], None
    for step in range(1, steps + 1):
        traj_a, traj_b = ba.get(step, []), bb.get(step, [])
        batch_same = traj_a == traj_b and bool(traj_a)
        differing_traj = sum(x != y for x, y in zip(traj_a, traj_b)) + abs(len(traj_a) - len(traj_b))
        metrics_differ = sorted(k for k in set(ma.get(step, {})) | set(mb.get(step, {}))
                                if not same_number(ma.get(step, {}).get(k), mb.get(step, {}).get(k)))
        wa, wb = first / step_dir_name(step) / "policy", second / step_dir_name(step) / "policy"
        weights = weights_difference(wa, wb) if wa.is_dir() and wb.is_dir() else {"error": "checkpoint missing"}
        row = {"step": step, "trajectories": len(traj_a), "batch_identical": batch_same, "trajectories_differ": differing_traj,
               "metrics_identical": not metrics_differ, "metrics_differ": metrics_differ[:20],
               "weights_identical": weights.get("tensors_differ") == 0, "weights": weights}
        if first_difference is None:
            if not batch_same:
                first_difference = {"step": step, "stage": "batch"}
            elif metrics_differ:
                first_difference = {"step": step, "stage": "update (metrics)"}
            elif not row["weights_identical"]:
                first_difference = {"step": step, "stage": "weights after an identical update's metrics"}
        rows.append(row)
    return {"steps": rows, "first_difference": first_difference}


def train_process(run_dir: Path, config: Path, overrides: list[str], log: Path) -> float:
    """One ``emapg train`` process (its own hash seed and threads, as a user runs it); returns its wall seconds."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    cmd = [sys.executable, "-c", "import sys; from app.cli import main; sys.exit(main(sys.argv[1:]))", "train", "--config", str(config),
           "--quiet", "--no-plan", *overrides]
    t = time.perf_counter()
    with log.open("w") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    return time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny-qwen2 on a 2k-passage index, the hf engine, 2 steps")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 4; quick 2)")
    p.add_argument("--algorithm", choices=sorted(ALGOS), default="grpo", help="the arm (default grpo)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "same_run_twice.json"))
    p.add_argument("--work", default="/tmp/emapg-same-run-twice", help="folder for the two runs and the servers' logs (emptied first)")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep every step's checkpoint (SmolLM2: ~1.6 GB each, two "
                   "runs x --steps of them); by default they are removed once compared")
    harness.add_arguments(p)
    args = p.parse_args(argv)
    provenance = harness.start(__file__, quick=args.quick, allow_dirty=args.allow_dirty)
    harness.environment()

    import shutil

    from emapg.models import STARTER
    from emapg.paths import CONFIG_DIR

    t0 = time.perf_counter()
    steps = args.steps or (2 if args.quick else 4)
    policy = "tiny-qwen2" if args.quick else STARTER
    config = CONFIG_DIR / ("search_tiny_cpu.yaml" if args.quick else "demo_search_smollm2.yaml")
    engine = "hf" if args.quick else "vllm"
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    from emapg.config import load_config
    from trainer.config import TrainConfig

    r = load_config(TrainConfig, config, []).rollout
    group = r.n_samples
    report: dict[str, Any] = {"benchmark": "same_run_twice", "quick": args.quick, "policy": policy, "config": config.name,
                              "algorithm": args.algorithm, "seed": args.seed, "steps": steps, "engine": engine,
                              "provenance": provenance, "machine": harness.machine()}  # fmt: skip
    with harness.servers(policy, engine=engine, index_limit=2000 if args.quick else None,
                         max_model_len=r.max_prompt_tokens + r.max_response_tokens, folder=work) as served:  # fmt: skip
        walls = []
        for name in ("first", "second"):
            run_dir = work / name
            overrides = [f"model.policy={policy}", "data.train=qa_pool", "data.split=train", f"retriever.urls=[{served.retriever_url}]",
                         "retriever.index_dir=null", "rollout.engine=remote", f"rollout.engine_urls=[{served.engine_url}]",
                         f"run.output_dir={run_dir}", f"run.seed={args.seed}", f"run.total_steps={steps}", "run.save_every=1",
                         "run.keep_last=0", "logging.progress=false", "logging.tensorboard=false",
                         f"logging.log_samples={group * 64}", f"algorithm.ema.period={max(2, steps // 10)}",
                         *(["run.precision=bf16", "rollout.uniform_groups=drop"] if args.quick else []), *ALGOS[args.algorithm]]  # fmt: skip
            walls.append(round(train_process(run_dir, config, overrides, work / f"{name}.log"), 1))
            print(f"[same_run_twice] {name} run: {walls[-1]:.0f} s", flush=True)
    report["train_s"] = walls
    report.update(compare_runs(work / "first", work / "second", steps))
    if not args.keep_checkpoints:  # compared: the runs' logs stay, their checkpoints go
        from trainer.checkpoint import step_dir_name

        for name in ("first", "second"):
            for step in range(1, steps + 1):
                shutil.rmtree(work / name / step_dir_name(step), ignore_errors=True)
    for row in report["steps"]:
        print(f"[same_run_twice] step {row['step']}: batch {'same' if row['batch_identical'] else 'DIFFERS'} "
              f"({row['trajectories_differ']} of {row['trajectories']} trajectories differ), metrics "
              f"{'same' if row['metrics_identical'] else 'DIFFER ' + ', '.join(row['metrics_differ'][:5])}, weights "
              f"{'same' if row['weights_identical'] else 'DIFFER ' + json.dumps(row['weights'])}", flush=True)
    print(f"[same_run_twice] first difference: {report['first_difference']}")
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    report["date"] = harness.now()
    harness.write_report(report, Path(args.out))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
