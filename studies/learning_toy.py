"""GRPO vs EMA-PG learning curves on the toy search task, same seeds, plot saved.

The toy task (``tests/fixtures/trainer.py``): 8 synthetic facts stating 4 different digits
(a constant answer scores 0.25) in a real MiniLM + FAISS index served by a real ``emapg serve``
process; tiny-qwen2 warm-started on held-out entities to search and copy the observed digit,
only about half the time (never on the RL facts); then RL through the production path (agent
loop, HTTP retrieval, reward, update). Both algorithms start from the same warm-started
weights and use the same seeds:

* ``grpo``  -- the paper's fair ablation (ALGORITHM.md §3.2): K3 KL (beta 0.001) to a frozen
  reference (eta = 1), clip 0.2 / 0.28;
* ``emapg`` -- Top-k reverse KL (k = 32, tail + IW, beta 0.001) to an EMA anchor
  (eta = 0.9, P = 10, ALGORITHM.md §1).

Writes ``benchmarks/results/learning_toy.json`` (per-step mean reward of each run, first/last
averages, and the evidence probe ``evidence_probs`` -- e.g. ``cf_obs``, P(answer = the digit an
observation states when it contradicts the fact) -- for the warm start and each final policy)
and ``benchmarks/results/learning_toy.png`` (reward, KL, length curves).

    python studies/learning_toy.py [--steps 40] [--seeds 0 1] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from studies import harness  # noqa: E402
RESULTS = harness.RESULTS

ALGOS = {
    "grpo": ["algorithm.name=grpo", "algorithm.kl.type=k3", "algorithm.kl.importance_weight=false", "algorithm.ema.decay=1.0"],
    "emapg": ["algorithm.name=emapg", "algorithm.kl.type=topk_reverse", "algorithm.kl.topk=32",
              "algorithm.kl.importance_weight=true", "algorithm.ema.decay=0.9", "algorithm.ema.period=10"],
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 40; --quick 20)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--quick", action="store_true", help="one seed, 20 steps")
    p.add_argument("--out", type=Path, default=RESULTS / "learning_toy.json", help="the report (its plot beside it, .png)")
    harness.add_arguments(p)
    args = p.parse_args(argv)
    if args.quick:
        args.seeds = [0]
    args.steps = args.steps or (20 if args.quick else 40)
    provenance = harness.start(__file__, quick=args.quick, allow_dirty=args.allow_dirty)
    harness.environment(OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    from emapg.config import load_config
    from emapg.models import resolve_model
    from emapg.paths import CONFIG_DIR
    from retriever.launch import RetrieverServer
    from tests.fixtures.trainer import (
        build_toy_task,
        evidence_probs,
        toy_overrides,
        warm_start,
    )
    from trainer.checkpoint import latest_checkpoint
    from trainer.config import TrainConfig
    from trainer.loop import train
    from trainer.plot import plot_runs

    work = Path(tempfile.mkdtemp(prefix="learning-toy-"))
    task = build_toy_task(work / "task")
    report: dict = {"steps": args.steps, "seeds": args.seeds, "lr": args.lr, "facts": task.facts, "runs": {}, "provenance": provenance}
    run_dirs, labels = [], []
    with RetrieverServer(task.index_dir, omp_num_threads=1, device="cpu", topk=1) as server:
        start = warm_start(Path(resolve_model("tiny-qwen2")), task, work / "warm_start")
        report["warm_start_evidence"] = evidence_probs(start, task)
        for algo, seed in harness.seeds_first(ALGOS, args.seeds):
            extra = ALGOS[algo]
            out = work / f"{algo}_seed{seed}"
            cfg = load_config(TrainConfig, CONFIG_DIR / "search_tiny_cpu.yaml", toy_overrides(
                task, server.url, out, **{"model.policy": str(start), "run.total_steps": args.steps, "run.seed": seed,
                                          "optim.lr": args.lr, "run.save_every": 0, "logging.progress": "false",
                                          "data.prompts_per_step": 8, "algorithm.mini_batch_size": 16,
                                          "algorithm.micro_batch_size": 16}) + extra)
            history = train(cfg)
            rewards = [h["reward/mean"] for h in history]
            k = max(1, len(rewards) // 5)
            evidence = evidence_probs(latest_checkpoint(out) / "policy", task)
            report["runs"][f"{algo}_seed{seed}"] = {
                "reward": rewards, "kl": [h.get("kl/mean") for h in history],
                "first_fifth_mean_reward": statistics.mean(rewards[:k]),
                "last_fifth_mean_reward": statistics.mean(rewards[-k:]),
                "final_evidence": evidence,
            }
            print(f"{algo:6s} seed {seed}: reward {statistics.mean(rewards[:k]):.3f} -> {statistics.mean(rewards[-k:]):.3f}; "
                  f"P(observed digit | contradicting observation) {report['warm_start_evidence']['cf_obs']:.2f} -> "
                  f"{evidence['cf_obs']:.2f}")
            run_dirs.append(out)
            labels.append(f"{algo} (seed {seed})")
    for algo in ALGOS:
        lasts = [r["last_fifth_mean_reward"] for name, r in report["runs"].items() if name.startswith(algo)]
        report[f"{algo}_last_fifth_mean_reward"] = statistics.mean(lasts)

    def plot(report: dict, path: Path) -> Path:
        return plot_runs(run_dirs, path, metrics=["reward/mean", "kl/mean", "response/length_mean"], labels=labels, smooth=3,
                         title="toy search task: GRPO vs EMA-PG (tiny-qwen2, real retriever)")

    harness.write_report(report, args.out, plot)
    print(f"wrote {args.out} and {report['plot']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
