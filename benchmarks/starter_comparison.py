"""The second starter against the first, greedy, on the search slice and the reader slice (issue 53, item 6's first part).

    /work/heavy python benchmarks/starter_comparison.py            # 20 questions per slice and dataset, ~6 min (vLLM CPU)
    /work/heavy python benchmarks/starter_comparison.py --limit 0  # every slice question, ~15 min
    python benchmarks/starter_comparison.py --quick                # smoke: 3 questions per slice, hf engine

Both starters (``smollm2-135m-search-starter``, ``smollm2-135m-search-starter-v2``) are evaluated by ``emapg eval``
with the same protocol (``qa_quick`` with 3 turns, so a policy can search twice and still answer; greedy; top-3
passages of the bundled index, served once on a free port) on the recorded search slice (``data/qa/search_slice.json``)
and reader slice (``data/qa/reader_slice.json``: held-out questions whose gold the first search for the question text
showed the first starter, i.e. questions the first search answers). Per starter and slice: greedy EM, searches per
question, the rate of searching again when the first passages lacked the gold, and how often the second query's
passages hold it (:mod:`eval.search_metrics`). Writes ``benchmarks/results/starter_comparison.json``.

Targets (issue 53): on the search slice, v2 greedy EM >= v1 + 10 pp and searches per question >= 1.6; on the reader
slice, v2 no worse than -3 pp, searches per question <= 1.3.
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
STARTERS = {"starter_v1": "smollm2-135m-search-starter", "starter_v2": "smollm2-135m-search-starter-v2"}
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="3 questions per slice and dataset, hf engine, a temp result file")
    p.add_argument("--work", default="/tmp/emapg-starter-comparison", help="folder for the evaluation runs")
    p.add_argument("--engine", default=None, help="generation engine (default: vllm; hf with --quick)")
    p.add_argument("--limit", type=int, default=20, help="questions per slice and dataset (a seeded sample, eval's "
                   "--limit --data-seed 0); 0: every slice question (~15 min on 2 cores)")
    p.add_argument("--summarise-only", action="store_true", help="evaluate nothing: recompute the result from the "
                   "evaluation runs already in --work (each run's recorded items)")
    args = p.parse_args(argv)
    from eval.search_metrics import by_slice
    from eval.items import read_items
    from provision.indexes import ensure_bundled_index
    from provision.retrievers import open_retriever

    engine = args.engine or ("hf" if args.quick else "vllm")
    limit = 3 if args.quick else (args.limit or None)
    work = Path(args.work)
    t0 = time.perf_counter()
    result: dict = {"benchmark": "starter_comparison", "protocol": "qa_quick, max_turns 3, greedy, top-3, bundled MiniLM index",
                    "engine": engine, "quick": args.quick, "limit_per_slice_and_dataset": limit}
    with contextlib.nullcontext() if args.summarise_only else open_retriever(index_dir=ensure_bundled_index(), topk=3) as retriever:
        for key, model in STARTERS.items():
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
            result[key] = side
    v1, v2 = result["starter_v1"], result["starter_v2"]
    result["search_questions"] = v2["search_questions"]
    result["difference"] = {"search_greedy_em_pp": round(v2["search_greedy_em"] - v1["search_greedy_em"], 2),
                            "reader_greedy_em_pp": round(v2["reader_greedy_em"] - v1["reader_greedy_em"], 2)}
    result["targets"] = {
        "search_em_plus_10pp": result["difference"]["search_greedy_em_pp"] >= 10,
        "search_searches_per_question_ge_1.6": (v2["search_searches_per_question"] or 0) >= 1.6,
        "reader_no_worse_than_minus_3pp": result["difference"]["reader_greedy_em_pp"] >= -3,
        "reader_searches_per_question_le_1.3": (v2["reader_searches_per_question"] or 0) <= 1.3,
    }
    out = work / "starter_comparison.json" if args.quick else OUT
    if args.summarise_only:  # the evaluations' own wall time and date stay; when it was summarised is added
        before = json.loads(out.read_text()) if out.is_file() else {}
        result.update({k: before[k] for k in ("wall_s", "date") if k in before}, summarised=time.strftime("%Y-%m-%dT%H:%M:%S"))
    else:
        result["wall_s"] = round(time.perf_counter() - t0, 1)
        result["date"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    result["machine"] = {"platform": platform.platform(), "cpus": __import__("os").cpu_count()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("difference", "targets")}, indent=1))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
