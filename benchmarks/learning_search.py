"""GRPO vs EMA-PG on real questions: same starter, same seeds, same steps; held-out EM on all seven QA sets.

Both algorithms start from the starter search policy (``emapg.models.STARTER``: SmolLM2-135M-Instruct
warm-started as a search agent on the training pool) and train on the **answerable training pool**
(``qa_pool``, ``data/qa/pool/``: bundled QA questions outside every held-out split whose answer is in the
top-3 passages of the bundled index; ``scripts/build_qa_pool.py``) through the real retriever over the
bundled Wikipedia index, with the production trainer (:func:`trainer.loop.train`):

* ``grpo``  -- the paper's baseline as a fair ablation (ALGORITHM.md §3.2): K3 KL (beta 0.001) to the
  frozen starter (eta = 1), no importance weight;
* ``emapg`` -- Top-k reverse KL (k = 32, tail + IW, beta 0.001) to an EMA anchor (eta = 0.9, ALGORITHM.md
  §1; the period is scaled down with the number of steps: P = max(2, steps // 10)).

Everything else is the demo's training config (``configs/demo_search_smollm2.yaml``). The starter and the
checkpoints at the middle and the end are evaluated (:func:`eval.runner.run_eval`, greedy ``qa_quick``) on
the same **held-out** questions: ``--per-dataset`` per QA set, the seeded sample at data seed 0, which is a
subset of the recorded held-out split (``data/qa/heldout.json``; checked) that no training, warm-start or
selection touched. Outputs:

* ``benchmarks/results/learning_search.json`` -- per algorithm ``heldout_em_start``, ``heldout_em_end``
  (pooled percent over all held-out questions, mean over seeds), ``end_minus_start_ci`` ([low, high], pp,
  paired bootstrap over questions with EM averaged over seeds), ``seeds``, per-seed curves (held-out EM,
  train reward and informative-group fraction per step), per-dataset EM at the end; the pooled EMA-PG − GRPO
  difference with its interval; ``heldout_questions``; informative groups trained per minute of training;
  the mode and wall time;
* ``benchmarks/results/learning_search.png`` -- held-out pooled EM, train reward and informative-group
  fraction vs step, both algorithms, each seed.

    python benchmarks/learning_search.py            # default: 2 seeds x 8 steps, 50 q/set (350), eval at 0/4/8
    python benchmarks/learning_search.py --quick    # smoke run: tiny-qwen2, 2k-passage index, 2 steps, 2 q/set
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
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
TRAIN_SET = "qa_pool"  # default: the answerable training pool (data/qa/pool/)

ALGOS = {
    "grpo": ["algorithm.name=grpo", "algorithm.kl.type=k3", "algorithm.kl.importance_weight=false", "algorithm.ema.decay=1.0"],
    "emapg": ["algorithm.name=emapg", "algorithm.kl.type=topk_reverse", "algorithm.kl.topk=32",
              "algorithm.kl.importance_weight=true", "algorithm.ema.decay=0.9"],
}


def qa_sets() -> tuple[str, ...]:
    from tasks.datasets import QA_DATASETS

    return QA_DATASETS


def mode_settings(args: argparse.Namespace) -> dict[str, Any]:
    """What runs: the starter, its training config, the index, the evaluation protocol."""
    from emapg.models import STARTER
    from emapg.paths import CONFIG_DIR

    if args.quick:
        return {"mode": "quick", "policy": "tiny-qwen2", "config": CONFIG_DIR / "search_tiny_cpu.yaml", "index_limit": 2000,
                "engine": "hf", "protocol": {"max_tokens": 24, "max_turns": 2}, "extra": ["logging.tensorboard=false"]}
    return {"mode": "default" if not args.reduced else "reduced", "policy": args.policy or STARTER,
            "config": CONFIG_DIR / "demo_search_smollm2.yaml", "index_limit": None, "engine": "vllm", "protocol": {}, "extra": []}


def evaluate(model: str, out: Path, url: str, engine_url: str, settings: dict[str, Any], per_dataset: int) -> Path:
    """Greedy held-out evaluation of ``model`` on the shared engine server (its weights loaded into it first)."""
    from eval.protocols import get_protocol
    from eval.runner import EvalConfig, run_eval

    cfg = EvalConfig(model=model, out=str(out), protocol=get_protocol("qa_quick", **settings["protocol"]),
                     datasets=list(qa_sets()), limit=per_dataset, data_seed=0, engine="remote", engine_urls=[engine_url],
                     retriever_url=url, progress=False, name=out.name, batch_across_datasets=True,
                     batch_size=per_dataset * len(qa_sets()))
    run_eval(cfg)
    check_heldout(out)
    return out


def check_heldout(eval_dir: Path) -> None:
    """Every question an evaluation scored is in the recorded held-out split (data/qa/heldout.json)."""
    from eval.learning import paired_items
    from tasks.datasets import heldout_ids

    for ds, p in paired_items(eval_dir, eval_dir, list(qa_sets())).items():
        outside = set(p.ids) - set(heldout_ids(ds))
        if outside:
            raise RuntimeError(f"{eval_dir}: {len(outside)} evaluated {ds} questions are not held out, e.g. {sorted(outside)[:3]}")


def pooled_em(start_dir: Path, run_dir: Path) -> float:
    from eval.learning import compare_learning

    return compare_learning(start_dir, run_dir, list(qa_sets()), resamples=1)["pooled"]["trained"]


def per_question_em(eval_dirs: list[Path]) -> dict[str, float]:
    """Question id -> EM averaged over the given runs (seeds)."""
    from eval.learning import paired_items

    sums: dict[str, float] = {}
    for d in eval_dirs:
        for ds, p in paired_items(d, d, list(qa_sets())).items():
            for qid, em in zip(p.ids, p.base):
                sums[f"{ds}/{qid}"] = sums.get(f"{ds}/{qid}", 0.0) + em / len(eval_dirs)
    return sums


def informative_fraction(row: dict[str, float]) -> float:
    """The share of a step's first prompt batch whose groups have differing rewards (a policy gradient):
    with dynamic sampling the first round's share, else one minus the zero-variance share of the batch."""
    if "filter/first_round_informative_frac" in row:
        return float(row["filter/first_round_informative_frac"])
    return 1.0 - float(row["reward/zero_variance_groups"])


