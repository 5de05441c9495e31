"""GRPO vs EMA-PG vs a random-reward control on real questions, measured the way small compute can show learning.

PRE-REGISTERED PROTOCOL (written and committed before the run it describes; 2026-12-04)
=====================================================================================

Question. Does RL from the shipped starter search policy improve its answers on held-out questions it never saw,
and does EMA-PG differ from GRPO, within a CPU budget?

Starter and training. Every run starts from ``emapg.models.STARTER`` (SmolLM2-135M-Instruct warm-started as a
search agent) and trains with the production trainer (:func:`trainer.loop.train`) on the demo's training config
(``configs/demo_search_smollm2.yaml``): fresh questions of the **answerable training pool** (``qa_pool``: bundled
questions outside every held-out split whose answer the bundled index retrieves; the seeded epoch sampler repeats
none within a run shorter than the pool), groups of equal rewards dropped with their KL term
(``rollout.uniform_groups=drop``), bf16 autocast on CPUs with native bf16 (``run.precision=bf16``), the real
retriever over the bundled Wikipedia index, one shared ``emapg engine serve`` (vLLM) for every run and evaluation.

Arms, same seeds, same steps, same questions (each seed's sampler draws the same questions in every arm):

* ``grpo``    -- the paper's baseline as a fair ablation (ALGORITHM.md §3.2): K3 KL (beta 0.001) to the frozen
  starter (eta = 1), no importance weight;
* ``emapg``   -- Top-k reverse KL (k = 32, tail + IW, beta 0.001) to an EMA anchor (eta = 0.9; period
  P = max(2, steps // 10));
* ``control`` -- ``emapg`` with ``reward.shuffle_control``: each batch's rewards permuted across its trajectories,
  so the run trains at the same reward rate on rewards unrelated to its answers (Shao et al. 2025 report random
  rewards lifting some models; a gain must beat this).

Off-protocol arm (added 2026-12-05 before its run; never in the contract file): ``emapg_lora`` -- ``emapg`` with
LoRA r 16 (alpha 32) on every linear layer at lr 2e-4 (10x the config's full fine-tuning 2e-5, "LoRA Without
Regret"), for issue #41's question of which update learns most per minute (``reader_pp_per_train_min``), run as
``--algorithms emapg emapg_lora --seeds 0 --reduced --out <another file>``; with it the report holds
``emapg_lora_minus_emapg`` on the seeds both ran.

Seeds 0, 1, 2. Steps: 12 (default). The starter is scored twice on the reader slice with two sampling seeds (A
and B) so the instrument's own noise is on the page.

Instrument (decided before any run, from no RL result):

* **Reader slice** (primary): the held-out questions whose gold answer the starter was shown in its greedy
  evaluation (``data/qa/reader_slice.json``, :mod:`eval.reader_slice`, recorded with its rule and the starter's
  digest). Scored by **sampled mean@4 exact match** at the training temperature (``qa_quick`` loop, n = 4,
  T = 1.0, top_p 1.0, sampling seed A = 1 for the starter's first scoring and every trained checkpoint, B = 2 for
  the starter's second), also mean@4 token F1 and pass@4.
* **Whole held-out split** (secondary): greedy EM (``qa_quick``) on 50 questions per QA set (350, data seed 0).
* Scored at the start (the starter) and at the end of every run.

Estimates. Per arm: reader-slice end − start on mean@4 EM, paired by question, with a 95% paired-bootstrap
interval over questions of the per-question score averaged over seeds (``reader_sampled_end_minus_start_ci``), and
every seed's point estimate and interval; the same for F1, pass@4 and held-out greedy EM; EMA-PG − GRPO at the
end with its interval; starter seed B − seed A (noise). Trajectories sampled per minute of training.

Targets (from issue #41): EMA-PG end − start on the reader slice's mean@4 EM >= +5 pp, its pooled interval above
zero and every seed's point estimate above zero; the control's interval contains zero; trajectories per minute
>= 2x the 2026-12-04 demo's 16 per 60-s step. Whatever comes out is committed and reported.

Cost and resumption. Measured before the run: the starter's greedy pass over the 700 held-out questions took 8.7 min
(vLLM, fp32, 2 cores), so a reader-slice scoring (181 questions x 4 samples) costs ~8 min and a 350-question greedy
scoring ~4 min; with ~6 min of training per run the protocol takes ~3 hours, over the 150 min the issue hoped for.
It runs seed-major (seed 0 of every arm, then seed 1, ...) in a resumable work folder (``--work``; a finished run is
kept, an unfinished one trained again), writing the estimates from the finished runs after each run to
``learning_search.partial.json`` (``"complete": false``); the contract file is written only when every run of the
protocol has finished. Nothing in the protocol changes between invocations. Every report (partial or final) also
keeps each evaluation's per-question scores (the starter's three scorings under ``starter``, each run's under
``per_question``), and the estimates are computed from those records only; so a committed partial report carries the
protocol's state, and ``--resume-from <report>`` continues it in an empty work folder (added 2026-12-05 after a
machine was lost with its work folder; the protocol itself is unchanged).

Outputs: ``benchmarks/results/learning_search.json`` (contract keys: per arm ``reader_sampled_em_start``,
``reader_sampled_em_end``, ``reader_sampled_end_minus_start_ci``, ``heldout_em_start``, ``heldout_em_end``,
``seeds``; ``reader_questions``, ``heldout_questions``, ``trajectories_per_min``) and ``learning_search.png``.

    python studies/learning_search.py --work runs/learning_search   # the protocol above (~3 h on 2 cores, resumable)
    python studies/learning_search.py --quick    # smoke run: tiny-qwen2, 2k-passage index, 2 steps, 2 seeds, few questions
"""

