"""Does RL from the multi-search starter teach a 135M search agent to search again? EMA-PG vs GRPO vs a shuffled-reward control.

PRE-REGISTERED PROTOCOL (written and committed before any run it describes; 2026-12-06, issue 53 item 6)
=======================================================================================================

Question. From the second starter (a SmolLM2-135M search agent SFT'd on demonstrations that search once or twice,
:data:`SECOND_STARTER`), does RL with the production trainer raise its answers on held-out multi-hop questions whose
gold the first search for the question text does not show -- the questions a second search can answer -- and does it
raise how often the agent searches again when its first passages lacked the gold? Does EMA-PG differ from GRPO?

Part 1, the starters (run first, by ``benchmarks/starter_comparison.py --limit 0``; this study reads its result
file and refuses a partial one): the first starter (``smollm2-135m-search-starter``, one search of the question text)
against the second, greedy, ``qa_quick`` with 3 turns, on the search slice and the reader slice: greedy EM, searches
per question, the rate of searching again when the first passages lacked the gold, the second query's gold rate.
Contract keys ``starter_v1`` / ``starter_v2`` (``starter_v2`` is the second starter, whatever its folder's name).

Part 2, RL from the second starter. The production trainer (:func:`trainer.loop.train`) on the demo's training config
(``configs/demo_search_smollm2.yaml``) with three changes for a two-search agent: the training pool ``qa_pool_v2``
(one-search and two-search questions, each verified through the retriever under its recorded rule, disjoint from
every held-out question and from the search slice; ``data/qa/pool_v2/record.json``), ``rollout.max_turns=3`` (two
searches and an answer) and 16 steps (more steps rather than more arms: the last benchmark found the seed spread, not
the seed count, limiting). Arms, the same as ``studies/learning_search.py``'s (same settings, :data:`ALGOS`):

* ``grpo``    -- K3 KL (beta 0.001) to the frozen starter, no importance weight;
* ``emapg``   -- Top-k reverse KL (k = 32, tail + IW, beta 0.001) to an EMA anchor (eta = 0.9, period max(2, steps//10));
* ``control`` -- ``emapg`` on each batch's rewards permuted across its trajectories (``reward.shuffle_control``).

Seeds 0, 1, 2, 3, 4 in every arm (each seed's sampler draws the same questions in every arm), seed-major.

Instrument (fixed before any RL run):

* **Search slice** (primary; ``data/qa/search_slice.json``: 160 held-out HotpotQA dev questions whose supporting
  paragraphs are in the corpus, whose first search for the question text does not show the gold and which a second
  search can answer; recorded with its rule, ids and both starters' digests before any RL run). Scored by **sampled
  mean@4 exact match** at the training temperature (``qa_quick`` with 3 turns, n = 4, T = 1.0, top_p 1.0, sampling
  seed A = 1 for the starter's first scoring and for every trained checkpoint, B = 2 for the starter's second, so the
  instrument's own noise is on the page). From the same samples: **searched again**, per question the share of its
  samples whose first passages lacked the gold that searched a second time (a question none of whose samples missed
  at first, in any scoring compared, is left out of that comparison, and the count is reported), and the second
  query's gold rate.
* **Reader slice** (secondary; ``data/qa/reader_slice.json``, the held-out questions the first search answers):
  greedy EM with the same 3-turn protocol, so a gain on the search slice that costs reading shows.
* Scored at the start (the starter) and at the end of every run.

Estimates. Per arm, end − start of search-slice mean@4 EM with the seed-level interval (hierarchical bootstrap:
seeds, then questions, resampled; ``eval.significance.hierarchical_bootstrap``) and the per-question interval beside
it, every seed's point estimate; the same for the searched-again rate and reader-slice greedy EM; EMA-PG − GRPO,
GRPO − control and EMA-PG − control at the end (seed-level); the starter's seed B − seed A.

Targets (issue 53): EMA-PG's search-slice mean@4 EM end − start >= +4 pp with its seed-level interval above zero;
the control's seed-level interval contains zero; EMA-PG's searched-again rate rises, its interval above zero.
Whatever comes out is committed and reported, with the measured cause of any miss.

Cost and resumption. ~17 min per run on 2 cores (training ~6 min; search slice 640 samples of up to 3 turns ~9 min;
reader slice greedy ~2 min), 15 runs plus the starter's scorings: ~4.5 h. Resumable as ``studies/learning_search.py``:
``--work`` keeps finished runs; after every run the report so far is written to ``search_learning.partial.json``
(``"complete": false``) with every evaluation's per-question records, and ``--resume-from`` continues a committed
partial report in an empty work folder. The contract file is written when every run has finished.

Outputs: ``benchmarks/results/search_learning.json`` (contract keys: ``search_questions``; ``starter_v1`` and
``starter_v2`` with ``search_greedy_em``, ``search_searches_per_question``, ``reader_greedy_em``; per arm ``seeds``,
``search_sampled_em_start``, ``search_sampled_em_end``, ``search_sampled_end_minus_start_seed_ci`` [low, high] in pp)
and ``search_learning.png``.

    python studies/search_learning.py --work runs/search_learning   # the protocol (~4.5 h on 2 cores, resumable)
    python studies/search_learning.py --quick   # smoke run: tiny-qwen2, 2k-passage index, hf engine, few questions
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from studies import harness  # noqa: E402
from studies.harness import RESULTS, difference, pct, seed_difference, seed_mean  # noqa: E402
from studies.learning_search import ALGOS, COLORS, LABELS, PROTOCOL_ARMS, informative_fraction, train_run  # noqa: E402

SECOND_STARTER = "smollm2-135m-search-starter-v2"  # the second starter of part 1 (data/starter/<name>)
FIRST_STARTER = "smollm2-135m-search-starter"
TRAIN_SET = "qa_pool_v2"
MAX_TURNS = 3  # two searches and an answer
STEPS = 16
SEEDS = (0, 1, 2, 3, 4)
SEED_A, SEED_B = 1, 2  # sampling seeds of the search-slice scoring: A for every checkpoint, B for the starter's second
SAMPLES = 4  # mean@4
SEARCH_DATASETS = ("hotpotqa",)  # the search slice's datasets (data/qa/search_slice.json)
STARTER_COMPARISON = RESULTS / "starter_comparison.json"
# the report's fields that must match for --resume-from to take finished runs from an earlier report
PROTOCOL_KEYS = ("benchmark", "policy", "steps", "train_set", "overrides", "rollout", "search_slice", "reader_slice")


def mode_settings(args: argparse.Namespace) -> dict[str, Any]:
    from emapg.paths import CONFIG_DIR

    extra = [f"rollout.max_turns={MAX_TURNS}"]
    if args.quick:
        return {"mode": "quick", "policy": "tiny-qwen2", "config": CONFIG_DIR / "search_tiny_cpu.yaml", "index_limit": 2000,
                "engine": "hf", "protocol": {"max_tokens": 24, "max_turns": MAX_TURNS}, "limit": 2,
                "extra": ["logging.tensorboard=false", "run.precision=bf16", "rollout.uniform_groups=drop", *extra]}
    return {"mode": "default", "policy": SECOND_STARTER, "config": CONFIG_DIR / "demo_search_smollm2.yaml", "index_limit": None,
            "engine": "vllm", "protocol": {"max_turns": MAX_TURNS}, "limit": None, "extra": extra}


# ------------------------------------------------------------------------------------------------- scoring
def evaluate(model: str, out: Path, url: str, engine_url: str, settings: dict[str, Any], *, slice_name: str,
             seed: int | None = None, temperature: float = 1.0) -> Path:
    """One evaluation on the shared engine: the search slice sampled (``seed``: :data:`SAMPLES` samples at
    ``temperature``) or a slice greedy (``seed`` None)."""
    from eval.protocols import get_protocol
    from eval.runner import EvalConfig, run_eval

    if seed is None:
        protocol = get_protocol("qa_quick", **settings["protocol"])
    else:
        protocol = get_protocol("qa_quick", **settings["protocol"], n=SAMPLES, temperature=temperature, top_p=1.0, seed=seed)
    datasets = list(SEARCH_DATASETS) if slice_name == "search" else list(harness.qa_sets())
    run_eval(EvalConfig(model=model, out=str(out), protocol=protocol, datasets=datasets, engine="remote", engine_urls=[engine_url],
                        retriever_url=url, progress=False, name=out.name, batch_across_datasets=True, slice=slice_name,
                        limit=settings["limit"], data_seed=0, batch_size=32))  # fmt: skip
    return out


def question_records(eval_dir: Path) -> dict[str, dict[str, Any]]:
    """Question (``dataset/id``) -> its item record, over every QA set the evaluation scored."""
    from eval.items import items_file, read_items

    return {f"{ds}/{r['id']}": r for ds in harness.qa_sets() if items_file(eval_dir, ds).is_file() for r in read_items(eval_dir, ds)}


def search_scores(eval_dir: Path) -> dict[str, dict[str, float]]:
    """Per question, from one evaluation's samples: ``em`` (mean over samples), ``searches`` (mean per sample),
    ``first_missed`` (samples whose first passages lacked the gold), ``searched_again`` (of those, how many searched a
    second time), ``second`` (samples with a second search) and ``second_gold`` (of those, whose passages held the gold).
    What the report keeps, so that its estimates can be recomputed, and the protocol resumed, without the work folder."""
    from eval.learning import question_score

    out: dict[str, dict[str, float]] = {"em": {}, "searches": {}, "first_missed": {}, "searched_again": {}, "second": {}, "second_gold": {}}
    for key, r in question_records(eval_dir).items():
        samples = [s for s in (r.get("samples") or [r]) if isinstance(s, dict)]
        flags = [list(s.get("search_gold") or []) for s in samples]
        missed = [f for f in flags if f and not f[0]]
        second = [f for f in flags if len(f) >= 2]
        out["em"][key] = question_score(r, "em")
        out["searches"][key] = sum(int(s.get("searches") or 0) for s in samples) / max(len(samples), 1)
        out["first_missed"][key] = float(len(missed))
        out["searched_again"][key] = float(sum(len(f) >= 2 for f in missed))
        out["second"][key] = float(len(second))
        out["second_gold"][key] = float(sum(bool(f[1]) for f in second))
    return out


def greedy_em(eval_dir: Path) -> dict[str, float]:
    from eval.learning import question_score

    return {key: question_score(r, "em") for key, r in question_records(eval_dir).items()}


def again_rates(records: list[dict[str, dict[str, float]]]) -> tuple[list[dict[str, float]], list[str]]:
    """Per record, question -> searched again / first missed, over the questions every record missed at least once
    (returned too): the rate is undefined where no sample missed at first."""
    common = sorted(set.intersection(*({k for k, v in r["first_missed"].items() if v > 0} for r in records)))
    return [{k: r["searched_again"][k] / r["first_missed"][k] for k in common} for r in records], common


def pooled_rate(record: dict[str, dict[str, float]], num: str, den: str) -> float | None:
    d = sum(record[den].values())
    return round(100 * sum(record[num].values()) / d, 2) if d else None


def check_heldout(eval_dir: Path) -> None:
    """Every question an evaluation scored is held out (the recorded held-out split or the search slice)."""
    from tasks.heldout import heldout_questions
    from tasks.heldout import question_key

    held = heldout_questions()
    outside = [k for k, r in question_records(eval_dir).items() if question_key(r["question"]) not in held]
    if outside:
        raise RuntimeError(f"{eval_dir}: {len(outside)} evaluated questions are not held out, e.g. {outside[:3]}")


# ------------------------------------------------------------------------------------------------- part 1
def starter_part(report: dict[str, Any], quick: bool) -> None:
    """Part 1's figures from ``benchmarks/starter_comparison.py --limit 0``'s result (a partial one is refused)."""
    if quick:
        report["starter_comparison"] = "skipped (--quick)"
        return
    if not STARTER_COMPARISON.is_file():
        raise SystemExit(f"part 1 first: python benchmarks/starter_comparison.py --limit 0 (no {STARTER_COMPARISON})")
    from eval.reader_slice import load_reader_slice
    from tasks.multihop import search_slice_ids

    comp = json.loads(STARTER_COMPARISON.read_text())
    blocks = {k: v for k, v in comp.items() if k.startswith("starter_v") and isinstance(v, dict)}
    second = next((k for k, v in blocks.items() if v.get("model") == SECOND_STARTER), None)
    first = next((k for k, v in blocks.items() if v.get("model") == FIRST_STARTER), None)
    if second is None or first is None:
        raise SystemExit(f"{STARTER_COMPARISON} did not evaluate both {FIRST_STARTER} and {SECOND_STARTER}")
    n_search = sum(len(ids) for ids in search_slice_ids().values())
    n_reader = sum(len(ids) for ids in load_reader_slice().ids.values())
    for name in (first, second):
        if comp.get("quick") or blocks[name]["search_questions"] != n_search or blocks[name]["reader_questions"] != n_reader:
            raise SystemExit(f"{STARTER_COMPARISON} is a partial comparison ({name}: {blocks[name]['search_questions']} of {n_search} "
                             f"search-slice and {blocks[name]['reader_questions']} of {n_reader} reader-slice questions): "
                             "rerun it with --limit 0")
    keys = ("model", "search_greedy_em", "search_searches_per_question", "search_searched_again_rate", "search_second_holds_gold_rate",
            "reader_greedy_em", "reader_searches_per_question")
    report["starter_v1"] = {k: blocks[first].get(k) for k in keys}
    report["starter_v2"] = {k: blocks[second].get(k) for k in keys}  # the second starter, whatever its folder's name
    report["starter_comparison"] = str(STARTER_COMPARISON.relative_to(ROOT))


# ------------------------------------------------------------------------------------------------- estimates
def summarise(report: dict[str, Any], algos: list[str], *, complete: bool) -> dict[str, Any]:
    """The estimates from the recorded per-question scores (``report["starter"]``, each run's ``per_question``)."""
    report["complete"] = complete
    algos = [alg for alg in algos if report["runs"][alg]]
    st = report["starter"]
    sa, sb, reader0 = st["search_a"], st["search_b"], st["reader_greedy"]
    report.update({"search_questions": len(sa["em"]), "reader_questions": len(reader0),
                   "search_sampled_em_start_seed_a": pct(sa["em"]), "search_sampled_em_start_seed_b": pct(sb["em"]),
                   "starter_seed_b_minus_seed_a": difference(sa["em"], sb["em"]),
                   "search_searched_again_rate_start": pooled_rate(sa, "searched_again", "first_missed"),
                   "search_searches_per_question_start": round(sum(sa["searches"].values()) / max(len(sa["searches"]), 1), 3),
                   "reader_greedy_em_start": pct(reader0)})  # fmt: skip
    for alg in algos:
        runs = list(report["runs"][alg].values())
        ends = [run["per_question"]["search"] for run in runs]
        readers = [run["per_question"]["reader_greedy"] for run in runs]
        block: dict[str, Any] = {"seeds": [int(k) for k in report["runs"][alg]],
                                 "search_sampled_em_start": pct(sa["em"]),
                                 "search_sampled_em_end": pct(seed_mean([e["em"] for e in ends])),
                                 "search_sampled_em_end_per_seed": [pct(e["em"]) for e in ends]}  # fmt: skip
        block["search_sampled_end_minus_start"] = difference(sa["em"], seed_mean([e["em"] for e in ends]))
        seed_level = block["search_sampled_end_minus_start_seed_level"] = seed_difference([sa["em"]], [e["em"] for e in ends])
        block["search_sampled_end_minus_start_seed_ci"] = [seed_level["low"], seed_level["high"]]
        rates, common = again_rates([sa, *ends])
        block["searched_again_questions"] = len(common)
        block["searched_again_rate_start"] = pct(rates[0]) if common else None
        block["searched_again_rate_end"] = pct(seed_mean(rates[1:])) if common else None
        block["searched_again_rate_end_per_seed"] = [pooled_rate(e, "searched_again", "first_missed") for e in ends]
        if common:
            sl = block["searched_again_end_minus_start_seed_level"] = seed_difference(rates[:1], rates[1:])
            block["searched_again_end_minus_start_seed_ci"] = [sl["low"], sl["high"]]
        block["second_holds_gold_rate_end_per_seed"] = [pooled_rate(e, "second_gold", "second") for e in ends]
        block["searches_per_question_end_per_seed"] = [round(sum(e["searches"].values()) / max(len(e["searches"]), 1), 3) for e in ends]
        block["reader_greedy_em_end"] = pct(seed_mean(readers))
        rl = block["reader_greedy_end_minus_start_seed_level"] = seed_difference([reader0], readers)
        block["reader_greedy_end_minus_start_seed_ci"] = [rl["low"], rl["high"]]
        block["train_reward_last"] = [run["train_reward"][-1] for run in runs if run["train_reward"]]
        block["informative_frac_mean"] = sum(sum(r["informative_frac"]) / max(len(r["informative_frac"]), 1) for r in runs) / len(runs)
        report[alg] = block
    for base, arm, name in (("grpo", "emapg", "emapg_minus_grpo"), ("control", "grpo", "grpo_minus_control"),
                            ("control", "emapg", "emapg_minus_control")):  # fmt: skip
        common_seeds = sorted(set(report["runs"].get(base, {})) & set(report["runs"].get(arm, {})), key=int)
        if {base, arm} <= set(algos) and common_seeds:
            a = [report["runs"][base][k]["per_question"]["search"]["em"] for k in common_seeds]
            b = [report["runs"][arm][k]["per_question"]["search"]["em"] for k in common_seeds]
            report[f"{name}_search_sampled"] = {**seed_difference(a, b), "seeds": [int(k) for k in common_seeds]}
    return report


def plot(report: dict[str, Any], path: Path) -> Path:
    fig, (ax_em, ax_again, ax_r) = harness.figure(1, 3, figsize=(16, 4.2))
    start = report.get("search_sampled_em_start_seed_a")
    for alg, runs in report["runs"].items():
        for i, (seed, run) in enumerate(runs.items()):
            style = ["-", "--", ":", "-.", (0, (1, 3))][i % 5]
            label = f"{alg} seed {seed}"
            ax_em.plot([0, run["steps"]], [start, pct(run["per_question"]["search"]["em"])], style, marker="o", color=COLORS.get(alg), label=label)
            end_rate = pooled_rate(run["per_question"]["search"], "searched_again", "first_missed")
            if end_rate is not None and report.get("search_searched_again_rate_start") is not None:
                ax_again.plot([0, run["steps"]], [report["search_searched_again_rate_start"], end_rate], style, marker="o",
                              color=COLORS.get(alg), label=label)
            ax_r.plot(run["train_steps"], run["train_reward"], style, color=COLORS.get(alg), label=label)
    if report.get("search_sampled_em_start_seed_b") is not None:
        ax_em.axhline(report["search_sampled_em_start_seed_b"], color="black", lw=0.8, ls=":", label="starter, sampling seed B")
    ax_em.set_title(f"search slice: sampled mean@{SAMPLES} EM ({report.get('search_questions', '?')} held-out questions)")
    ax_em.set_ylabel("EM (%)")
    ax_again.set_title("searched again when the first passages lacked the gold (%)")
    ax_r.set_title("train reward (sampled; control: shuffled)")
    for ax in (ax_em, ax_again, ax_r):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=6)
    fig.suptitle(f"{' vs '.join(LABELS.get(a, a) for a in report['runs'])} from {report['policy']}, trained on {report['train_set']}",
                 fontsize=10)
    return harness.save_figure(fig, path)