def trained_informative_groups(row: dict[str, float], groups_per_step: int) -> float:
    """Informative groups the step trained on (after dynamic sampling when on)."""
    frac = row.get("filter/informative_frac", 1.0 - float(row["reward/zero_variance_groups"]))
    return float(frac) * groups_per_step


def keep_policy_only(ckpt: Path) -> None:
    """Remove a checkpoint's training state (optimizer, anchor, sharded state), keeping ``policy/`` (weights, tokenizer)
    and the manifest/provenance files beside it, so the trained weights stay evaluable after the run."""
    for f in ckpt.iterdir():
        if f.name == "policy" or (f.is_file() and f.suffix in (".json", ".yaml", ".txt")):
            continue
        shutil.rmtree(f, ignore_errors=True) if f.is_dir() else f.unlink()


def plot(report: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_em, ax_r, ax_i) = plt.subplots(1, 3, figsize=(15, 4))
    colors = {"grpo": "tab:blue", "emapg": "tab:red"}
    for alg, runs in report["runs"].items():
        for i, (seed, run) in enumerate(runs.items()):
            style = ["-", "--", ":", "-."][i % 4]
            label = f"{alg} seed {seed}"
            ax_em.plot(run["eval_steps"], run["heldout_em"], style, marker="o", color=colors[alg], label=label)
            marker = "o" if len(run["train_steps"]) <= 30 else None
            ax_r.plot(run["train_steps"], run["train_reward"], style, color=colors[alg], label=label, marker=marker, markersize=3)
            if run.get("sampled_reward"):  # every trajectory sampled, filtered rounds included: not selected by reward
                ax_r.plot(run["train_steps"], run["sampled_reward"], style, color=colors[alg], alpha=0.35,
                          label=f"{label}, all sampled")
            if run.get("informative_frac"):
                ax_i.plot(run["train_steps"], run["informative_frac"], style, color=colors[alg], label=label, marker=marker,
                          markersize=3)
    ax_em.set_title(f"held-out EM, pooled over {report['heldout']['questions']} questions (7 QA sets)")
    ax_em.set_ylabel("EM (%)")
    ax_r.set_title("train reward (EM; pale: every trajectory sampled)")
    ax_i.set_title("groups with differing rewards (first prompt batch)")
    ax_i.set_ylim(-0.02, 1.02)
    for ax in (ax_em, ax_r, ax_i):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=7)
        else:  # e.g. the informative fraction of runs that logged none
            ax.text(0.5, 0.5, "not logged by these runs", ha="center", va="center", transform=ax.transAxes, color="gray")
    names = {"grpo": "GRPO (K3, frozen reference)", "emapg": "EMA-PG (Top-k reverse KL, EMA anchor)"}
    fig.suptitle(f"{' vs '.join(names[a] for a in report['runs'])} from {report['policy']}, "
                 f"trained on {report.get('train_set', TRAIN_SET)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: tiny-qwen2 on a 2k-passage index, 2 steps, 2 questions per set")
    p.add_argument("--reduced", action="store_true", help="the default models with fewer steps/questions (give --steps etc.)")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 8, the demo's; quick 2)")
    p.add_argument("--eval-every", type=int, default=None, help="evaluate every this many steps (default: steps // 2, i.e. the "
                   "middle and the end; quick 1)")
    p.add_argument("--per-dataset", type=int, default=None, help="held-out questions per QA set (<= 100, the held-out split's "
                   "size; default 50, i.e. 350 questions; quick 2)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="training seeds (at least 2, except with --reduced)")
    p.add_argument("--algorithms", nargs="+", choices=sorted(ALGOS), default=list(ALGOS),
                   help="which algorithms to train (default both; the contract file needs both): one alone makes a "
                   "dose-response run, e.g. --reduced --algorithms emapg --seeds 0 --steps 40 --eval-every 10")
    p.add_argument("--train-set", default=TRAIN_SET, help="training questions: qa_pool (the answerable pool) or "
                   "qa_pool_informative (its subset the starter solves sometimes; what make demo trains on)")
    p.add_argument("--policy", default=None, help="starter policy (default emapg.models.STARTER)")
    p.add_argument("--no-filter-groups", dest="filter_groups", action="store_false",
                   help="turn dynamic sampling (rollout.filter_groups, the demo config's setting) off for both algorithms")
    p.add_argument("--override", action="append", default=[], help="a dotted training override for both algorithms (repeatable)")
    p.add_argument("--out", default=str(RESULTS / "learning_search.json"))
    p.add_argument("--keep-final", action="store_true", help="keep each run's last checkpoint's policy/ folder (its weights, "
                   "for e.g. greedy_vs_sampled.py --trained; the optimizer and anchor are removed); needs --work")
    p.add_argument("--work", default=None, help="folder for runs and evaluations (default: a temp folder, removed)")
    args = p.parse_args(argv)
    steps = args.steps or (2 if args.quick else 8)
    eval_every = args.eval_every or (1 if args.quick else max(1, steps // 2))
    per_dataset = args.per_dataset or (2 if args.quick else 50)
    if len(args.seeds) < 2 and not (args.quick or args.reduced):
        p.error("give at least 2 seeds (or --reduced for a one-seed run)")
    algos = {alg: ov for alg, ov in ALGOS.items() if alg in args.algorithms}
    if len(algos) < len(ALGOS) and Path(args.out).resolve() == (RESULTS / "learning_search.json").resolve():
        p.error("--algorithms with one algorithm: give --out (benchmarks/results/learning_search.json holds both)")
    if args.keep_final and not args.work:
        p.error("--keep-final needs --work (the default work folder is removed at the end)")
    if not 1 <= per_dataset <= 100:
        p.error("--per-dataset must be in [1, 100]: the held-out split holds 100 questions per QA set")
    # OMP_NUM_THREADS is left to the caller (torch then uses every core for the training passes); forcing 1
    # would halve the training speed of the default mode on 2 cores.
    for k, v in {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_KVCACHE_SPACE": "3"}.items():
        os.environ.setdefault(k, v)

    from agent.engines.launch import EngineServer
    from emapg.config import load_config
    from eval.learning import answer_changes, compare_learning, miss_breakdown
    from eval.significance import paired_bootstrap
    from provision.indexes import ensure_bundled_index
    from provision.retrievers import open_retriever
    from tasks.datasets import load_dataset
    from trainer.checkpoint import step_dir_name
    from trainer.config import TrainConfig
    from trainer.loop import train
    from trainer.tracking import read_metrics

    t0 = time.perf_counter()
    settings = mode_settings(args)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="learning-search-"))
    work.mkdir(parents=True, exist_ok=True)
    pool_sources: dict[str, int] = {}
    for ex in load_dataset(args.train_set, split="train"):
        pool_sources[ex.meta.get("origin", ex.data_source)] = pool_sources.get(ex.meta.get("origin", ex.data_source), 0) + 1
    index_dir = ensure_bundled_index(settings["index_limit"])
    eval_steps = sorted({s for s in range(eval_every, steps + 1, eval_every)} | {steps})
    base_cfg = load_config(TrainConfig, settings["config"], list(args.override))  # the settings runs train with
    groups_per_step = base_cfg.data.prompts_per_step
    report: dict[str, Any] = {
        "benchmark": "learning_search", "mode": settings["mode"], "policy": settings["policy"], "steps": steps,
        "eval_steps": [0, *eval_steps], "seeds": list(args.seeds), "train_set": args.train_set, "train_questions": pool_sources,
        "filter_groups": args.filter_groups, "overrides": args.override,
        "engine": f"one `emapg engine serve --engine {settings['engine']}` shared by every run and evaluation",
        "rollout": {"group_size": base_cfg.rollout.n_samples, "prompts_per_step": groups_per_step,
                    "temperature": base_cfg.rollout.temperature},
        "heldout": {"datasets": list(qa_sets()), "per_dataset": per_dataset, "questions": per_dataset * len(qa_sets()),
                    "data_seed": 0, "split": "subset of data/qa/heldout.json", "protocol": "qa_quick (greedy)"},
        "heldout_questions": per_dataset * len(qa_sets()),
        "algorithms": {alg: " ".join(o for o in ov if not o.startswith("algorithm.name")) for alg, ov in algos.items()},
        "runs": {alg: {} for alg in algos},
    }
    final_dirs: dict[str, list[Path]] = {alg: [] for alg in algos}
    # One generation engine server for every run and evaluation (as `make demo`): each evaluation loads its
    # checkpoint's weights into it, each training run pushes its policy's weights before every rollout; the
    # engine starts once instead of once per run and per evaluation (vLLM: ~40 s each, 13 times by default).
    r = base_cfg.rollout
    with open_retriever(index_dir=index_dir, log_path=work / "retriever.log") as retriever, \
            EngineServer(settings["policy"], engine=settings["engine"], max_model_len=r.max_prompt_tokens + r.max_response_tokens,
                         omp_num_threads=os.cpu_count() or 1, startup_timeout=900, log_path=work / "engine.log") as engine:  # fmt: skip
        url = retriever.urls[0]
        start_dir = evaluate(settings["policy"], work / "eval_start", url, engine.url, settings, per_dataset)
        em_start = pooled_em(start_dir, start_dir)
        print(f"[learning_search] starter: held-out pooled EM {em_start:.1f}", flush=True)
        for seed in args.seeds:
            for alg, algo_overrides in algos.items():
                run_dir = work / f"{alg}-seed{seed}"
                overrides = [f"model.policy={settings['policy']}", f"data.train={args.train_set}", "data.split=train",
                             f"retriever.urls=[{url}]", "retriever.index_dir=null", "rollout.engine=remote",
                             f"rollout.engine_urls=[{engine.url}]", f"run.output_dir={run_dir}",
                             f"run.seed={seed}", f"run.total_steps={steps}", f"run.save_every={eval_every}",
                             f"run.keep_last={len(eval_steps) + 1}", "logging.progress=false",
                             f"algorithm.ema.period={max(2, steps // 10)}",
                             f"rollout.filter_groups={str(args.filter_groups).lower()}",
                             *settings["extra"], *args.override, *algo_overrides]  # fmt: skip
                t_run = time.perf_counter()
                train(load_config(TrainConfig, settings["config"], overrides))
                t_train = time.perf_counter() - t_run
                ems = [em_start]
                for s in eval_steps:
                    ckpt = run_dir / step_dir_name(s)
                    ems.append(pooled_em(start_dir, evaluate(str(ckpt / "policy"), run_dir / f"eval_step{s}", url, engine.url, settings,
                                                             per_dataset)))
                    if args.keep_final and s == eval_steps[-1]:
                        keep_policy_only(ckpt)
                    else:
                        shutil.rmtree(ckpt, ignore_errors=True)  # fp32 policy + anchor + optimizer: ~2 GB each
                metrics = read_metrics(run_dir)
                final_dir = run_dir / f"eval_step{eval_steps[-1]}"
                final_dirs[alg].append(final_dir)
                per_ds = compare_learning(start_dir, final_dir, list(qa_sets()), resamples=1)["datasets"]
                informative_trained = sum(trained_informative_groups(r, groups_per_step) for r in metrics)
                report["runs"][alg][str(seed)] = {
                    "eval_steps": [0, *eval_steps], "heldout_em": ems,
                    "train_steps": [int(r["step"]) for r in metrics], "train_reward": [float(r["reward/mean"]) for r in metrics],
                    "sampled_reward": [float(r.get("filter/sampled_reward_mean", r["reward/mean"])) for r in metrics],
                    "informative_frac": [informative_fraction(r) for r in metrics],
                    "format_rate": [float(r.get("response/answered_frac", float("nan"))) for r in metrics],
                    "step_s": [float(r.get("time/step", float("nan"))) for r in metrics],
                    "per_dataset_end": {ds: b["trained"] for ds, b in per_ds.items()},
                    "informative_groups_trained": informative_trained,
                    "informative_groups_per_train_min": informative_trained / (t_train / 60),
                    "train_s": round(t_train, 1), "run_s": round(time.perf_counter() - t_run, 1),
                }
                print(f"[learning_search] {alg} seed {seed}: held-out pooled EM {' -> '.join(f'{e:.1f}' for e in ems)} "
                      f"(train {t_train / 60:.1f} min, {informative_trained:.0f} informative groups trained)", flush=True)

    def difference(a: dict[str, float], b: dict[str, float]) -> dict[str, Any]:
        keys = sorted(a)
        d = paired_bootstrap([a[k] for k in keys], [b[k] for k in keys])
        return {"mean": 100 * d.mean, "low": 100 * d.low, "high": 100 * d.high, "n": d.n, "confidence": d.confidence,
                "method": "paired bootstrap over held-out questions (per question: EM averaged over seeds), percentile interval"}

    start_q = per_question_em([start_dir])
    for alg in algos:
        runs = list(report["runs"][alg].values())
        end_q = per_question_em(final_dirs[alg])
        d = difference(start_q, end_q)
        mid = len(eval_steps) // 2 - 1 if len(eval_steps) > 1 else 0
        report[alg] = {
            "heldout_em_start": em_start,
            "heldout_em_middle": statistics.mean(r["heldout_em"][1 + mid] for r in runs),
            "heldout_em_end": statistics.mean(r["heldout_em"][-1] for r in runs),
            "heldout_em_end_per_seed": [r["heldout_em"][-1] for r in runs],
            "end_minus_start": d,
            "end_minus_start_ci": [d["low"], d["high"]],
            "seeds": list(args.seeds),
            "per_dataset_end": {ds: statistics.mean(r["per_dataset_end"][ds] for r in runs) for ds in qa_sets()},
            "train_reward_first": statistics.mean(r["train_reward"][0] for r in runs),
            "train_reward_last": statistics.mean(r["train_reward"][-1] for r in runs),
            "informative_frac_first_step": statistics.mean(r["informative_frac"][0] for r in runs),
            "informative_frac_mean": statistics.mean(statistics.mean(r["informative_frac"]) for r in runs),
            "informative_groups_per_train_min": statistics.mean(r["informative_groups_per_train_min"] for r in runs),
        }
    if len(algos) == len(ALGOS):
        report["emapg_minus_grpo_end"] = difference(per_question_em(final_dirs["grpo"]), per_question_em(final_dirs["emapg"]))
    # where the answers stand (right / wrong with a gold answer shown / wrong without it; searches made)
    report["misses"] = {"start": asdict(miss_breakdown(start_dir, list(qa_sets()))),
                        **{f"{alg}_end": [asdict(miss_breakdown(d, list(qa_sets()))) for d in final_dirs[alg]] for alg in algos}}
    # how many greedy answers each run changed, and which (a pooled difference near zero can hide many that cancel)
    report["answer_changes"] = {f"{alg}_end": [asdict(answer_changes(start_dir, d, list(qa_sets()))) for d in final_dirs[alg]]
                                for alg in algos}
    start_per_ds = compare_learning(start_dir, start_dir, list(qa_sets()), resamples=1)["datasets"]
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
    print("".join([f"{'dataset':<18}{'start':>8}", *(f"{alg:>8}" for alg in algos)]))
    for ds in qa_sets():
        print("".join([f"{ds:<18}{report['start_per_dataset'][ds]:>8.1f}", *(f"{report[alg]['per_dataset_end'][ds]:>8.1f}" for alg in algos)]))
    print("".join([f"{'pooled':<18}{em_start:>8.1f}", *(f"{report[alg]['heldout_em_end']:>8.1f}" for alg in algos)]))
    for alg in algos:
        d = report[alg]["end_minus_start"]
        print(f"{alg} end - start: {d['mean']:+.1f} pp (95% CI [{d['low']:+.1f}, {d['high']:+.1f}], n={d['n']})")
    if "emapg_minus_grpo_end" in report:
        d = report["emapg_minus_grpo_end"]
        print(f"EMA-PG - GRPO at step {steps}: {d['mean']:+.1f} pp (95% CI [{d['low']:+.1f}, {d['high']:+.1f}], n={d['n']})")
    print(f"mode {settings['mode']}, wall {report['wall_s'] / 60:.1f} min")
    print(f"wrote {out} and {report['plot']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