from __future__ import annotations

import argparse
import json
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
from studies import harness  # noqa: E402
from studies.harness import RESULTS, difference, pct, per_question, qa_sets, seed_difference, seed_mean  # noqa: E402,F401
TRAIN_SET = "qa_pool"  # the answerable training pool (data/qa/pool/)
SEED_A, SEED_B = 1, 2  # sampling seeds of the reader-slice scoring: A for every checkpoint, B for the starter's second
SAMPLES = 4  # mean@4

EMAPG = ["algorithm.name=emapg", "algorithm.kl.type=topk_reverse", "algorithm.kl.topk=32",
         "algorithm.kl.importance_weight=true", "algorithm.ema.decay=0.9"]
ALGOS: dict[str, list[str]] = {
    "grpo": ["algorithm.name=grpo", "algorithm.kl.type=k3", "algorithm.kl.importance_weight=false", "algorithm.ema.decay=1.0"],
    "emapg": EMAPG,
    "control": [*EMAPG, "reward.shuffle_control=true"],
}
PROTOCOL_ARMS = ("grpo", "emapg", "control")  # the pre-registered protocol's arms (the contract file needs all three)
# Off-protocol arm (added 2026-12-05, issue #41 item 3: choose the update by learning per minute): EMA-PG with LoRA r 16
# (alpha 32) on every linear layer at 10x the full fine-tuning lr ("LoRA Without Regret"), merged weights to the
# shared engine (it serves no adapters); with run.precision=bf16 the update is benchmarks/update_speed.py's lora_bf16.
ALGOS["emapg_lora"] = [*EMAPG, "model.lora.enabled=true", "model.lora.rank=16", "model.lora.alpha=32",
                       "model.lora.engine_weights=merged", "optim.lr=2e-4"]
LABELS = {"grpo": "GRPO (K3, frozen reference)", "emapg": "EMA-PG (Top-k reverse KL, EMA anchor)",
          "emapg_lora": "EMA-PG, LoRA r 16 at 10x lr",
          "control": "control (EMA-PG on shuffled rewards)"}
COLORS = {"grpo": "tab:blue", "emapg": "tab:red", "control": "tab:gray", "emapg_lora": "tab:orange"}


