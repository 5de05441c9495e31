"""Step time of a two-node run vs one node with the same total ranks (2 gloo ranks on this machine).

The real trainer (``torchrun ... -m app.cli train``, ``configs/search_tiny_cpu.yaml`` on the toy search
task of ``tests/fixtures/trainer.py``: tiny-qwen2 warm-started on the task so that rewards vary, a real
``emapg serve`` over a MiniLM + FAISS index),
the same config in two launches, alternated (ABBA...) in one run:

* ``one_node``:  one torchrun agent, ``--nnodes 1 --nproc-per-node 2``;
* ``two_nodes``: two torchrun agents, ``--nnodes 2 --node-rank 0/1 --nproc-per-node 1``,

both with a c10d rendezvous on 127.0.0.1 (the launcher of ``tests/fixtures/torchrun.py``, which the
two-agent test uses too). Per-step time is rank 0's ``time/step`` from ``metrics.jsonl`` (generation,
retrieval, update, the collectives); ``wall`` is launch to the last agent's exit (imports, rendezvous,
model load, the final checkpoint). Both launches form the same 2-rank gloo group over TCP loopback, so
the same global batch gives the same losses and parameters; this is checked (``--tolerance``) and a
difference fails the run (exit 1).

On one machine both launches share the same CPU cores and the same loopback TCP, so the ratio
two_nodes/one_node measures what separate agents cost (a second rendezvous participant, a second
agent process, no shared node-local state) -- not a network; across real nodes gloo/NCCL traffic
goes over the interconnect instead.

    python benchmarks/multinode_step.py                # 8 steps x 2 launches per mode (about 6 min on 2 cores)
    python benchmarks/multinode_step.py --quick        # smoke: 2 steps, one launch per mode, small batch

Writes ``benchmarks/results/multinode_step.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "multinode_step.json"

MODES = {"one_node": {"nodes": 1, "nproc_per_node": 2}, "two_nodes": {"nodes": 2, "nproc_per_node": 1}}
WARM = "toy-warm"
COMPARED = ("reward/mean", "loss/pg", "loss/clip_frac", "loss/ppo_kl", "kl/mean", "actor/grad_norm")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8, help="training steps per launch")
    ap.add_argument("--repeat", type=int, default=2, help="launches per mode (alternated: one, two, two, one, ...)")
    ap.add_argument("--prompts-per-step", type=int, default=4, help="data.prompts_per_step (global, over both ranks)")
    ap.add_argument("--n-samples", type=int, default=4, help="rollout.n_samples (group size)")
    ap.add_argument("--model", default=WARM, help=f"model.policy: {WARM!r} (tiny-qwen2 warm-started on the toy task, cached: "
                    "rewards about 0.5, so the policy gradient is not zero), a name emapg.models resolves, or a folder")
    ap.add_argument("--tolerance", type=float, default=1e-6,
                    help="largest absolute difference of a loss metric or a final parameter between launches")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 steps, 1 launch per mode, 2 prompts x 2 samples")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one launch may take before it is killed")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.repeat, args.prompts_per_step, args.n_samples = 2, 1, 2, 2
    for name in ("steps", "repeat", "prompts_per_step", "n_samples"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.prompts_per_step % 2:
        ap.error("--prompts-per-step must be even: the prompts are split over 2 ranks")
    return args


def schedule(repeat: int) -> list[str]:
    """Launch order: ABBA... so that neither mode always runs first (a warm disk cache, a drifting load)."""
    order: list[str] = []
    for r in range(repeat):
        order += list(MODES) if r % 2 == 0 else list(reversed(MODES))
    return order


def launch(mode: str, overrides: list[str], work: Path, timeout_s: float) -> dict:
    """One launch of ``mode``; its step metrics, wall time and final parameters."""
    from emapg.paths import CONFIG_DIR
    from tests.fixtures.spawn import free_port
    from tests.fixtures.torchrun import agent_failure, run_agents
    from trainer.checkpoint import latest_checkpoint

    spec = MODES[mode]
    run = work / "run"
    logs = [work / f"node{n}.log" for n in range(spec["nodes"])]
    t0 = time.perf_counter()
    codes = run_agents(CONFIG_DIR / "search_tiny_cpu.yaml", [f"run.output_dir={run}", *overrides], logs,
                       nproc_per_node=spec["nproc_per_node"], port=free_port(), rdzv_id=f"multinode-step-{work.name}",
                       timeout_s=timeout_s)
    wall = time.perf_counter() - t0
    if codes != [0] * len(codes):
        raise RuntimeError(f"{mode} launch failed: {agent_failure(codes, logs)}")
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    from safetensors.torch import load_file

    params = load_file(str(latest_checkpoint(run) / "policy" / "model.safetensors"))
    steps = [m["time/step"] for m in metrics]
    return {"wall_s": wall, "step_times_s": steps, "outside_steps_s": wall - sum(steps),
            "losses": {k: [m.get(k) for m in metrics] for k in COMPARED}, "params": params,
            "world_size": json.loads((latest_checkpoint(run) / "trainer_state.json").read_text())["world_size"]}


def _diff(x: float | None, y: float | None) -> float:
    """|x - y|; two missing or two NaN values agree, one of them alone is an infinite difference."""
    missing_x, missing_y = x is None or math.isnan(x), y is None or math.isnan(y)
    if missing_x or missing_y:
        return 0.0 if missing_x and missing_y else math.inf
    return abs(x - y)


def max_loss_diff(a: dict, b: dict) -> float:
    if any(len(a["losses"][k]) != len(b["losses"][k]) for k in COMPARED):
        return math.inf
    return max((_diff(x, y) for k in COMPARED for x, y in zip(a["losses"][k], b["losses"][k])), default=0.0)


def start_params(model: Path) -> dict:
    """The policy's weights before training (its safetensors files)."""
    from safetensors.torch import load_file

    params: dict = {}
    for f in sorted(model.glob("*.safetensors")):
        params.update(load_file(str(f)))
    return params


