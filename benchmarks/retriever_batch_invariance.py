"""Does a query's retrieval depend on the queries it was batched with, and what does ``--batch-invariant`` cost?

A real ``emapg serve`` process over the bundled index (MiniLM, Flat, 43k passages; real HTTP on a free port, the
query cache off so that every request is encoded) answers the same real questions (the test split of every
bundled QA set, ``--per-set`` each, seeded) three ways:

* ``alone``: one question per request, one request at a time;
* ``together``: all questions in one request, in reverse order (the encoder packs them into shared rows and
  FAISS searches them with one matrix product);
* ``chunks``: requests of 8 questions in a seeded shuffled order (other company, other batch shapes).

Per condition (query encoder bf16 -- where the CPU has bf16 instructions -- and fp32; ``--batch-invariant`` off
and on) it reports how many top-3 lists differ between ``alone`` and the batched ways (in order, as sets) and
the largest score difference; the top-3 sets against fp32's ``alone`` lists (the precision's own effect,
for scale); and the time of each way, side by side on one machine, with the ratio of ``--batch-invariant`` to the
default: what repeatable retrieval costs.

    python benchmarks/retriever_batch_invariance.py          # ~3 min on 2 cores; run it on a quiet machine

Writes ``benchmarks/results/retriever_batch_invariance.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

OUT = REPO / "benchmarks" / "results" / "retriever_batch_invariance.json"
TOPK = 3
CHUNK = 8

Hits = list[list[tuple[str, float]]]


def differences(reference: Hits, other: Hits) -> dict[str, Any]:
    """How many of ``other``'s top-k lists differ from ``reference``'s (in order; as sets), and the largest score
    difference between lists of the same ids in the same order."""
    order = sum([i for i, _ in a] != [i for i, _ in b] for a, b in zip(reference, other))
    as_set = sum({i for i, _ in a} != {i for i, _ in b} for a, b in zip(reference, other))
    same = [(a, b) for a, b in zip(reference, other) if [i for i, _ in a] == [i for i, _ in b]]
    score = max((abs(x - y) for a, b in same for (_, x), (_, y) in zip(a, b)), default=0.0)
    return {"questions": len(reference), "top3_order_differs": int(order), "top3_set_differs": int(as_set),
            "max_abs_score_diff_same_lists": float(score)}  # fmt: skip


def ask(client: Any, questions: list[str], seed: int) -> tuple[dict[str, Hits], dict[str, float]]:
    """The three ways of asking (module docstring): hits per way in the questions' order, and seconds per way."""
    hits: dict[str, Hits] = {}
    seconds: dict[str, float] = {}
    as_pairs = lambda result: [[(h["id"], float(h["score"])) for h in hs] for hs in result]  # noqa: E731

    t0 = time.perf_counter()
    hits["alone"] = [as_pairs(client.retrieve([q], topk=TOPK))[0] for q in questions]
    seconds["alone"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    hits["together"] = as_pairs(client.retrieve(questions[::-1], topk=TOPK))[::-1]
    seconds["together"] = time.perf_counter() - t0

    perm = np.random.default_rng(seed).permutation(len(questions))
    got: dict[int, list[tuple[str, float]]] = {}
    t0 = time.perf_counter()
    for lo in range(0, len(perm), CHUNK):
        part = [int(i) for i in perm[lo : lo + CHUNK]]
        for i, hs in zip(part, as_pairs(client.retrieve([questions[i] for i in part], topk=TOPK))):
            got[i] = hs
    seconds["chunks"] = time.perf_counter() - t0
    hits["chunks"] = [got[i] for i in range(len(questions))]
    return hits, seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--per-set", type=int, default=60, help="test questions per bundled QA set (seeded sample)")
    p.add_argument("--seed", type=int, default=0, help="sampling and shuffling seed")
    p.add_argument("--out", default=str(OUT), help="where the JSON goes")
    args = p.parse_args(argv)

    from emapg.cpu import cpu_has_bf16
    from provision.indexes import ensure_bundled_index
    from retriever.client import RetrieverClient
    from retriever.index_files import read_meta
    from retriever.launch import RetrieverServer
    from tasks.datasets import QA_DATASETS, load_dataset

    index_dir = ensure_bundled_index(None, log=lambda m: None)
    questions = [ex.question for ds in QA_DATASETS for ex in load_dataset(ds, limit=args.per_set, seed=args.seed)]
    dtypes = ("bf16", "fp32") if cpu_has_bf16() else ("fp32",)
    conditions: dict[str, Any] = {}
    hits: dict[str, dict[str, Hits]] = {}
    t_start = time.perf_counter()
    for dtype in dtypes:
        for invariant in (False, True):
            name = f"{dtype}{'_batch_invariant' if invariant else ''}"
            extra = ["--bf16" if dtype == "bf16" else "--no-bf16", "--query-cache-size", "0", *(["--batch-invariant"] if invariant else [])]
            with RetrieverServer(index_dir, device="cpu", extra_args=extra) as server, RetrieverClient(server.url, timeout=600) as client:
                info = client.health()["index"]
                client.retrieve(questions[:16], topk=TOPK)  # warm: the first forwards trace and allocate
                hits[name], seconds = ask(client, questions, args.seed)
            conditions[name] = {
                "server": {k: info.get(k) for k in ("dtype", "batch_invariant", "encoder_parallel_forwards", "concurrent_batches",
                                                    "encoder_packed_rows", "encoder_traced", "query_cache_size")},
                "together_vs_alone": differences(hits[name]["alone"], hits[name]["together"]),
                "chunks_vs_alone": differences(hits[name]["alone"], hits[name]["chunks"]),
                "seconds": {k: round(v, 3) for k, v in seconds.items()},
                "queries_per_s": {k: round(len(questions) / v, 1) for k, v in seconds.items()},
            }  # fmt: skip
            row = conditions[name]
            print(f"{name:<22} together vs alone: top-3 order differs {row['together_vs_alone']['top3_order_differs']}, "
                  f"set {row['together_vs_alone']['top3_set_differs']}; chunks vs alone: {row['chunks_vs_alone']['top3_order_differs']}, "
                  f"{row['chunks_vs_alone']['top3_set_differs']} of {len(questions)}; q/s alone {row['queries_per_s']['alone']}, "
                  f"together {row['queries_per_s']['together']}, chunks {row['queries_per_s']['chunks']}", flush=True)
    reference = hits["fp32"]["alone"]
    for name, row in conditions.items():
        row["alone_vs_fp32_alone_top3_set_differs"] = differences(reference, hits[name]["alone"])["top3_set_differs"]
    cost = {dtype: {way: round(conditions[dtype]["seconds"][way] / conditions[f"{dtype}_batch_invariant"]["seconds"][way], 3)
                    for way in ("alone", "together", "chunks")} for dtype in dtypes}  # fmt: skip
    meta = read_meta(index_dir)
    result = {
        "benchmark": "retriever_batch_invariance",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "cpu_bf16_instructions": cpu_has_bf16(), "load_average_at_end": [round(x, 2) for x in os.getloadavg()]},
        "setup": {"index": index_dir.name, "index_type": meta["index_type"], "passages": meta["rows"], "encoder": meta["encoder"]["name"],
                  "questions": len(questions), "sample": f"test split of {', '.join(QA_DATASETS)}, up to {args.per_set} each (seed {args.seed})",
                  "topk": TOPK, "chunk": CHUNK, "query_cache_size": 0},
        "conditions": conditions,
        "invariant_throughput_ratio": cost,
        "invariant_throughput_ratio_help": "default seconds / --batch-invariant seconds for the same requests, per way: below 1 "
                                           "means --batch-invariant is slower by 1/ratio",
        "wall_s": round(time.perf_counter() - t_start, 1),
    }  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for dtype in dtypes:
        print(f"{dtype}: --batch-invariant throughput / default: together {cost[dtype]['together']}x, chunks {cost[dtype]['chunks']}x, "
              f"alone {cost[dtype]['alone']}x")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