def mode_settings(args: argparse.Namespace) -> dict[str, Any]:
    """What runs: the starter, its training config, the index, the evaluation protocol."""
    from emapg.models import STARTER
    from emapg.paths import CONFIG_DIR

    if args.quick:
        return {"mode": "quick", "policy": "tiny-qwen2", "config": CONFIG_DIR / "search_tiny_cpu.yaml", "index_limit": 2000,
                "engine": "hf", "protocol": {"max_tokens": 24, "max_turns": 2}, "reader_limit": 1,
                "extra": ["logging.tensorboard=false", "run.precision=bf16", "rollout.uniform_groups=drop"]}
    return {"mode": "default" if not args.reduced else "reduced", "policy": args.policy or STARTER,
            "config": CONFIG_DIR / "demo_search_smollm2.yaml", "index_limit": None, "engine": "vllm", "protocol": {},
            "reader_limit": None, "extra": []}


def evaluate(model: str, out: Path, url: str, engine_url: str, settings: dict[str, Any], *, per_dataset: int | None = None,
             reader_seed: int | None = None, temperature: float = 1.0) -> Path:
    """One evaluation of ``model`` on the shared engine server (its weights loaded into it first): greedy on
    ``per_dataset`` held-out questions per QA set, or (``reader_seed``) :data:`SAMPLES` samples per question of the
    reader slice at ``temperature`` with that sampling seed."""
    from eval.protocols import get_protocol
    from eval.runner import EvalConfig, run_eval

    if reader_seed is None:
        protocol = get_protocol("qa_quick", **settings["protocol"])
        extra: dict[str, Any] = {"limit": per_dataset, "data_seed": 0, "batch_size": 64}
    else:
        protocol = get_protocol("qa_quick", **settings["protocol"], n=SAMPLES, temperature=temperature, top_p=1.0, seed=reader_seed)
        extra = {"slice": "reader", "limit": settings["reader_limit"], "batch_size": 32}
    run_eval(EvalConfig(model=model, out=str(out), protocol=protocol, datasets=list(qa_sets()), engine="remote",
                        engine_urls=[engine_url], retriever_url=url, progress=False, name=out.name,
                        batch_across_datasets=True, **extra))
    harness.check_heldout(out)
    return out


def per_question_em(eval_dirs: list[Path]) -> dict[str, float]:
    return per_question(eval_dirs, "em")


SCORED = {"reader": ("em", "f1", "pass"), "heldout": ("em",)}  # the per-question scores a report records per evaluation
# the report's fields that must match for --resume-from to take finished runs from an earlier report
# (not "mode": default and reduced differ only in their seeds and arms, so a reduced run's records can seed the protocol)
PROTOCOL_KEYS = ("benchmark", "policy", "steps", "train_set", "overrides", "rollout", "reader_slice", "heldout")


def recorded_scores(eval_dir: Path, kind: str) -> dict[str, dict[str, float]]:
    """Metric -> question -> score of one evaluation (``kind``: ``reader`` or ``heldout``, :data:`SCORED`): what the
    report keeps so that its estimates can be recomputed, and the protocol resumed, without the work folder."""
    return {metric: per_question([eval_dir], metric) for metric in SCORED[kind]}


def informative_fraction(row: dict[str, float]) -> float:
    """The share of a step's first prompt batch whose groups have differing rewards (a policy gradient)."""
    if "filter/first_round_informative_frac" in row:
        return float(row["filter/first_round_informative_frac"])
    return 1.0 - float(row["reward/zero_variance_groups"])


def plot(report: dict[str, Any], path: Path) -> Path:
    fig, (ax_s, ax_r, ax_i) = harness.figure(1, 3, figsize=(16, 4.2))
    arms = list(report["runs"])
    start = report.get("reader_sampled_em_start_seed_a")
    for j, alg in enumerate(arms):
        for i, (seed, run) in enumerate(report["runs"][alg].items()):
            style = ["-", "--", ":", "-."][i % 4]
            label = f"{alg} seed {seed}"
            if start is not None and "reader_sampled_em_end" in run:
                ax_s.plot([0, run["steps"]], [start, run["reader_sampled_em_end"]], style, marker="o", color=COLORS.get(alg), label=label)
            marker = "o" if len(run["train_steps"]) <= 30 else None
            ax_r.plot(run["train_steps"], run["train_reward"], style, color=COLORS.get(alg), label=label, marker=marker, markersize=3)
            if run.get("informative_frac"):
                ax_i.plot(run["train_steps"], run["informative_frac"], style, color=COLORS.get(alg), label=label, marker=marker,
                          markersize=3)
    if report.get("reader_sampled_em_start_seed_b") is not None:
        ax_s.axhline(report["reader_sampled_em_start_seed_b"], color="black", lw=0.8, ls=":", label="starter, sampling seed B")
    ax_s.set_title(f"reader slice: sampled mean@{SAMPLES} EM ({report.get('reader_questions', '?')} held-out questions)")
    ax_s.set_ylabel("EM (%)")
    ax_r.set_title("train reward (sampled; control: shuffled)")
    ax_i.set_title("groups with differing rewards (first prompt batch)")
    ax_i.set_ylim(-0.02, 1.02)
    for ax in (ax_s, ax_r, ax_i):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=6)
        else:
            ax.text(0.5, 0.5, "not logged by these runs", ha="center", va="center", transform=ax.transAxes, color="gray")
    fig.suptitle(f"{' vs '.join(LABELS.get(a, a) for a in arms)} from {report['policy']}, trained on "
                 f"{report.get('train_set', TRAIN_SET)}", fontsize=10)
    return harness.save_figure(fig, path)