def max_param_diff(a: dict, b: dict) -> float:
    if a["params"].keys() != b["params"].keys():
        return math.inf
    return max(float((a["params"][k] - b["params"][k]).abs().max()) for k in a["params"])


def run_all(args: argparse.Namespace, root: Path) -> dict[str, list[dict]]:
    """Every launch of the schedule against one retriever server over the toy index; the launches by mode."""
    from emapg.models import resolve_model
    from retriever.launch import RetrieverServer
    from tests.fixtures.trainer import WARM_CACHE_STEPS, build_toy_task, cached_warm_start, toy_overrides

    task = build_toy_task(root / "task")
    if args.model == WARM:
        model = cached_warm_start(Path(resolve_model("tiny-qwen2")), task, WARM_CACHE_STEPS)
    else:
        model = Path(args.model) if Path(args.model).is_dir() else Path(resolve_model(args.model))
    args.start_params = start_params(model)
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with RetrieverServer(task.index_dir, omp_num_threads=1, device="cpu", topk=1, startup_timeout=args.timeout) as server:
        overrides = [o for o in toy_overrides(task, server.url, root, **{
            "model.policy": str(model), "run.total_steps": args.steps, "run.save_every": 0, "run.seed": 0,
            "logging.progress": "false", "logging.tensorboard": "false", "data.prompts_per_step": args.prompts_per_step,
            "rollout.n_samples": args.n_samples, "algorithm.mini_batch_size": args.prompts_per_step * args.n_samples // 2,
            "algorithm.micro_batch_size": args.prompts_per_step * args.n_samples // 4 or 1})
            if not o.startswith("run.output_dir=")]  # one per launch
        for i, mode in enumerate(schedule(args.repeat)):
            r = launch(mode, overrides, root / f"{i:02d}-{mode}", args.timeout)
            runs[mode].append(r)
            print(f"{mode:9s} launch {len(runs[mode])}: median step {statistics.median(r['step_times_s']):.3f}s "
                  f"(steps {', '.join(f'{t:.2f}' for t in r['step_times_s'])}), wall {r['wall_s']:.1f}s", flush=True)
    return runs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="multinode-step-") as tmp:
        runs = run_all(args, Path(tmp))

    reference = runs["one_node"][0]
    every = [r for mode in MODES for r in runs[mode]]
    loss_diff = max(max_loss_diff(reference, r) for r in every)
    param_diff = max(max_param_diff(reference, r) for r in every)
    same = loss_diff <= args.tolerance and param_diff <= args.tolerance and all(r["world_size"] == 2 for r in every)
    common = args.start_params.keys() & reference["params"].keys()  # the comparison proves something only if > 0
    trained = max((float((reference["params"][k] - args.start_params[k]).abs().max()) for k in common), default=0.0)
    modes = {}
    for mode, rs in runs.items():
        steps = [t for r in rs for t in r["step_times_s"]]
        modes[mode] = {"launch": MODES[mode], "median_step_s": statistics.median(steps), "all_step_times_s": steps,
                       "median_wall_s": statistics.median(r["wall_s"] for r in rs),
                       "median_outside_steps_s": statistics.median(r["outside_steps_s"] for r in rs),
                       "runs": [{k: r[k] for k in ("wall_s", "step_times_s", "outside_steps_s")} for r in rs]}
    step_ratio = modes["two_nodes"]["median_step_s"] / modes["one_node"]["median_step_s"]
    wall_ratio = modes["two_nodes"]["median_wall_s"] / modes["one_node"]["median_wall_s"]
    report = {
        "benchmark": "multinode_step", "date": datetime.date.today().isoformat(), "model": str(args.model),
        "config": {"steps": args.steps, "repeat": args.repeat, "prompts_per_step": args.prompts_per_step,
                   "n_samples": args.n_samples, "world_size": 2, "backend": "gloo", "preset": "search_tiny_cpu",
                   "launch_order": schedule(args.repeat)},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "modes": modes,
        "two_over_one_node_step_time": step_ratio, "two_over_one_node_wall_time": wall_ratio,
        "same_results": {"identical_within_tolerance": same, "tolerance": args.tolerance,
                         "max_abs_loss_metric_diff": loss_diff, "max_abs_param_diff": param_diff,
                         "max_abs_param_change_from_start": trained,
                         "compared_metrics": list(COMPARED), "reference_metrics": reference["losses"]},
        "what_the_ratio_measures": "both launches run 2 gloo ranks on the same cores over loopback TCP: the ratio is "
                                   "the cost of separate torchrun agents (rendezvous, agent processes), not a network",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"two_nodes/one_node: step time {step_ratio:.3f}x (median {modes['two_nodes']['median_step_s']:.3f}s vs "
          f"{modes['one_node']['median_step_s']:.3f}s), wall {wall_ratio:.3f}x; losses max |diff| {loss_diff:.2e}, "
          f"parameters max |diff| {param_diff:.2e} -> {'same' if same else 'DIFFERENT'}")
    print(f"wrote {args.out}")
    if not same:
        print("the two launches did not train the same model (see same_results)", file=sys.stderr)
        return 1
    if not trained > 0:
        print("training left the parameters unchanged: the comparison proves nothing",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