# ------------------------------------------------------------------------------------------------- the run
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny-qwen2 on a 2k-passage index, hf engine, 2 questions per slice")
    p.add_argument("--steps", type=int, default=None, help=f"training steps per run (default {STEPS}; quick 1)")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="training seeds (default 0-4; quick 0)")
    p.add_argument("--algorithms", nargs="+", choices=list(PROTOCOL_ARMS), default=list(PROTOCOL_ARMS), help="arms (default all three)")
    p.add_argument("--out", default=str(RESULTS / "search_learning.json"))
    p.add_argument("--work", default=None, help="folder for runs and evaluations (default: a temp folder, removed); a rerun with "
                   "the same --work resumes, and the report so far is written beside --out as <name>.partial.json after every run")
    p.add_argument("--resume-from", default=None, help="an earlier (e.g. committed partial) report of the same protocol: its "
                   "recorded starter scores and finished runs are taken into --work")
    p.add_argument("--keep-final", action="store_true", help="keep each run's last checkpoint's policy/ folder; needs --work")
    harness.add_arguments(p)
    args = p.parse_args(argv)
    steps = args.steps or (1 if args.quick else STEPS)
    seeds = args.seeds or ([0] if args.quick else list(SEEDS))
    algos = list(args.algorithms)
    contract = Path(args.out).resolve() == (RESULTS / "search_learning.json").resolve()
    if contract and (args.quick or steps != STEPS or sorted(seeds) != list(SEEDS) or set(algos) != set(PROTOCOL_ARMS)):
        p.error("search_learning.json holds the protocol's run: other steps, seeds or arms (or --quick) need --out")
    if args.keep_final and not args.work:
        p.error("--keep-final needs --work (the default work folder is removed at the end)")
    if args.resume_from and not Path(args.resume_from).is_file():
        p.error(f"--resume-from: no report at {args.resume_from}")
    provenance = harness.start(__file__, quick=args.quick, allow_dirty=args.allow_dirty, also=("studies/learning_search.py",))
    harness.environment()

    from emapg.config import load_config
    from trainer.checkpoint import step_dir_name
    from trainer.config import TrainConfig

    t0 = time.perf_counter()
    settings = mode_settings(args)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="search-learning-"))
    work.mkdir(parents=True, exist_ok=True)
    train_args = argparse.Namespace(train_set=TRAIN_SET, override=[])
    base_cfg = load_config(TrainConfig, settings["config"], settings["extra"])
    r = base_cfg.rollout
    report: dict[str, Any] = {
        "benchmark": "search_learning", "protocol": "pre-registered in the script's docstring (committed before the run)",
        "mode": settings["mode"], "policy": settings["policy"], "steps": steps, "seeds": seeds, "train_set": TRAIN_SET,
        "overrides": settings["extra"],
        "rollout": {"group_size": r.n_samples, "prompts_per_step": base_cfg.data.prompts_per_step, "temperature": r.temperature,
                    "max_turns": r.max_turns, "uniform_groups": r.uniform_groups, "precision": base_cfg.run.precision},
        "search_slice": {"file": "data/qa/search_slice.json", "scoring": f"sampled mean@{SAMPLES} at T = {r.temperature}, top_p 1.0, "
                         f"qa_quick with {MAX_TURNS} turns, sampling seed {SEED_A} (starter's second scoring: {SEED_B})"},
        "reader_slice": {"file": "data/qa/reader_slice.json", "scoring": f"greedy, qa_quick with {MAX_TURNS} turns"},
        "algorithms": {alg: " ".join(o for o in ALGOS[alg] if not o.startswith("algorithm.name")) for alg in algos},
        "runs": {alg: {} for alg in algos}, "provenance": provenance,
    }  # fmt: skip
    starter_part(report, args.quick)
    if args.resume_from:
        taken = harness.import_runs(json.loads(Path(args.resume_from).read_text()), report, work, algos, seeds, PROTOCOL_KEYS)
        print(f"[search_learning] taken from {args.resume_from}: {', '.join(taken) or 'nothing new'}", flush=True)
    with harness.servers(settings["policy"], engine=settings["engine"], index_limit=settings["index_limit"],
                         max_model_len=r.max_prompt_tokens + r.max_response_tokens, folder=work) as served:  # fmt: skip
        url, engine_url = served.retriever_url, served.engine_url

        def scored(model: str, folder: Path) -> dict[str, Any]:
            """The search slice sampled (seed A) and the reader slice greedy of ``model``."""
            a = evaluate(model, folder / "search_a", url, engine_url, settings, slice_name="search", seed=SEED_A, temperature=r.temperature)
            g = evaluate(model, folder / "reader_greedy", url, engine_url, settings, slice_name="reader")
            for d in (a, g):
                check_heldout(d)
            return {"search": search_scores(a), "reader_greedy": greedy_em(g)}

        starter_file = work / "starter.json"
        if not starter_file.is_file():
            first = scored(settings["policy"], work / "start")
            b = evaluate(settings["policy"], work / "start" / "search_b", url, engine_url, settings, slice_name="search", seed=SEED_B,
                         temperature=r.temperature)
            starter_file.write_text(json.dumps({"search_a": first["search"], "search_b": search_scores(b),
                                                "reader_greedy": first["reader_greedy"]}) + "\n")
        report["starter"] = starter = json.loads(starter_file.read_text())
        print(f"[search_learning] starter: search slice mean@{SAMPLES} EM {pct(starter['search_a']['em']):.1f} (seed A) / "
              f"{pct(starter['search_b']['em']):.1f} (seed B), searched again "
              f"{pooled_rate(starter['search_a'], 'searched_again', 'first_missed')}%, reader greedy "
              f"{pct(starter['reader_greedy']):.1f} [{(time.perf_counter() - t0) / 60:.1f} min]", flush=True)
        def train_and_score(alg: str, seed: int, run_dir: Path) -> dict[str, Any]:
            metrics, t_train = train_run(alg, seed, run_dir, url, engine_url, settings, train_args, steps)
            ckpt = run_dir / step_dir_name(steps)
            end = scored(str(ckpt / "policy"), run_dir)
            harness.finish_checkpoint(ckpt, keep_policy=args.keep_final)
            return {"steps": steps, "train_steps": [int(m["step"]) for m in metrics],
                    "train_reward": [float(m.get("filter/sampled_reward_mean", m["reward/mean"])) for m in metrics],
                    "informative_frac": [informative_fraction(m) for m in metrics],
                    "searches_per_trajectory": [float(m.get("search/per_traj", float("nan"))) for m in metrics],
                    "train_s": round(t_train, 1), "per_question": end}  # fmt: skip

        for alg, seed, run, _kept in harness.arm_runs(work, algos, seeds, train_and_score):
            report["runs"][alg][str(seed)] = run
            harness.write_report(summarise(dict(report), algos, complete=False), Path(args.out).with_suffix(".partial.json"))
            print(f"[search_learning] {alg} seed {seed}: search mean@{SAMPLES} EM {pct(starter['search_a']['em']):.1f} -> "
                  f"{pct(run['per_question']['search']['em']):.1f}, searched again "
                  f"{pooled_rate(run['per_question']['search'], 'searched_again', 'first_missed')}%, reader greedy "
                  f"{pct(run['per_question']['reader_greedy']):.1f} [{(time.perf_counter() - t0) / 60:.1f} min]", flush=True)

    report = summarise(report, algos, complete=True)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    harness.write_report(report, Path(args.out), plot)
    Path(args.out).with_suffix(".partial.json").unlink(missing_ok=True)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    for alg in algos:
        b = report[alg]
        ci = b["search_sampled_end_minus_start_seed_ci"]
        print(f"{alg:<8} search mean@{SAMPLES} EM {b['search_sampled_em_start']:.1f} -> {b['search_sampled_em_end']:.1f} "
              f"(seed-level [{ci[0]:+.1f}, {ci[1]:+.1f}]); searched again {b['searched_again_rate_start']} -> "
              f"{b['searched_again_rate_end']}; reader greedy {report['reader_greedy_em_start']:.1f} -> {b['reader_greedy_em_end']:.1f}")
    print(f"wall {report['wall_s'] / 60:.1f} min; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