def train_run(alg: str, seed: int, run_dir: Path, url: str, engine_url: str, settings: dict[str, Any], args: argparse.Namespace,
              steps: int) -> tuple[list[dict[str, float]], float]:
    """One training run of arm ``alg``; returns its metrics and training seconds."""
    from emapg.config import load_config
    from trainer.config import TrainConfig
    from trainer.loop import train
    from trainer.tracking import read_metrics

    overrides = [f"model.policy={settings['policy']}", f"data.train={args.train_set}", "data.split=train",
                 f"retriever.urls=[{url}]", "retriever.index_dir=null", "rollout.engine=remote",
                 f"rollout.engine_urls=[{engine_url}]", f"run.output_dir={run_dir}", f"run.seed={seed}",
                 f"run.total_steps={steps}", "run.save_every=0", "run.keep_last=1", "logging.progress=false",
                 f"algorithm.ema.period={max(2, steps // 10)}", *settings["extra"], *args.override, *ALGOS[alg]]  # fmt: skip
    t = time.perf_counter()
    train(load_config(TrainConfig, settings["config"], overrides))
    return read_metrics(run_dir), time.perf_counter() - t


def summarise(report: dict[str, Any], algos: list[str], trajectories_total: float, train_s_total: float, *,
              complete: bool) -> dict[str, Any]:
    """The report's estimates from its recorded scores (``report["starter"]`` and each finished run's
    ``per_question``; ``complete``: every run of the protocol finished)."""
    report["complete"] = complete
    algos = [alg for alg in algos if report["runs"][alg]]
    st = report["starter"]
    sa, sb, sg = st["reader_a"]["em"], st["reader_b"]["em"], st["heldout"]["em"]
    report.update({"reader_questions": len(sa), "reader_sampled_em_start_seed_a": pct(sa), "reader_sampled_em_start_seed_b": pct(sb),
                   "starter_seed_b_minus_seed_a": difference(sa, sb), "heldout_em_start": pct(sg)})

    def end(alg: str, kind: str, metric: str, seeds: set[str] | None = None) -> dict[str, float]:
        return seed_mean([run["per_question"][kind][metric] for k, run in report["runs"][alg].items() if seeds is None or k in seeds])

    def between(base: str, arm: str, kind: str) -> dict[str, Any]:
        """arm − base at the end, over the seeds both arms finished (paired by question and by seed set)."""
        common = set(report["runs"][base]) & set(report["runs"][arm])
        return {**difference(end(base, kind, "em", common), end(arm, kind, "em", common)), "seeds": sorted(int(k) for k in common)}

    for alg in algos:
        runs = list(report["runs"][alg].values())
        end_a, end_g = end(alg, "reader", "em"), end(alg, "heldout", "em")
        block: dict[str, Any] = {
            "seeds": [int(k) for k in report["runs"][alg]],
            "reader_sampled_em_start": pct(sa), "reader_sampled_em_end": pct(end_a),
            "reader_sampled_end_minus_start": difference(sa, end_a),
            "reader_sampled_em_end_per_seed": [x["reader_sampled_em_end"] for x in runs],
            "reader_sampled_end_minus_start_per_seed": [x["reader_sampled_end_minus_start"] for x in runs],
            "heldout_em_start": pct(sg), "heldout_em_end": pct(end_g), "heldout_end_minus_start": difference(sg, end_g),
            "heldout_em_end_per_seed": [x["heldout_em_end"] for x in runs],
            "trajectories_per_min": statistics.mean(x["trajectories_per_min"] for x in runs),
            # learning per minute: the reader-slice gain (pp) per minute of training (sampling + update), over the seeds
            "reader_pp_per_train_min": 60 * (pct(end_a) - pct(sa)) / statistics.mean(x["train_s"] for x in runs),
            "informative_frac_mean": statistics.mean(statistics.mean(x["informative_frac"]) for x in runs),
        }
        block["reader_sampled_end_minus_start_ci"] = [block["reader_sampled_end_minus_start"]["low"],
                                                      block["reader_sampled_end_minus_start"]["high"]]
        # the seed-level interval (seeds, then questions, resampled) beside the per-question one (added 2026-12-06, issue #53)
        for kind, start_scores in (("reader_sampled", sa), ("heldout", sg)):
            per_seed = [run["per_question"]["reader" if kind == "reader_sampled" else "heldout"]["em"] for run in runs]
            seed_level = block[f"{kind}_end_minus_start_seed_level"] = seed_difference([start_scores], per_seed)
            block[f"{kind}_end_minus_start_seed_ci"] = [seed_level["low"], seed_level["high"]]
        for name, metric in (("f1", "f1"), ("pass", "pass")):
            s0, s1 = st["reader_a"][metric], end(alg, "reader", metric)
            block[f"reader_sampled_{name}_start"], block[f"reader_sampled_{name}_end"] = pct(s0), pct(s1)
            block[f"reader_sampled_{name}_end_minus_start"] = difference(s0, s1)
        report[alg] = block
    pairs = [("grpo", "emapg", "emapg_minus_grpo"), ("control", "grpo", "grpo_minus_control"), ("control", "emapg", "emapg_minus_control"),
             ("emapg", "emapg_lora", "emapg_lora_minus_emapg")]
    for base, arm, name in pairs:
        if {base, arm} <= set(algos) and set(report["runs"][base]) & set(report["runs"][arm]):
            report[f"{name}_reader_sampled"] = between(base, arm, "reader")
            report[f"{name}_heldout"] = between(base, arm, "heldout")
    report["trajectories_per_min"] = 60 * trajectories_total / max(train_s_total, 1e-9)
    report["demo_2026_12_04_trajectories_per_min"] = 16.0  # 16 trajectories per 60-s step (issue #41)
    report["misses"] = {"start": st["misses"], **{f"{alg}_end": [run["misses_end"] for run in report["runs"][alg].values()]
                                                  for alg in algos}}
    report["machine"] = harness.machine()
    return report


