"""Collapse, measured and caught early: GRPO, EMA-PG and its two halves under a stress setting (issue #42).

PRE-REGISTERED PROTOCOL (written and committed before any run of it; 2026-12-05)
================================================================================

Question. Under a training setting harsh enough that plain GRPO collapses in a real fraction of seeds, how often
does each algorithm collapse, which half of EMA-PG (the moving anchor or the Top-k estimator) carries any
difference, and which per-step signal sees a collapse before the reward does?

Collapse (:class:`trainer.collapse.CollapseDefinition`, defaults): a run has collapsed at step s when its mean
reward stays below 0.5 x its starting level (the mean over its first 2 steps) for 3 consecutive steps from s, or
when its non-text share (``response/non_text_share``) exceeds 0.5 at s; the earlier of the two.

Arms (``ARMS``; each a set of overrides of the production trainer, same seeds, same questions):

* ``grpo``        -- K3 KL to the frozen reference (eta = 1), no importance weight;
* ``emapg``       -- Top-k reverse KL (k = 32, tail + IW) to an EMA anchor (eta = 0.9, period 2);
* ``ema_k3``      -- the anchor half: K3 to the EMA anchor (eta = 0.9, period 2);
* ``frozen_topk`` -- the estimator half: Top-k reverse KL (k = 32, tail + IW) to the frozen reference;
* ``emapg_guard`` -- ``emapg`` with the stability guard on, every detector's action ``rollback`` (checkpoints
  every step).

Every run logs ``kl/to_start`` (``logging.kl_to_start``) and probes 8 fixed training questions greedily every 2
steps (``logging.probe_size``), so every signal of :mod:`trainer.health_signals` is in its metrics.

Task and stress setting. The toy search task of ``tests/fixtures/trainer.py`` (8 synthetic facts behind a real
``emapg serve``; tiny-qwen2 warm-started for ``WARM_CACHE_STEPS`` steps so that it answers about half right),
``configs/search_tiny_cpu.yaml``, 8 prompts x 4 samples per step, one optimizer step per batch. The stress setting
is chosen by a short sweep *before* the protocol's runs, by a fixed rule: GRPO at every (lr, beta) of
``SWEEP_LR`` x ``SWEEP_BETA`` (beta = ``algorithm.kl.coef``), 2 sweep seeds (100, 101, never protocol seeds),
``--steps`` steps; grid points in order of increasing lr, then decreasing beta; the first point at which GRPO
collapses in at least one of the two sweep seeds is the stress setting (none: the last, harshest point). The
number of steps is fixed by the budget (``--steps``, default 12), not swept. The sweep's runs are reported.

Seeds. 5 per arm on the toy task (0-4), then 2 per arm (0, 1) of ``grpo``, ``emapg``, ``ema_k3`` and
``frozen_topk`` on the SmolLM2 search task (the shipped starter, ``configs/demo_search_smollm2.yaml``, the
answerable training pool and the bundled index) at the same lr and beta, with ``rollout.uniform_groups=topup`` (the
demo drops groups of equal rewards; here every signal and the reward are over all sampled trajectories).

Estimates. Per arm: the collapse rate with a 95% Wilson interval, the steps to collapse of each collapsed run;
EMA-PG - GRPO and each half - GRPO with Newcombe's hybrid Wilson interval on the difference. Per signal (each
detector of :data:`trainer.guard.DETECTORS` at its default thresholds, replayed alone over a run's metrics by
:func:`trainer.guard.first_trips`; the guarded arm is left out, its runs are changed by the guard): over the
collapsed runs, its lead time (collapse step - first trip; negative: after) -- the median and the share of
collapses it saw at least 2 steps ahead -- and its false-trip rate: the share of the runs that did not collapse on
which it tripped at all.

Targets (issue #42): GRPO collapses in >= 30% of seeds at the stress setting; at least one signal fires >= 2 steps
before the reward falls in >= 80% of collapses with <= 5% false trips. Whatever comes out is committed.

Not measured here (issue #42, still open): the SmolLM2 arms' end-of-run held-out change (greedy and sampled).

Cost: about 150 min on 2 cores (sweep ~12 min, toy protocol ~30 min, SmolLM2 ~100 min). Runs are kept in
``--work``: a finished run (its ``history.json``) is not run again.

Outputs: ``benchmarks/results/stability.json`` (contract: ``collapse_definition``; for each of ``grpo``,
``emapg``, ``ema_k3``, ``frozen_topk``: ``seeds``, ``collapse_rate``, ``collapse_rate_ci``; ``signals``: a list of
{``name``, ``median_lead_steps``, ``false_trip_rate``}) and ``stability.png``.

    python benchmarks/stability.py                 # the protocol (long)
    python benchmarks/stability.py --quick --out /tmp/stability.json   # 2 seeds x 3 steps, tiny-qwen2, no sweep
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"

TOPK = ["algorithm.kl.type=topk_reverse", "algorithm.kl.topk=32", "algorithm.kl.importance_weight=true"]
K3 = ["algorithm.kl.type=k3", "algorithm.kl.importance_weight=false"]
EMA = ["algorithm.ema.decay=0.9", "algorithm.ema.period=2"]
FROZEN = ["algorithm.ema.decay=1.0"]
ARMS: dict[str, list[str]] = {
    "grpo": ["algorithm.name=grpo", *K3, *FROZEN],
    "emapg": ["algorithm.name=emapg", *TOPK, *EMA],
    "ema_k3": ["algorithm.name=emapg", *K3, *EMA],
    "frozen_topk": ["algorithm.name=emapg", *TOPK, *FROZEN],
}
GUARDED = "emapg_guard"
CONTRACT_ARMS = ("grpo", "emapg", "ema_k3", "frozen_topk")
SMOLLM2_ARMS = CONTRACT_ARMS
SWEEP_LR = (1e-3, 3e-3, 1e-2)
SWEEP_BETA = (0.1, 0.001)
SWEEP_SEEDS = (100, 101)
Z95 = 1.959963984540054


def wilson(k: int, n: int, z: float = Z95) -> list[float]:
    """The Wilson score interval of a proportion k/n ([0, 1] when n = 0)."""
    if n == 0:
        return [0.0, 1.0]
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [max(0.0, centre - half), min(1.0, centre + half)]


def newcombe(k1: int, n1: int, k2: int, n2: int, z: float = Z95) -> list[float]:
    """Newcombe's hybrid score interval of p1 - p2 (method 10), from the two Wilson intervals."""
    p1, p2 = (k1 / n1 if n1 else 0.0), (k2 / n2 if n2 else 0.0)
    (l1, u1), (l2, u2) = wilson(k1, n1, z), wilson(k2, n2, z)
    d = p1 - p2
    return [d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)]


