"""The second and third starters against the first, greedy, on the search and reader slices (issue 53, item 6).

    /work/heavy python benchmarks/starter_comparison.py            # 20 questions per slice and dataset, ~6 min a starter (vLLM CPU)
    /work/heavy python benchmarks/starter_comparison.py --starters starter_v3   # one starter; the others' entries kept
    /work/heavy python benchmarks/starter_comparison.py --limit 0  # every slice question, ~15 min
    python benchmarks/starter_comparison.py --quick                # smoke: 3 questions per slice, hf engine

The starters (``smollm2-135m-search-starter``, ``-v2``, ``-v3``) are evaluated by ``emapg eval``
with the same protocol (``qa_quick`` with 3 turns, so a policy can search twice and still answer; greedy; top-3
passages of the bundled index, served once on a free port) on the recorded search slice (``data/qa/search_slice.json``)
and reader slice (``data/qa/reader_slice.json``: held-out questions whose gold the first search for the question text
showed the first starter, i.e. questions the first search answers). Per starter and slice: greedy EM, searches per
question, the rate of searching again when the first passages lacked the gold, and how often the second query's
passages hold it (:mod:`eval.search_metrics`). Writes ``benchmarks/results/starter_comparison.json``.

Targets (issue 53): on the search slice, v2 greedy EM >= v1 + 10 pp and searches per question >= 1.6; on the reader
slice, v2 no worse than -3 pp, searches per question <= 1.3. ``difference``/``targets`` are v2's against v1 (as first
recorded); ``difference_v3``/``targets_v3`` the third starter's against v1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
OUT = REPO / "benchmarks" / "results" / "starter_comparison.json"
STARTERS = {"starter_v1": "smollm2-135m-search-starter", "starter_v2": "smollm2-135m-search-starter-v2",
            "starter_v3": "smollm2-135m-search-starter-v3"}
PROTOCOL = ["--protocol", "qa_quick", "--max-turns", "3"]


def evaluate(model: str, slice_name: str, out: Path, url: str, engine: str, limit: int | None) -> dict:
    args = [sys.executable, "-m", "app.cli", "eval", "--model", model, "--slice", slice_name, "--out", str(out),
            "--retriever-url", url, "--engine", engine, "--no-progress", "--batch-across-datasets", *PROTOCOL]
    if limit is not None:
        args += ["--limit", str(limit)]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"emapg eval failed ({model}, {slice_name}):\n{proc.stderr[-3000:]}")
    return json.loads((out / "results.json").read_text())


def against_first(first: dict, other: dict) -> tuple[dict, dict]:
    """A later starter's difference from the first (pp) and the issue's targets."""
    diff = {"search_greedy_em_pp": round(other["search_greedy_em"] - first["search_greedy_em"], 2),
            "reader_greedy_em_pp": round(other["reader_greedy_em"] - first["reader_greedy_em"], 2)}
    return diff, {
        "search_em_plus_10pp": diff["search_greedy_em_pp"] >= 10,
        "search_searches_per_question_ge_1.6": (other["search_searches_per_question"] or 0) >= 1.6,
        "reader_no_worse_than_minus_3pp": diff["reader_greedy_em_pp"] >= -3,
        "reader_searches_per_question_le_1.3": (other["reader_searches_per_question"] or 0) <= 1.3,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="3 questions per slice and dataset, hf engine, a temp result file")
    p.add_argument("--work", default="/tmp/emapg-starter-comparison", help="folder for the evaluation runs")
    p.add_argument("--engine", default=None, help="generation engine (default: vllm; hf with --quick)")
    p.add_argument("--limit", type=int, default=20, help="questions per slice and dataset (a seeded sample, eval's "
                   "--limit --data-seed 0); 0: every slice question (~15 min on 2 cores)")
    p.add_argument("--starters", nargs="+", choices=list(STARTERS), default=list(STARTERS),
                   help="the starters to evaluate; the others' entries are kept from the result file (with their "
                   "own wall_s and date)")
    p.add_argument("--summarise-only", action="store_true", help="evaluate nothing: recompute the result from the "
                   "evaluation runs already in --work (each run's recorded items)")
    p.add_argument("--variant", action="append", default=[], metavar="KEY=MODEL",
                   help="also evaluate MODEL (an alias or a policy folder, e.g. an SFT run's policy/) under KEY, "
                   "to measure a build variant beside the starters")
    args = p.parse_args(argv)
    starters = dict(STARTERS) | dict(v.split("=", 1) for v in args.variant)
    args.starters = list(args.starters) + [v.split("=", 1)[0] for v in args.variant]
    from eval.search_metrics import by_slice
    from eval.items import read_items
    from provision.indexes import ensure_bundled_index
    from provision.retrievers import open_retriever

    engine = args.engine or ("hf" if args.quick else "vllm")
    limit = 3 if args.quick else (args.limit or None)
    work = Path(args.work)
    t0 = time.perf_counter()
    out = work / "starter_comparison.json" if args.quick else OUT
    before = json.loads(out.read_text()) if out.is_file() else {}
    result: dict = {"benchmark": "starter_comparison", "protocol": "qa_quick, max_turns 3, greedy, top-3, bundled MiniLM index",
                    "engine": engine, "quick": args.quick, "limit_per_slice_and_dataset": limit}
    with contextlib.nullcontext() if args.summarise_only else open_retriever(index_dir=ensure_bundled_index(), topk=3) as retriever:
        for key, model in starters.items():
            if key not in args.starters:
                if key in before:
                    result[key] = before[key] | {"evaluated": before[key].get("evaluated", before.get("date"))}
                continue
            side = {"model": model}
            for slice_name in ("search", "reader"):
                run = work / f"{key}_{slice_name}"
                res = json.loads((run / "results.json").read_text()) if args.summarise_only else \
                    evaluate(model, slice_name, run, retriever.urls[0], engine, limit)
                records = [r for ds in res["datasets"] for r in read_items(run, ds)]
                m = by_slice(records)["all"]
                side[f"{slice_name}_questions"] = m["questions"]
                side[f"{slice_name}_greedy_em"] = round(100 * m["em"], 2)
                side[f"{slice_name}_searches_per_question"] = m["searches_per_question"]
                side[f"{slice_name}_searches"] = m["searches"]
                side[f"{slice_name}_searched_again_rate"] = m["searched_again_rate"]
                side[f"{slice_name}_second_holds_gold_rate"] = m["second_holds_gold_rate"]
                print(f"{key} {slice_name}: EM {side[f'{slice_name}_greedy_em']:.1f}, searches/question "
                      f"{m['searches_per_question']}", flush=True)
            result[key] = side | {"evaluated": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if "starter_v1" not in result:
        raise SystemExit("the first starter's entry is needed (evaluate it, or keep it in the result file)")
    v1 = result["starter_v1"]
    result["search_questions"] = v1["search_questions"]
    for key, suffix in (("starter_v2", ""), ("starter_v3", "_v3"), *((k, f"_{k}") for k in starters if k not in STARTERS)):
        if key in result:
            result[f"difference{suffix}"], result[f"targets{suffix}"] = against_first(v1, result[key])
    if args.summarise_only:  # the evaluations' own wall time and date stay; when it was summarised is added
        result.update({k: before[k] for k in ("wall_s", "date", "wall_s_by_starter") if k in before},
                      summarised=time.strftime("%Y-%m-%dT%H:%M:%S"))
    else:
        earlier = {",".join(k for k in STARTERS if k in before): before["wall_s"]} if "wall_s" in before else {}
        result["wall_s_by_starter"] = before.get("wall_s_by_starter", earlier) | {
            ",".join(args.starters): round(time.perf_counter() - t0, 1)}
        result["wall_s"] = round(time.perf_counter() - t0, 1)
        result["date"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    if set(args.starters) != set(STARTERS) and "note" in before:
        result["note"] = before["note"]
    result["machine"] = {"platform": platform.platform(), "cpus": __import__("os").cpu_count()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("difference", "targets", "difference_v3", "targets_v3") if k in result},
                     indent=1))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