def write_report(report: dict[str, Any], out: Path, *, plot_too: bool = True) -> None:
    harness.write_report(report, out, plot if plot_too else None)


def summarise_only(path: Path, out: Path) -> int:
    """``--summarise-only``: the report at ``path`` with its estimates recomputed from its recorded scores."""
    report = json.loads(path.read_text())
    if "starter" not in report:
        raise SystemExit(f"--summarise-only: {path} records no per-question scores (written before they were kept)")
    algos = [alg for alg in report["runs"] if report["runs"][alg]]
    runs = [run for alg in algos for run in report["runs"][alg].values()]
    measured = report.get("trajectories_per_min")  # from unrounded training times (runs record them rounded)
    summarise(report, list(report["runs"]), sum(r["trajectories_sampled"] for r in runs), sum(r["train_s"] for r in runs),
              complete=report.get("complete", True))
    if measured is not None:
        report["trajectories_per_min"] = measured
    harness.write_report(report, out)
    print(f"[learning_search] recomputed {path} into {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny-qwen2 on a 2k-passage index, 2 steps, 2 seeds, few questions")
    p.add_argument("--reduced", action="store_true", help="the default models with fewer seeds/steps/questions (not the contract file)")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 12; quick 2)")
    p.add_argument("--per-dataset", type=int, default=None, help="held-out questions per QA set of the greedy scoring (<= 100; "
                   "default 50, i.e. 350 questions; quick 2)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="training seeds (default 0 1 2; quick 0 1)")
    p.add_argument("--algorithms", nargs="+", choices=sorted(ALGOS), default=list(PROTOCOL_ARMS),
                   help="arms to train (default the protocol's three; the contract file needs exactly those; emapg_lora: "
                        "off-protocol, EMA-PG with LoRA)")
    p.add_argument("--train-set", default=TRAIN_SET, help="training questions: qa_pool (the default) or qa_pool_informative")
    p.add_argument("--policy", default=None, help="starter policy (default emapg.models.STARTER)")
    p.add_argument("--override", action="append", default=[], help="a dotted training override for every arm (repeatable)")
    p.add_argument("--out", default=str(RESULTS / "learning_search.json"))
    p.add_argument("--keep-final", action="store_true", help="keep each run's last checkpoint's policy/ folder; needs --work")
    p.add_argument("--work", default=None, help="folder for runs and evaluations (default: a temp folder, removed). A rerun with "
                   "the same --work resumes: finished runs and evaluations are kept, an unfinished run is trained again; after "
                   "every finished run the report so far is written beside --out as <name>.partial.json")
    p.add_argument("--resume-from", default=None, help="an earlier report (e.g. the committed learning_search.partial.json) of the "
                   "same protocol: its recorded starter scores and finished runs are taken into --work instead of being run again "
                   "(reports keep every evaluation's per-question scores for this)")
    p.add_argument("--summarise-only", default=None, metavar="REPORT",
                   help="train nothing: recompute a report's estimates from its recorded per-question scores (e.g. once the "
                        "statistics gained the seed-level interval) and write it to --out (its plot kept)")
    harness.add_arguments(p)
    args = p.parse_args(argv)
    if args.summarise_only:
        return summarise_only(Path(args.summarise_only), Path(args.out))
    steps = args.steps or (2 if args.quick else 12)
    seeds = args.seeds or ([0, 1] if args.quick else [0, 1, 2])
    per_dataset = args.per_dataset or (2 if args.quick else 50)
    contract = Path(args.out).resolve() == (RESULTS / "learning_search.json").resolve()
    if contract and (args.reduced or set(args.algorithms) != set(PROTOCOL_ARMS) or args.override):
        p.error("--reduced, --algorithms with fewer arms and --override runs need --out (learning_search.json holds the protocol's run)")
    if len(seeds) < 2 and not (args.quick or args.reduced):
        p.error("give at least 2 seeds (or --reduced for a one-seed run)")
    if args.keep_final and not args.work:
        p.error("--keep-final needs --work (the default work folder is removed at the end)")
    if args.resume_from and not Path(args.resume_from).is_file():
        p.error(f"--resume-from: no report at {args.resume_from}")
    if not 1 <= per_dataset <= 100:
        p.error("--per-dataset must be in [1, 100]: the held-out split holds 100 questions per QA set")
    provenance = harness.start(__file__, quick=args.quick, allow_dirty=args.allow_dirty)
    harness.environment()

    from emapg.config import load_config
    from eval.learning import miss_breakdown
    from tasks.datasets import load_dataset
    from trainer.config import TrainConfig

    t0 = time.perf_counter()
    settings = mode_settings(args)
    algos = list(args.algorithms)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="learning-search-"))
    work.mkdir(parents=True, exist_ok=True)
    pool_sources: dict[str, int] = {}
    for ex in load_dataset(args.train_set, split="train"):
        pool_sources[ex.meta.get("origin", ex.data_source)] = pool_sources.get(ex.meta.get("origin", ex.data_source), 0) + 1
    base_cfg = load_config(TrainConfig, settings["config"], [*settings["extra"], *args.override])
    r = base_cfg.rollout
    report: dict[str, Any] = {
        "benchmark": "learning_search", "protocol": "pre-registered in the script's docstring (committed before the run)",
        "mode": settings["mode"], "policy": settings["policy"], "steps": steps, "seeds": seeds, "train_set": args.train_set,
        "train_questions": pool_sources, "overrides": args.override,
        "engine": f"one `emapg engine serve --engine {settings['engine']}` shared by every run and evaluation",
        "rollout": {"group_size": r.n_samples, "prompts_per_step": base_cfg.data.prompts_per_step, "temperature": r.temperature,
                    "uniform_groups": r.uniform_groups, "precision": base_cfg.run.precision},
        "reader_slice": {"file": "data/qa/reader_slice.json", "scoring": f"sampled mean@{SAMPLES} at T = {r.temperature}, "
                         f"top_p 1.0, sampling seed {SEED_A} (starter's second scoring: {SEED_B})"},
        "heldout": {"datasets": list(qa_sets()), "per_dataset": per_dataset, "questions": per_dataset * len(qa_sets()),
                    "data_seed": 0, "split": "subset of data/qa/heldout.json", "protocol": "qa_quick (greedy)"},
        "heldout_questions": per_dataset * len(qa_sets()),
        "algorithms": {alg: " ".join(o for o in ALGOS[alg] if not o.startswith("algorithm.name")) for alg in algos},
        "runs": {alg: {} for alg in algos}, "provenance": provenance,
    }
    if args.resume_from:
        taken = harness.import_runs(json.loads(Path(args.resume_from).read_text()), report, work, algos, seeds, PROTOCOL_KEYS)
        print(f"[learning_search] taken from {args.resume_from}: {', '.join(taken) or 'nothing new'}", flush=True)
    train_s_total, trajectories_total = 0.0, 0.0
    with harness.servers(settings["policy"], engine=settings["engine"], index_limit=settings["index_limit"],
                         max_model_len=r.max_prompt_tokens + r.max_response_tokens, folder=work) as served:
        url = served.retriever_url
        starter_file = work / "starter.json"
        if not starter_file.is_file():  # the starter's three scorings, recorded per question
            start_greedy = evaluate(settings["policy"], work / "start_greedy", url, served.engine_url, settings, per_dataset=per_dataset)
            start_a = evaluate(settings["policy"], work / "start_reader_a", url, served.engine_url, settings, reader_seed=SEED_A,
                               temperature=r.temperature)
            start_b = evaluate(settings["policy"], work / "start_reader_b", url, served.engine_url, settings, reader_seed=SEED_B,
                               temperature=r.temperature)
            starter_file.write_text(json.dumps({
                "heldout": recorded_scores(start_greedy, "heldout"), "reader_a": recorded_scores(start_a, "reader"),
                "reader_b": recorded_scores(start_b, "reader"), "misses": asdict(miss_breakdown(start_greedy, list(qa_sets())))}) + "\n")
        report["starter"] = starter = json.loads(starter_file.read_text())
        start_reader = starter["reader_a"]["em"]
        print(f"[learning_search] starter: held-out greedy EM {pct(starter['heldout']['em']):.1f}, reader slice mean@{SAMPLES} "
              f"EM {pct(start_reader):.1f} (seed A) / {pct(starter['reader_b']['em']):.1f} (seed B) "
              f"[{(time.perf_counter() - t0) / 60:.1f} min]", flush=True)
        def train_and_score(alg: str, seed: int, run_dir: Path) -> dict[str, Any]:
            from trainer.checkpoint import step_dir_name

            t_run = time.perf_counter()
            metrics, t_train = train_run(alg, seed, run_dir, url, served.engine_url, settings, args, steps)
            ckpt = run_dir / step_dir_name(steps)
            g = evaluate(str(ckpt / "policy"), run_dir / "end_greedy", url, served.engine_url, settings, per_dataset=per_dataset)
            a = evaluate(str(ckpt / "policy"), run_dir / "end_reader_a", url, served.engine_url, settings, reader_seed=SEED_A,
                         temperature=r.temperature)
            harness.finish_checkpoint(ckpt, keep_policy=args.keep_final)
            sampled = sum(float(m.get("filter/sampled_trajectories", r.n_samples * base_cfg.data.prompts_per_step)) for m in metrics)
            return {
                "steps": steps, "train_steps": [int(m["step"]) for m in metrics],
                "train_reward": [float(m.get("filter/sampled_reward_mean", m["reward/mean"])) for m in metrics],
                "informative_frac": [informative_fraction(m) for m in metrics],
                "informative_groups_trained": sum(float(m.get("filter/informative_groups", 0.0)) for m in metrics),
                "step_s": [float(m.get("time/step", float("nan"))) for m in metrics],
                "trajectories_sampled": sampled, "train_s": round(t_train, 1), "run_s": round(time.perf_counter() - t_run, 1),
                "trajectories_per_min": 60 * sampled / t_train,
                "heldout_em_end": pct(per_question([g])), "reader_sampled_em_end": pct(per_question([a])),
                "reader_sampled_f1_end": pct(per_question([a], "f1")),
                "reader_sampled_end_minus_start": difference(start_reader, per_question([a])),
                "heldout_end_minus_start": difference(starter["heldout"]["em"], per_question([g])),
                "misses_end": asdict(miss_breakdown(g, list(qa_sets()))),
                "per_question": {"reader": recorded_scores(a, "reader"), "heldout": recorded_scores(g, "heldout")},
            }

        for alg, seed, run, kept in harness.arm_runs(work, algos, seeds, train_and_score):
            report["runs"][alg][str(seed)] = run
            train_s_total += run["train_s"]
            trajectories_total += run["trajectories_sampled"]
            if kept:  # finished in an earlier invocation with this --work
                print(f"[learning_search] {alg} seed {seed}: kept from {harness.run_folder(work, alg, seed) / 'run.json'}", flush=True)
                continue
            partial = Path(args.out).with_suffix(".partial.json")
            write_report(summarise(dict(report), algos, trajectories_total, train_s_total, complete=False), partial,
                         plot_too=False)
            d = run["reader_sampled_end_minus_start"]
            print(f"[learning_search] {alg} seed {seed}: reader mean@{SAMPLES} EM {pct(start_reader):.1f} -> "
                  f"{run['reader_sampled_em_end']:.1f} ({d['mean']:+.1f} pp [{d['low']:+.1f}, {d['high']:+.1f}]), held-out greedy "
                  f"{run['heldout_em_end']:.1f}; {run['trajectories_per_min']:.1f} trajectories/min "
                  f"[{(time.perf_counter() - t0) / 60:.1f} min]", flush=True)

    report = summarise(report, algos, trajectories_total, train_s_total, complete=True)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    out = Path(args.out)
    write_report(report, out)
    Path(args.out).with_suffix(".partial.json").unlink(missing_ok=True)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\nreader slice ({report['reader_questions']} q), sampled mean@{SAMPLES} EM; held-out greedy EM ({report['heldout_questions']} q):")
    d = report["starter_seed_b_minus_seed_a"]
    print(f"starter: reader {report['reader_sampled_em_start_seed_a']:.1f} (seed B {report['reader_sampled_em_start_seed_b']:.1f}, "
          f"B - A {d['mean']:+.1f} [{d['low']:+.1f}, {d['high']:+.1f}]); held-out {report['heldout_em_start']:.1f}")
    for alg in algos:
        b, d, h = report[alg], report[alg]["reader_sampled_end_minus_start"], report[alg]["heldout_end_minus_start"]
        seeds_txt = ", ".join(f"{x['mean']:+.1f}" for x in b["reader_sampled_end_minus_start_per_seed"])
        sl = b["reader_sampled_end_minus_start_seed_ci"]
        print(f"{alg:<8} reader {b['reader_sampled_em_end']:.1f} ({d['mean']:+.1f} pp [{d['low']:+.1f}, {d['high']:+.1f}] over "
              f"questions, [{sl[0]:+.1f}, {sl[1]:+.1f}] over seeds and questions; seeds {seeds_txt}); held-out "
              f"{b['heldout_em_end']:.1f} ({h['mean']:+.1f} [{h['low']:+.1f}, {h['high']:+.1f}])")
    if "emapg_minus_grpo_reader_sampled" in report:
        d = report["emapg_minus_grpo_reader_sampled"]
        print(f"EMA-PG - GRPO (reader): {d['mean']:+.1f} pp [{d['low']:+.1f}, {d['high']:+.1f}]")
    print(f"trajectories per minute of training: {report['trajectories_per_min']:.1f} (the 2026-12-04 demo: 16)")
    print(f"mode {settings['mode']}, wall {report['wall_s'] / 60:.1f} min; wrote {out} and {report['plot']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
