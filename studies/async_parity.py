"""Learning parity of asynchronous training: ``rollout.max_staleness`` s = 1 (and 2) vs s = 0 on the toy search task.

The toy search task of ``studies/learning_toy.py`` (``tests/fixtures/trainer.py``: 8 synthetic
facts stating 4 digits, so a constant answer scores 0.25, in a real MiniLM + FAISS index behind a real
``emapg serve``; tiny-qwen2 warm-started to search and copy the observed digit about half the time).
Every run starts from the same warm-started weights and generates on the same ``emapg engine serve``
(transformers) server (``rollout.engine=remote``; it starts each run on that run's own weights), with
EMA-PG and the same everything — prompts, group size, lengths, steps, seeds, behaviour correction —
except ``rollout.max_staleness``. For s ≥ 1 the producer generates batch k with the weights after
step k − 1 − s while the trainer updates (``trainer/pipeline.py``).

Per run: the reward curve, the mean reward of the last ``--last-k`` steps, the train-inference
mismatch and the wall time. Per s ≥ 1: the differences ``last-k(s) − last-k(0)`` paired by seed
(the seed fixes the prompts and the first batch, so the pairs share them), their mean and a 95 %
Student-t interval over seeds; the verdict is ``within noise`` when the interval contains 0,
otherwise ``lower`` / ``higher``. With 3 seeds the interval is wide (t₀.₉₇₅,₂ = 4.30): its half-width
is reported as what this run can resolve. A benchmark, not a test: it asserts nothing.

Writes ``benchmarks/results/async_parity.json`` and ``benchmarks/results/async_parity.png``
(reward curves, one line per run). Takes several minutes on 2 cores; run it alone
(``flock /tmp/emapg-heavy.lock``).

    python studies/async_parity.py [--steps 20] [--seeds 0 1 2] [--staleness 0 1 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from studies import harness  # noqa: E402
RESULTS = harness.RESULTS

# Student-t 0.975 quantiles by degrees of freedom (two-sided 95 %), to avoid a SciPy dependency.
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def t975(df: int) -> float:
    """The two-sided 95 % Student-t quantile for ``df`` degrees of freedom (the next smaller tabulated df: conservative)."""
    if df < 1:
        raise ValueError("a t interval needs at least 2 paired values")
    return T975[max(k for k in T975 if k <= df)] if df <= 30 else 1.96


def paired_difference(treated: list[float], control: list[float]) -> dict[str, float | str | list[float]]:
    """Mean of ``treated[i] − control[i]`` (paired by seed), its 95 % t interval and the verdict from it."""
    if len(treated) != len(control) or len(treated) < 2:
        raise ValueError("paired_difference needs two equally long lists of at least 2 values")
    diffs = [a - b for a, b in zip(treated, control)]
    mean = statistics.fmean(diffs)
    half = t975(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    low, high = mean - half, mean + half
    verdict = "within noise" if low <= 0.0 <= high else ("higher" if low > 0 else "lower")
    return {"differences": diffs, "mean_difference": mean, "ci95": [low, high], "ci95_half_width": half, "verdict": verdict}


def run_one(task, *, start: Path, retriever_url: str, engine_url: str, s: int, seed: int, args, out: Path) -> dict:
    from emapg.config import load_config
    from emapg.paths import CONFIG_DIR
    from tests.fixtures.trainer import toy_overrides
    from trainer.config import TrainConfig
    from trainer.loop import train

    cfg = load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml", toy_overrides(task, retriever_url, out, **{
        "model.policy": str(start), "run.total_steps": args.steps, "run.seed": seed, "optim.lr": args.lr,
        "run.save_every": 0, "logging.progress": "false", "logging.tensorboard": "false", "data.prompts_per_step": 8,
        "algorithm.mini_batch_size": 16, "algorithm.micro_batch_size": 16, "rollout.engine": "remote",
        "rollout.engine_urls": f"[{engine_url}]", "rollout.max_staleness": s,
        "algorithm.behavior_correction": args.correction,
    }))  # fmt: skip
    t0 = time.perf_counter()
    history = train(cfg)
    wall = time.perf_counter() - t0
    rewards = [h["reward/mean"] for h in history]
    k = min(args.last_k, len(rewards))

    def mean(key: str) -> float | None:
        vals = [h[key] for h in history if key in h]
        return statistics.fmean(vals) if vals else None

    return {
        "max_staleness": s, "seed": seed, "reward": rewards, "first_k_mean_reward": statistics.fmean(rewards[:k]),
        "last_k_mean_reward": statistics.fmean(rewards[-k:]), "wall_s": wall,
        "staleness": [h.get("async/staleness", 0.0) for h in history],
        "mismatch_abs_logp_diff_mean": mean("mismatch/abs_logp_diff_mean"), "mismatch_k3": mean("mismatch/k3"),
        "mismatch_abs_logp_diff_mean_per_step": [h.get("mismatch/abs_logp_diff_mean") for h in history],
        "behavior_truncated_frac": mean("behavior/truncated_frac"), "search_failures": sum(h["search/failures"] for h in history),
    }  # fmt: skip


def plot_parity(report: dict, png: Path) -> Path:
    """Reward curves coloured by s (thin: each seed; thick: the mean over seeds) and, per s >= 1, the paired
    differences of the last-k mean reward with their 95 % interval."""
    fig, (curves, diffs) = harness.figure(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [2, 1]})
    import matplotlib.pyplot as plt

    levels, seeds, colors = report["staleness"], report["seeds"], plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, s in enumerate(levels):
        per_seed = [report["runs"][f"s{s}_seed{seed}"]["reward"] for seed in seeds]
        for rewards in per_seed:
            curves.plot(range(1, len(rewards) + 1), rewards, color=colors[i], alpha=0.3, linewidth=0.8)
        mean = [statistics.fmean(step) for step in zip(*per_seed)]
        curves.plot(range(1, len(mean) + 1), mean, color=colors[i], linewidth=2.2, label=f"s = {s} (mean of {len(seeds)} seeds)")
    curves.set(xlabel="step", ylabel="mean reward", title="reward per step")
    curves.legend(fontsize=8)
    curves.grid(alpha=0.3)
    for i, s in enumerate(levels[1:], start=1):
        d = report["paired_vs_s0"][f"s{s}"]
        diffs.scatter([i] * len(d["differences"]), d["differences"], color=colors[i], alpha=0.6, s=18)
        diffs.errorbar([i], [d["mean_difference"]], yerr=[[d["mean_difference"] - d["ci95"][0]], [d["ci95"][1] - d["mean_difference"]]],
                       fmt="D", color=colors[i], capsize=6, label=f"s = {s}: {d['verdict']}")
    diffs.axhline(0.0, color="black", linewidth=0.8)
    diffs.set(xticks=range(1, len(levels)), xticklabels=[f"s = {s}" for s in levels[1:]], xlim=(0.5, len(levels) - 0.5),
              ylabel=f"last-{report['last_k']} reward − s = 0's", title="paired by seed, 95 % t interval")
    diffs.legend(fontsize=8)
    diffs.grid(alpha=0.3)
    fig.suptitle(f"toy search task: rollout.max_staleness s >= 1 vs s = 0 (tiny-qwen2, EMA-PG + {report['behavior_correction']}, "
                 f"{report['steps']} steps)", fontsize=10)
    return harness.save_figure(fig, png, dpi=110)


def write_report(args, runs: dict[str, dict], levels: list[int], task, t_all: float, load_before) -> dict:
    """The JSON and the PNG of the runs of ``levels`` (values of s, 0 first) done so far."""
    names = [f"s{s}_seed{seed}" for s in levels for seed in args.seeds]
    last = {s: [runs[f"s{s}_seed{seed}"]["last_k_mean_reward"] for seed in args.seeds] for s in levels}
    report = {
        "benchmark": "async_parity", "quick": args.quick, "steps": args.steps, "seeds": args.seeds, "staleness": levels,
        "staleness_requested": args.staleness, "last_k": args.last_k, "lr": args.lr, "behavior_correction": args.correction,
        "facts": task.facts, "model": "tiny-qwen2 (warm start of tests/fixtures/trainer.py)",
        "engine": "one remote hf server (emapg engine serve), 1 thread",
        "last_k_mean_reward": {f"s{s}": dict(zip(map(str, args.seeds), v)) for s, v in last.items()},
        "last_k_mean_reward_over_seeds": {f"s{s}": statistics.fmean(v) for s, v in last.items()},
        "paired_vs_s0": {f"s{s}": paired_difference(last[s], last[0]) for s in levels if s},
        "train_wall_s_over_seeds": {f"s{s}": sum(runs[f"s{s}_seed{seed}"]["wall_s"] for seed in args.seeds) for s in levels},
        "runs": {n: runs[n] for n in names}, "wall_s": time.perf_counter() - t_all,
        "load_average_1min_before_after": [load_before[0], os.getloadavg()[0]], "provenance": args.provenance,
    }  # fmt: skip
    harness.write_report(report, Path(args.out), plot_parity)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2], help="values of rollout.max_staleness (0 first: the reference)")
    p.add_argument("--last-k", type=int, default=5, help="steps averaged for the final reward")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--correction", default="tis", choices=["none", "tis", "mis"], help="algorithm.behavior_correction (every run)")
    p.add_argument("--quick", action="store_true", help="2 seeds x s = 0, 1, 4 steps (a smoke run; its verdict means nothing)")
    p.add_argument("--out", default=str(RESULTS / "async_parity.json"))
    p.add_argument("--replot", metavar="JSON", help="only redraw the PNG of a report this script wrote (next to it)")
    harness.add_arguments(p)
    args = p.parse_args(argv)
    if args.replot:
        print(f"wrote {plot_parity(json.loads(Path(args.replot).read_text()), Path(args.replot).with_suffix('.png'))}")
        return 0
    if args.quick:
        args.steps, args.seeds, args.staleness, args.last_k = 4, [0, 1], [0, 1], 2
    if args.staleness[0] != 0 or len(args.staleness) < 2 or len(set(args.staleness)) != len(args.staleness):
        p.error("--staleness must start with 0 (the synchronous reference), then one or more other values, none repeated")
    if len(args.seeds) < 2:
        p.error("--seeds needs at least 2 seeds (the interval is over seeds)")
    args.provenance = harness.start(__file__, quick=args.quick, allow_dirty=args.allow_dirty)
    harness.environment(OMP_NUM_THREADS="1", TRANSFORMERS_OFFLINE="1")
    import logging

    import torch

    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    from agent.engines.launch import EngineServer
    from emapg.models import resolve_model
    from retriever.launch import RetrieverServer
    from tests.fixtures.trainer import build_toy_task, warm_start

    t_all = time.perf_counter()
    load_before = os.getloadavg()
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="emapg-async-parity-") as tmp:
        work = Path(tmp)
        task = build_toy_task(work / "task")
        start = warm_start(Path(resolve_model("tiny-qwen2")), task, work / "warm_start")
        with RetrieverServer(task.index_dir, omp_num_threads=1, device="cpu", topk=1) as retriever, \
                EngineServer(start, engine="hf", omp_num_threads=1, max_model_len=256) as engine:  # fmt: skip
            # s = 0 and the first s >= 1 over every seed first, then each further s: the report is rewritten after
            # each level, so a run stopped early still has the main comparison.
            for level, s in enumerate(args.staleness):
                for seed in args.seeds:
                    name = f"s{s}_seed{seed}"
                    runs[name] = run_one(task, start=start, retriever_url=retriever.url, engine_url=engine.url, s=s, seed=seed,
                                         args=args, out=work / name)
                    r = runs[name]
                    print(f"s={s} seed {seed}: reward {r['first_k_mean_reward']:.3f} -> {r['last_k_mean_reward']:.3f} "
                          f"(last {args.last_k}); {r['wall_s']:.0f} s", flush=True)
                if level:
                    report = write_report(args, runs, args.staleness[: level + 1], task, t_all, load_before)
    for s in args.staleness[1:]:
        d = report["paired_vs_s0"][f"s{s}"]
        print(f"s={s} - s=0, last {args.last_k} steps' mean reward: {d['mean_difference']:+.3f} "
              f"[95% CI {d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}] over {len(args.seeds)} seeds: {d['verdict']}")
    print(f"wrote {args.out} and {Path(args.out).with_suffix('.png')} ({report['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