def run_record(history: list[dict[str, float]]) -> dict[str, Any]:
    """One run's series, collapse step and each detector's first trip (defaults, replayed alone)."""
    from trainer.collapse import collapse_step
    from trainer.guard import GuardConfig, first_trips

    def series(name: str) -> list[float | None]:
        return [h.get(name) for h in history]

    rewards = [float(h["reward/mean"]) for h in history]
    non_text = [float(h.get("response/non_text_share", 0.0)) for h in history]
    return {"reward": rewards, "non_text_share": non_text, "repeated_ngram_share": series("response/repeated_ngram_share"),
            "length_drift": series("response/length_drift"), "kl_to_start": series("kl/to_start"), "kl": series("kl/mean"),
            "entropy": series("actor/entropy"), "no_answer_rate": series("response/no_answer_rate"),
            "probe_flip_rate": series("probe/flip_rate"),
            "collapse_step": collapse_step(rewards, non_text), "first_trips": first_trips(history, GuardConfig(enabled=True))}


def summarise(runs: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """Per arm the collapse rate (Wilson), steps to collapse; differences to GRPO (Newcombe); per signal its lead
    times and false-trip rate over the unguarded arms' runs. ``runs[arm][seed]``: :func:`run_record`'s."""
    from trainer.collapse import CollapseDefinition
    from trainer.guard import DETECTORS

    out: dict[str, Any] = {"collapse_definition": CollapseDefinition().describe()}
    counts = {}
    for arm, by_seed in runs.items():
        steps = [r["collapse_step"] for r in by_seed.values()]
        k, n = sum(s is not None for s in steps), len(steps)
        counts[arm] = (k, n)
        out[arm] = {"seeds": sorted(by_seed), "collapsed": k, "collapse_rate": k / n if n else None,
                    "collapse_rate_ci": wilson(k, n), "steps_to_collapse": [s for s in steps if s is not None]}
    if "grpo" in counts:
        for arm in counts:
            if arm != "grpo":
                out[arm]["minus_grpo_collapse_rate_ci"] = newcombe(*counts[arm], *counts["grpo"])
    pool = [r for arm, by_seed in runs.items() if arm != GUARDED for r in by_seed.values()]
    collapsed = [r for r in pool if r["collapse_step"] is not None]
    healthy = [r for r in pool if r["collapse_step"] is None]
    signals = []
    for name in DETECTORS:
        leads = [r["collapse_step"] - r["first_trips"][name] for r in collapsed if r["first_trips"].get(name) is not None]
        signals.append({
            "name": name, "metrics": list(DETECTORS[name][0]),
            "median_lead_steps": statistics.median(leads) if leads else None,
            "lead_steps": leads,
            "seen_2_ahead_frac": sum(x >= 2 for x in leads) / len(collapsed) if collapsed else None,
            "false_trip_rate": sum(r["first_trips"].get(name) is not None for r in healthy) / len(healthy) if healthy else None,
        })
    out["signals"] = signals
    out["runs_pooled"] = {"collapsed": len(collapsed), "healthy": len(healthy)}
    return out


def plot(runs: dict[str, dict[int, dict[str, Any]]], path: Path, title: str) -> Path:
    """Per arm (columns): the reward and the leading signals (rows) of every seed; collapsed runs dashed, their
    collapse step marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [("reward", "mean reward"), ("repeated_ngram_share", "repeated 4-grams"), ("non_text_share", "non-text words"),
            ("length_drift", "length drift"), ("kl_to_start", "KL to start")]
    arms = list(runs)
    fig, axes = plt.subplots(len(rows), len(arms), figsize=(3.4 * len(arms), 2.2 * len(rows)), squeeze=False)
    for j, arm in enumerate(arms):
        for seed, r in sorted(runs[arm].items()):
            c = r["collapse_step"]
            for i, (key, label) in enumerate(rows):
                ax = axes[i][j]
                ys = [y if y is not None else math.nan for y in r[key]]
                xs = list(range(1, len(ys) + 1))
                ax.plot(xs, ys, linestyle="--" if c else "-", linewidth=1.2, label=f"seed {seed}")
                if c:
                    ax.axvline(c, color="tab:red", alpha=0.4, linewidth=1)
                if j == 0:
                    ax.set_ylabel(label, fontsize=8)
                if i == 0:
                    ax.set_title(arm, fontsize=10)
                ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=6)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


class Runner:
    """Trains one run per (task, arm, seed) with the production trainer, kept in ``work`` for resumption."""

    def __init__(self, work: Path, *, steps: int, prompts: int, samples: int, probe: int) -> None:
        self.work, self.steps, self.prompts, self.samples, self.probe = work, steps, prompts, samples, probe

    def run(self, name: str, config: Path, base: list[str], arm: str, seed: int, lr: float, beta: float) -> dict[str, Any]:
        from emapg.config import load_config
        from trainer.config import TrainConfig
        from trainer.loop import train

        out = self.work / name
        done = out / "history.json"
        if done.is_file():
            return json.loads(done.read_text())
        extra = list(ARMS["emapg" if arm == GUARDED else arm])
        if arm == GUARDED:
            from trainer.guard import DETECTORS

            extra += ["guard.enabled=true", "guard.nonfinite.action=rollback", "run.save_every=1", "run.keep_last=0",
                      *(f"guard.{d}.action=rollback" for d in DETECTORS)]
        overrides = [*base, f"run.output_dir={out / 'run'}", f"run.seed={seed}", f"run.total_steps={self.steps}",
                     f"optim.lr={lr}", f"algorithm.kl.coef={beta}", "logging.progress=false", "logging.tensorboard=false",
                     "logging.kl_to_start=true", f"logging.probe_size={self.probe}", "logging.probe_every=2",
                     f"data.prompts_per_step={self.prompts}", f"rollout.n_samples={self.samples}",
                     f"algorithm.mini_batch_size={self.prompts * self.samples}", *extra]
        if arm != GUARDED:
            overrides.append("run.save_every=0")
        history = train(load_config(TrainConfig, config, overrides))
        record = run_record(history)
        out.mkdir(parents=True, exist_ok=True)
        done.write_text(json.dumps(record))
        print(f"{name}: reward {record['reward'][0]:.3f} -> {record['reward'][-1]:.3f}, collapse step {record['collapse_step']}",
              flush=True)
        return record


def choose_stress(runner: Runner, config: Path, base: list[str]) -> tuple[float, float, list[dict[str, Any]]]:
    """The pre-registered sweep: GRPO over SWEEP_LR x SWEEP_BETA (lr ascending, beta descending), the first point
    where a sweep seed collapses (else the last)."""
    sweep = []
    grid = [(lr, beta) for lr in SWEEP_LR for beta in SWEEP_BETA]
    for lr, beta in grid:
        collapsed = 0
        for seed in SWEEP_SEEDS:
            r = runner.run(f"sweep/lr{lr:g}_beta{beta:g}_seed{seed}", config, base, "grpo", seed, lr, beta)
            collapsed += r["collapse_step"] is not None
        sweep.append({"lr": lr, "beta": beta, "grpo_collapsed": collapsed, "seeds": list(SWEEP_SEEDS)})
        if collapsed:
            return lr, beta, sweep
    return grid[-1][0], grid[-1][1], sweep


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="2 seeds x 3 steps on tiny-qwen2, no sweep, no SmolLM2 (a smoke run)")
    p.add_argument("--seeds", type=int, default=5, help="toy-task seeds per arm")
    p.add_argument("--smollm2-seeds", type=int, default=2, help="SmolLM2 seeds per arm (0: none)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--lr", type=float, default=None, help="skip the sweep: this lr (with --beta)")
    p.add_argument("--beta", type=float, default=None, help="skip the sweep: this KL coefficient (with --lr)")
    p.add_argument("--work", type=Path, default=None, help="run folders (kept; finished runs are reused)")
    p.add_argument("--out", type=Path, default=None, help="the JSON (default benchmarks/results/stability.json; --quick: in --work)")
    args = p.parse_args(argv)
    if (args.lr is None) != (args.beta is None):
        p.error("--lr and --beta go together")
    if args.quick:
        args.seeds, args.smollm2_seeds, args.steps = 2, 0, 3
        args.lr, args.beta = args.lr or 1e-3, args.beta or 0.001
    work = args.work or Path(tempfile.mkdtemp(prefix="stability-"))
    out = args.out or (work / "stability.json" if args.quick else RESULTS / "stability.json")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from emapg.models import resolve_model
    from emapg.paths import CONFIG_DIR
    from retriever.launch import RetrieverServer
    from tests.fixtures.trainer import WARM_CACHE_STEPS, build_toy_task, cached_warm_start, toy_overrides

    task = build_toy_task(work / "task")
    report: dict[str, Any] = {"protocol": "benchmarks/stability.py docstring", "quick": args.quick, "steps": args.steps,
                              "machine": {"cpus": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}}
    runner = Runner(work, steps=args.steps, prompts=4 if args.quick else 8, samples=4, probe=4 if args.quick else 8)
    toy_config = CONFIG_DIR / "search_tiny_cpu.yaml"
    toy_runs: dict[str, dict[int, dict[str, Any]]] = {arm: {} for arm in [*ARMS, GUARDED]}
    with RetrieverServer(task.index_dir, omp_num_threads=1, device="cpu", topk=1) as server:
        start = cached_warm_start(Path(resolve_model("tiny-qwen2")), task, WARM_CACHE_STEPS)
        base = toy_overrides(task, server.url, work, **{"model.policy": str(start), "algorithm.micro_batch_size": 16})
        base = [o for o in base if not o.startswith("run.output_dir=")]
        if args.lr is None:
            args.lr, args.beta, report["sweep"] = choose_stress(runner, toy_config, base)
        report["stress"] = {"lr": args.lr, "beta": args.beta, "steps": args.steps, "chosen_by": "argument" if "sweep" not in report else "sweep"}
        for seed in range(args.seeds):
            for arm in toy_runs:
                toy_runs[arm][seed] = runner.run(f"toy/{arm}_seed{seed}", toy_config, base, arm, seed, args.lr, args.beta)
    report["toy"] = {"runs": toy_runs, **summarise(toy_runs)}
    if args.smollm2_seeds:
        report["smollm2"] = smollm2(runner, args, work)
    # the contract: the toy task's estimates at the top level (SmolLM2's beside them under "smollm2")
    report.update({k: v for k, v in report["toy"].items() if k != "runs"})
    out.parent.mkdir(parents=True, exist_ok=True)
    png = plot(toy_runs, out.with_suffix(".png"), f"toy search task, lr {args.lr:g}, beta {args.beta:g}, {args.steps} steps")
    out.write_text(json.dumps(report, indent=2))
    for arm in [*ARMS, GUARDED]:
        a = report[arm]
        print(f"{arm:12s} collapsed {a['collapsed']}/{len(a['seeds'])} = {a['collapse_rate']:.2f} "
              f"[{a['collapse_rate_ci'][0]:.2f}, {a['collapse_rate_ci'][1]:.2f}]")
    for s in report["signals"]:
        print(f"  {s['name']:18s} median lead {s['median_lead_steps']}, false trips {s['false_trip_rate']}")
    print(f"wrote {out} and {png}")
    return 0


def smollm2(runner: Runner, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The SmolLM2 arms: the shipped starter on the answerable training pool through the bundled index."""
    from emapg.models import STARTER
    from emapg.paths import CONFIG_DIR
    from provision.indexes import ensure_bundled_index
    from retriever.launch import RetrieverServer

    smol = Runner(work, steps=args.steps, prompts=4, samples=4, probe=8)
    runs: dict[str, dict[int, dict[str, Any]]] = {arm: {} for arm in SMOLLM2_ARMS}
    with RetrieverServer(ensure_bundled_index(), omp_num_threads=1, device="cpu", topk=3) as server:
        # groups of equal rewards are trained (topup), not dropped: every signal and the reward are over all sampled trajectories
        base = [f"model.policy={STARTER}", "data.train=qa_pool", "data.split=train", f"retriever.urls=[{server.url}]",
                "retriever.index_dir=null", "rollout.uniform_groups=topup"]
        for seed in range(args.smollm2_seeds):
            for arm in SMOLLM2_ARMS:
                runs[arm][seed] = smol.run(f"smollm2/{arm}_seed{seed}", CONFIG_DIR / "demo_search_smollm2.yaml", base, arm,
                                           seed, args.lr, args.beta)
    return {"runs": runs, **summarise(runs)}


if __name__ == "__main__":
    sys.exit(main())
