"""GRPO vs EMA-PG on real questions: same starter, same seeds, same steps; held-out EM on all seven QA sets.

Both algorithms start from the starter search policy (``emapg.demo.STARTER_POLICY``: SmolLM2-135M-Instruct
warm-started as a search agent) and train on the bundled NQ + HotpotQA train questions
(:mod:`provision.training_mix`: every evaluation question removed) through the real retriever over
the bundled Wikipedia index, with the production trainer (:func:`trainer.loop.train`):

* ``grpo``  -- the paper's baseline as a fair ablation (ALGORITHM.md §3.2): K3 KL (beta 0.001) to the
  frozen starter (eta = 1), no importance weight;
* ``emapg`` -- Top-k reverse KL (k = 32, tail + IW, beta 0.001) to an EMA anchor (eta = 0.9, ALGORITHM.md
  §1; the period is scaled down with the number of steps: P = max(2, steps // 10)).

Everything else is the demo's training config (``configs/demo_search_smollm2.yaml``). Every
``--eval-every`` steps a checkpoint is evaluated (:func:`eval.runner.run_eval`, greedy ``qa_quick``) on the
same held-out questions (``--per-dataset`` per set, seeded sample of the test splits); the starter is
evaluated once (greedy: the same for every run). Outputs:

* ``benchmarks/results/learning_search.json`` -- per algorithm ``heldout_em_start``, ``heldout_em_end``
  (pooled percent over all held-out questions, mean over seeds), ``seeds``, per-seed curves (held-out EM
  and train reward per step), per-dataset final EM; the pooled EMA-PG − GRPO difference at the end with its
  paired bootstrap interval (per question, EM averaged over seeds); the mode and wall time;
* ``benchmarks/results/learning_search.png`` -- held-out pooled EM and train reward vs step, both
  algorithms, each seed.

    python benchmarks/learning_search.py            # default: 2 seeds x 8 steps, eval at start and end, 15 q/set (67.5 min on 2 cores)
    python benchmarks/learning_search.py --quick    # smoke run: tiny-qwen2, 2k-passage index, 2 steps, 2 q/set

The default is sized to 2 cores: measured 2026-12-01, a step of 16 trajectories takes 82-116 s, an
evaluation of the 105 questions ~3.5 min (vLLM start-up included), the whole default run 67.5 min.
Result of that run (benchmarks/results/learning_search.json): GRPO and EMA-PG both 11.4 -> 12.4 pooled EM,
difference +0.0 pp [-1.4, +1.4]; 30 of each run's 32 groups had all-zero rewards (no gradient), which
``--filter-groups`` (dynamic sampling, as in the demo) addresses.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
QA_SETS = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")

ALGOS = {
    "grpo": ["algorithm.name=grpo", "algorithm.kl.type=k3", "algorithm.kl.importance_weight=false", "algorithm.ema.decay=1.0"],
    "emapg": ["algorithm.name=emapg", "algorithm.kl.type=topk_reverse", "algorithm.kl.topk=32",
              "algorithm.kl.importance_weight=true", "algorithm.ema.decay=0.9"],
}


def mode_settings(args: argparse.Namespace) -> dict[str, Any]:
    """What runs: the starter, its training config, the index, the evaluation protocol."""
    from emapg.demo import STARTER_POLICY
    from emapg.paths import CONFIG_DIR

    if args.quick:
        return {"mode": "quick", "policy": "tiny-qwen2", "config": CONFIG_DIR / "search_tiny_cpu.yaml", "index_limit": 2000,
                "engine": "hf", "protocol": {"max_tokens": 24, "max_turns": 2}, "extra": ["logging.tensorboard=false"]}
    return {"mode": "default" if not args.reduced else "reduced", "policy": args.policy or STARTER_POLICY,
            "config": CONFIG_DIR / "demo_search_smollm2.yaml", "index_limit": None, "engine": "vllm", "protocol": {}, "extra": []}


def evaluate(model: str, out: Path, url: str, settings: dict[str, Any], per_dataset: int) -> Path:
    from eval.protocols import get_protocol
    from eval.runner import EvalConfig, run_eval

    cfg = EvalConfig(model=model, out=str(out), protocol=get_protocol("qa_quick", **settings["protocol"]),
                     datasets=list(QA_SETS), limit=per_dataset, data_seed=0, engine=settings["engine"], retriever_url=url,
                     progress=False, name=out.name)
    run_eval(cfg)
    return out


def pooled_em(start_dir: Path, run_dir: Path) -> float:
    from eval.learning import compare_learning

    return compare_learning(start_dir, run_dir, list(QA_SETS), resamples=1)["pooled"]["trained"]


def per_question_em(eval_dirs: list[Path]) -> dict[str, float]:
    """Question id -> EM averaged over the given runs (seeds)."""
    from eval.learning import paired_items

    sums: dict[str, float] = {}
    for d in eval_dirs:
        for ds, p in paired_items(d, d, list(QA_SETS)).items():
            for qid, em in zip(p.ids, p.base):
                sums[f"{ds}/{qid}"] = sums.get(f"{ds}/{qid}", 0.0) + em / len(eval_dirs)
    return sums


def plot(report: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_em, ax_r) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"grpo": "tab:blue", "emapg": "tab:red"}
    for alg, runs in report["runs"].items():
        for i, (seed, run) in enumerate(runs.items()):
            style = ["-", "--", ":", "-."][i % 4]
            ax_em.plot(run["eval_steps"], run["heldout_em"], style, marker="o", color=colors[alg], label=f"{alg} seed {seed}")
            ax_r.plot(run["train_steps"], run["train_reward"], style, color=colors[alg], label=f"{alg} seed {seed}",
                      marker="o" if len(run["train_steps"]) <= 30 else None, markersize=3)
    ax_em.set_title(f"held-out EM, pooled over {report['heldout']['questions']} questions (7 QA sets)")
    ax_em.set_ylabel("EM (%)")
    ax_r.set_title("train reward (EM of the sampled group), every step")
    for ax in (ax_em, ax_r):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"GRPO (K3, frozen reference) vs EMA-PG (Top-k reverse KL, EMA anchor) from {report['policy']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: tiny-qwen2 on a 2k-passage index, 2 steps, 2 questions per set")
    p.add_argument("--reduced", action="store_true", help="the default models with fewer steps/questions (give --steps etc.)")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 8; quick 2)")
    p.add_argument("--eval-every", type=int, default=None, help="evaluate every this many steps (default: only at the end; quick 2)")
    p.add_argument("--per-dataset", type=int, default=None, help="held-out questions per QA set (default 15, the demo's; quick 2)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--policy", default=None, help="starter policy (default emapg.demo.STARTER_POLICY)")
    p.add_argument("--filter-groups", action="store_true",
                   help="dynamic sampling for both algorithms (rollout.filter_groups, as in the demo); default off: the "
                        "paper's protocol, every sampled group trained on")
    p.add_argument("--out", default=str(RESULTS / "learning_search.json"))
    p.add_argument("--work", default=None, help="folder for runs and evaluations (default: a temp folder, removed)")
    args = p.parse_args(argv)
    steps = args.steps or (2 if args.quick else 8)
    eval_every = args.eval_every or (2 if args.quick else steps)
    per_dataset = args.per_dataset or (2 if args.quick else 15)
    if len(args.seeds) < 2 and not args.quick:
        p.error("give at least 2 seeds")
    # OMP_NUM_THREADS is left to the caller (torch then uses every core for the training passes); forcing 1
    # would halve the training speed of the default mode on 2 cores.
    for k, v in {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_KVCACHE_SPACE": "1"}.items():
        os.environ.setdefault(k, v)

    from emapg.config import load_config
    from eval.learning import compare_learning
    from eval.significance import paired_bootstrap
    from provision.indexes import ensure_bundled_index
    from provision.retrievers import open_retriever
    from provision.training_mix import write_training_mix
    from trainer.checkpoint import step_dir_name
    from trainer.config import TrainConfig
    from trainer.loop import train
    from trainer.tracking import read_metrics

    t0 = time.perf_counter()
    settings = mode_settings(args)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="learning-search-"))
    work.mkdir(parents=True, exist_ok=True)
    mix = write_training_mix(work / "train_questions.jsonl")
    index_dir = ensure_bundled_index(settings["index_limit"])
    eval_steps = sorted({s for s in range(eval_every, steps + 1, eval_every)} | {steps})
    report: dict[str, Any] = {
        "benchmark": "learning_search", "mode": settings["mode"], "policy": settings["policy"], "steps": steps,
        "eval_steps": [0, *eval_steps], "seeds": list(args.seeds), "train_questions": mix.kept,
        "filter_groups": args.filter_groups,
        "heldout": {"datasets": list(QA_SETS), "per_dataset": per_dataset, "questions": per_dataset * len(QA_SETS),
                    "data_seed": 0, "protocol": "qa_quick (greedy)"},
        "algorithms": {alg: " ".join(o for o in ov if not o.startswith("algorithm.name")) for alg, ov in ALGOS.items()},
        "runs": {alg: {} for alg in ALGOS},
    }
    final_dirs: dict[str, list[Path]] = {alg: [] for alg in ALGOS}
    with open_retriever(index_dir=index_dir, log_path=work / "retriever.log") as retriever:
        url = retriever.urls[0]
        start_dir = evaluate(settings["policy"], work / "eval_start", url, settings, per_dataset)
        em_start = pooled_em(start_dir, start_dir)
        print(f"[learning_search] starter: held-out pooled EM {em_start:.1f}", flush=True)
        for seed in args.seeds:
            for alg, algo_overrides in ALGOS.items():
                run_dir = work / f"{alg}-seed{seed}"
                overrides = [f"model.policy={settings['policy']}", f"data.train={mix.path}", f"retriever.urls=[{url}]",
                             "retriever.index_dir=null", f"run.output_dir={run_dir}", f"run.seed={seed}",
                             f"run.total_steps={steps}", f"run.save_every={eval_every}", f"run.keep_last={len(eval_steps) + 1}",
                             "logging.progress=false", f"algorithm.ema.period={max(2, steps // 10)}",
                             f"rollout.filter_groups={str(args.filter_groups).lower()}",
                             *settings["extra"], *algo_overrides]  # fmt: skip
                t_run = time.perf_counter()
                train(load_config(TrainConfig, settings["config"], overrides))
                t_train = time.perf_counter() - t_run
                ems = [em_start]
                for s in eval_steps:
                    ckpt = run_dir / step_dir_name(s)
                    ems.append(pooled_em(start_dir, evaluate(str(ckpt / "policy"), run_dir / f"eval_step{s}", url, settings,
                                                             per_dataset)))
                    shutil.rmtree(ckpt, ignore_errors=True)  # fp32 policy + anchor + optimizer: ~2 GB each
                metrics = read_metrics(run_dir)
                final_dir = run_dir / f"eval_step{eval_steps[-1]}"
                final_dirs[alg].append(final_dir)
                per_ds = compare_learning(start_dir, final_dir, list(QA_SETS), resamples=1)["datasets"]
                report["runs"][alg][str(seed)] = {
                    "eval_steps": [0, *eval_steps], "heldout_em": ems,
                    "train_steps": [int(r["step"]) for r in metrics], "train_reward": [float(r["reward/mean"]) for r in metrics],
                    "format_rate": [float(r.get("response/answered_frac", float("nan"))) for r in metrics],
                    "per_dataset_end": {ds: b["trained"] for ds, b in per_ds.items()},
                    "train_s": round(t_train, 1), "run_s": round(time.perf_counter() - t_run, 1),
                }
                print(f"[learning_search] {alg} seed {seed}: held-out pooled EM {' -> '.join(f'{e:.1f}' for e in ems)} "
                      f"(train {t_train / 60:.1f} min)", flush=True)

    for alg in ALGOS:
        runs = report["runs"][alg].values()
        report[alg] = {
            "heldout_em_start": em_start,
            "heldout_em_end": statistics.mean(r["heldout_em"][-1] for r in runs),
            "heldout_em_end_per_seed": [r["heldout_em"][-1] for r in runs],
            "seeds": list(args.seeds),
            "per_dataset_end": {ds: statistics.mean(r["per_dataset_end"][ds] for r in runs) for ds in QA_SETS},
            "train_reward_last": statistics.mean(r["train_reward"][-1] for r in runs),
        }

    def difference(a: dict[str, float], b: dict[str, float]) -> dict[str, Any]:
        keys = sorted(a)
        d = paired_bootstrap([a[k] for k in keys], [b[k] for k in keys])
        return {"mean": 100 * d.mean, "low": 100 * d.low, "high": 100 * d.high, "n": d.n, "confidence": d.confidence,
                "method": "paired bootstrap over held-out questions (per question: EM averaged over seeds), percentile interval"}

    start_q = per_question_em([start_dir])
    end_q = {alg: per_question_em(final_dirs[alg]) for alg in ALGOS}
    for alg in ALGOS:
        report[alg]["end_minus_start"] = difference(start_q, end_q[alg])
    report["emapg_minus_grpo_end"] = difference(end_q["grpo"], end_q["emapg"])
    start_per_ds = compare_learning(start_dir, start_dir, list(QA_SETS), resamples=1)["datasets"]
    report["start_per_dataset"] = {ds: b["base"] for ds, b in start_per_ds.items()}
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    report["machine"] = {"cpus": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report["plot"] = str(plot(report, out.with_suffix(".png")))
    out.write_text(json.dumps(report, indent=2) + "\n")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\nheld-out EM per dataset at step {steps} (mean over seeds {args.seeds}; start = the starter):")
    print(f"{'dataset':<18}{'start':>8}{'grpo':>8}{'emapg':>8}")
    for ds in QA_SETS:
        print(f"{ds:<18}{report['start_per_dataset'][ds]:>8.1f}{report['grpo']['per_dataset_end'][ds]:>8.1f}{report['emapg']['per_dataset_end'][ds]:>8.1f}")
    print(f"{'pooled':<18}{em_start:>8.1f}{report['grpo']['heldout_em_end']:>8.1f}{report['emapg']['heldout_em_end']:>8.1f}")
    d = report["emapg_minus_grpo_end"]
    print(f"EMA-PG - GRPO at step {steps}: {d['mean']:+.1f} pp (95% CI [{d['low']:+.1f}, {d['high']:+.1f}], n={d['n']}); "
          f"mode {settings['mode']}, wall {report['wall_s'] / 60:.1f} min")
    print(f"wrote {out} and {report['plot']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
