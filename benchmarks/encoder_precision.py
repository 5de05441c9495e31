"""What the retriever's bf16 query encoder (the default on CPUs with bf16 instructions) changes against fp32.

The bundled index (``provision.indexes``: MiniLM, Flat, 43k passages of ``data/corpus``) is served by two
:class:`retriever.searcher.Searcher` objects that differ only in the query encoder's dtype (``bf16=False``
and ``bf16=True``: the real packed and traced forwards, as the server runs them). Real questions from
``data/qa`` (the test split of every bundled QA set, ``--per-set`` each, seeded) are retrieved top-3 by both.
Reported, overall and per set:

* ``top3_same_ids``: the fraction of questions whose top-3 ids are the same set in both (and
  ``top3_same_order``, ``top1_same``);
* ``gold_recall_at_3``: the fraction of questions with a gold answer in the top-3 passages
  (:func:`tasks.qa.retrieval_recall`), for each dtype, their difference bf16 - fp32, and how many
  questions only one of them finds (the paired discordant counts);
* the cosine between each question's fp32 and bf16 vectors (min, mean);
* the encoder's own time for all the questions in each dtype (batches of 32, one thread; side by side).

    python benchmarks/encoder_precision.py            # ~1 min on 2 cores (the index from the shipped vectors)

Writes ``benchmarks/results/encoder_precision.json``. bf16 is only measured where the CPU has bf16
instructions (:func:`emapg.cpu.cpu_has_bf16`); elsewhere it is emulated and never the default.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

OUT = REPO / "benchmarks" / "results" / "encoder_precision.json"
TOPK = 3


def compare(fp32: list[list[dict]], bf16: list[list[dict]], answers: list[list[str]]) -> dict:
    """Agreement of two rankings of the same questions, and each one's gold recall@3."""
    from tasks.qa import retrieval_recall

    same_set = [{h["id"] for h in a} == {h["id"] for h in b} for a, b in zip(fp32, bf16)]
    same_order = [[h["id"] for h in a] == [h["id"] for h in b] for a, b in zip(fp32, bf16)]
    same_top1 = [a[0]["id"] == b[0]["id"] for a, b in zip(fp32, bf16)]
    r32 = np.array([retrieval_recall([h["contents"] for h in a], g) for a, g in zip(fp32, answers)])
    r16 = np.array([retrieval_recall([h["contents"] for h in b], g) for b, g in zip(bf16, answers)])
    return {
        "questions": len(answers),
        "top3_same_ids": round(float(np.mean(same_set)), 4),
        "top3_same_order": round(float(np.mean(same_order)), 4),
        "top1_same": round(float(np.mean(same_top1)), 4),
        "gold_recall_at_3": {"fp32": round(float(r32.mean()), 4), "bf16": round(float(r16.mean()), 4),
                             "bf16_minus_fp32": round(float(r16.mean() - r32.mean()), 4),
                             "only_fp32_finds": int(np.sum((r32 == 1) & (r16 == 0))),
                             "only_bf16_finds": int(np.sum((r16 == 1) & (r32 == 0)))},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--per-set", type=int, default=500, help="test questions per bundled QA set (seeded sample)")
    p.add_argument("--out", default=str(OUT), help="where the JSON goes")
    args = p.parse_args(argv)

    from emapg.cpu import cpu_has_bf16
    from provision.indexes import ensure_bundled_index
    from retriever.index_files import read_meta
    from retriever.searcher import Searcher
    from tasks.datasets import QA_DATASETS, load_dataset

    if not cpu_has_bf16():
        print("this CPU has no native bf16 (AVX512-BF16/AMX): bf16 is emulated here and never the default; nothing to measure")
        return 1
    index_dir = ensure_bundled_index(None, log=lambda m: None)
    examples = {ds: load_dataset(ds, limit=args.per_set, seed=0) for ds in QA_DATASETS}
    questions = [ex.question for exs in examples.values() for ex in exs]
    answers = [ex.answers for exs in examples.values() for ex in exs]

    searchers = {dt: Searcher(index_dir, device="cpu", bf16=dt == "bf16", encode_batch_size=32, encode_threads=1)
                 for dt in ("fp32", "bf16")}
    assert (searchers["fp32"].encoder.dtype, searchers["bf16"].encoder.dtype) == ("float32", "bfloat16")
    hits, encode_s, vectors = {}, {}, {}
    for rnd in range(2):  # alternate the order; the second round's encoder time is kept (warm)
        for dt in (("fp32", "bf16") if rnd == 0 else ("bf16", "fp32")):
            enc = searchers[dt].encoder
            t0 = time.perf_counter()
            vectors[dt] = enc.encode_queries(questions, batch_size=32)
            encode_s[dt] = time.perf_counter() - t0
    for dt, s in searchers.items():
        hits[dt] = s.retrieve(questions, TOPK)
    cos = np.sum(vectors["fp32"] * vectors["bf16"], axis=1)

    bounds, per_set, lo = {}, {}, 0
    for ds, exs in examples.items():
        bounds[ds] = (lo, lo + len(exs))
        lo += len(exs)
    for ds, (a, b) in bounds.items():
        per_set[ds] = compare(hits["fp32"][a:b], hits["bf16"][a:b], answers[a:b])
    overall = compare(hits["fp32"], hits["bf16"], answers)
    meta = read_meta(index_dir)
    result = {
        "benchmark": "encoder_precision",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "cpu_bf16_instructions": cpu_has_bf16(), "load_average_at_end": [round(x, 2) for x in os.getloadavg()]},
        "setup": {"index": str(index_dir.name), "index_type": meta["index_type"], "passages": meta["rows"],
                  "passage_vectors": (meta.get("build") or {}).get("dtype"), "encoder": meta["encoder"]["name"],
                  "questions": f"test split of {', '.join(QA_DATASETS)}, up to {args.per_set} each (seed 0)", "topk": TOPK},
        "overall": overall,
        "per_set": per_set,
        "query_vector_cosine": {"min": round(float(cos.min()), 6), "mean": round(float(cos.mean()), 6)},
        "encode_seconds": {dt: round(v, 2) for dt, v in encode_s.items()},
        "fp32_over_bf16_encode_time": round(encode_s["fp32"] / encode_s["bf16"], 2),
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    g = overall["gold_recall_at_3"]
    print(f"{overall['questions']} questions: top-3 ids same {overall['top3_same_ids']:.1%}, top-1 same {overall['top1_same']:.1%}; "
          f"gold recall@3 fp32 {g['fp32']:.4f}, bf16 {g['bf16']:.4f} ({g['bf16_minus_fp32']:+.4f}; only fp32 {g['only_fp32_finds']}, "
          f"only bf16 {g['only_bf16_finds']}); cosine min {cos.min():.6f}; encode fp32/bf16 {result['fp32_over_bf16_encode_time']}x")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
