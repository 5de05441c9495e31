"""Write the fixed held-out split of every bundled QA set and the answerable training pool.

1. **Held-out split** (``data/qa/heldout.json``): for each of the seven QA sets, the question ids of the
   seeded sample ``load_dataset(name, limit=100, seed=0)`` of its test split (Bamboogle: 100 of 125). Every
   demo/benchmark evaluation (``--limit n --data-seed 0``, n <= 100) is a subset of it.
2. **Candidates**: every other question of the bundled QA files -- the test splits outside the held-out
   ids (NQ-open test, TriviaQA, PopQA, HotpotQA dev, 2Wiki dev, MuSiQue dev, Bamboogle), the HotpotQA
   train rows, the NQ train sample -- minus any question whose normalised text equals a held-out
   question's (:func:`tasks.heldout.question_key`, across all sets), deduplicated by that key (first
   occurrence in the order above).
3. **Answerability**: each candidate's and each held-out question's text is searched on the bundled
   MiniLM Flat index (the query the starter issues: ``<search> question </search>``), top-3 passages; a
   question is *answerable* when a gold answer occurs in one of them (:func:`tasks.qa.retrieval_recall`,
   the check the warm-start data uses).
4. **Pool** (``data/qa/pool/train.jsonl.gz``): the answerable candidates, each with its origin and the
   ids of its top-3 passages; ``data/qa/pool/record.json``: per source the candidates, answerable count
   and rate, and the same for the held-out split.

The answerable filter makes the pool 100% answerable *with the question itself as the query*; a policy
that searches otherwise may still miss. The corpus was assembled around the evaluation sets (see
``data/README.md``), so scores on it are not wiki-18 scores.

    python scripts/build_qa_pool.py                 # ~3 min on 2 cores (index from the shipped vectors)
    python scripts/build_qa_pool.py --check 200     # recompute 200 recorded rows and compare
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

POOL_DIR = ROOT / "data" / "qa" / "pool"
TOPK = 3
#: Where candidates come from, in priority order for deduplication: (dataset, split).
CANDIDATE_SOURCES: tuple[tuple[str, str], ...] = (
    ("nq", "test"), ("triviaqa", "test"), ("popqa", "test"), ("hotpotqa", "test"), ("2wikimultihopqa", "test"),
    ("musique", "test"), ("bamboogle", "test"), ("hotpotqa", "train"), ("nq", "train"),
)


def write_gzip_jsonl(path: Path, rows: list[dict]) -> None:
    """Byte-identical across runs: gzip level 9, mtime 0, no file name in the header."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=buf, mtime=0) as f:
        for r in rows:
            f.write((json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n").encode())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())


def top_passages(searcher, questions: list[str], batch: int = 256) -> list[list[dict]]:
    from tqdm import tqdm

    out: list[list[dict]] = []
    for i in tqdm(range(0, len(questions), batch), desc="searching", unit="batch", file=sys.stderr):
        out += searcher.retrieve(questions[i:i + batch], TOPK)
    return out


def answerable(hits: list[dict], answers: list[str]) -> bool:
    from tasks.qa import retrieval_recall

    return bool(retrieval_recall([h["contents"] for h in hits], answers))


def build(searcher) -> dict:
    from tasks.datasets import HELDOUT_FILE, HELDOUT_PER_DATASET, HELDOUT_SEED, QA_DATASETS, load_dataset
    from tasks.heldout import question_key

    heldout = {name: load_dataset(name, limit=HELDOUT_PER_DATASET, seed=HELDOUT_SEED) for name in QA_DATASETS}
    heldout_keys = {question_key(ex.question) for exs in heldout.values() for ex in exs}
    heldout_ids = {ex.id for exs in heldout.values() for ex in exs}
    HELDOUT_FILE.write_text(json.dumps({
        "rule": f"load_dataset(name, split='test', limit={HELDOUT_PER_DATASET}, seed={HELDOUT_SEED}) per QA set",
        "per_dataset": HELDOUT_PER_DATASET, "seed": HELDOUT_SEED,
        "ids": {name: [ex.id for ex in exs] for name, exs in heldout.items()},
    }, indent=1) + "\n")

    candidates, seen = [], set(heldout_keys)
    dropped_heldout: dict[str, int] = {}
    duplicates: dict[str, int] = {}
    for name, split in CANDIDATE_SOURCES:
        source = f"{name}/{split}"
        dropped_heldout[source] = duplicates[source] = 0
        for ex in load_dataset(name, split=split):
            key = question_key(ex.question)
            if ex.id in heldout_ids or key in heldout_keys:
                dropped_heldout[source] += 1
            elif not key or key in seen:
                duplicates[source] += 1
            else:
                seen.add(key)
                candidates.append((source, ex))

    held = [(name, ex) for name, exs in heldout.items() for ex in exs]
    hits = top_passages(searcher, [ex.question.strip() for _, ex in candidates] + [ex.question.strip() for _, ex in held])
    cand_hits, held_hits = hits[:len(candidates)], hits[len(candidates):]

    per_source: dict[str, dict] = {}
    pool = []
    for (source, ex), h in zip(candidates, cand_hits):
        s = per_source.setdefault(source, {"candidates": 0, "answerable": 0})
        s["candidates"] += 1
        if answerable(h, ex.answers):
            s["answerable"] += 1
            pool.append({"id": ex.id, "question": ex.question, "golden_answers": list(ex.answers),
                         "data_source": source.split("/")[0], "origin": source, "top3_ids": [x["id"] for x in h]})
    for source, s in per_source.items():
        s["candidate_answerable_rate"] = round(s["answerable"] / s["candidates"], 4)
        s["dropped_as_heldout"] = dropped_heldout[source]
        s["duplicates"] = duplicates[source]
    held_rate: dict[str, dict] = {}
    for (name, ex), h in zip(held, held_hits):
        s = held_rate.setdefault(name, {"questions": 0, "answerable": 0})
        s["questions"] += 1
        s["answerable"] += answerable(h, ex.answers)
    for s in held_rate.values():
        s["answerable_rate"] = round(s["answerable"] / s["questions"], 4)
    write_gzip_jsonl(POOL_DIR / "train.jsonl.gz", pool)
    n_held = sum(s["questions"] for s in held_rate.values())
    record = {
        "what": "answerable training pool: bundled QA questions outside every held-out split whose gold answer occurs in "
                "the top-3 passages retrieved for the question text (bundled MiniLM Flat index)",
        "index": searcher.fingerprint, "topk": TOPK,
        "answer_check": "tasks.qa.retrieval_recall (normalised, token-bounded)",
        "query": "the question text (as the starter's first search)",
        "pool_size": len(pool),
        "pool_answerable_rate": 1.0,
        "sources": per_source,
        "heldout": {"per_dataset": held_rate,
                    "pooled_answerable_rate": round(sum(s["answerable"] for s in held_rate.values()) / n_held, 4),
                    "questions": n_held},
        "not_wiki18": "the corpus was assembled around the evaluation sets (data/README.md): scores on it are not wiki-18 scores",
    }
    (POOL_DIR / "record.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def check(searcher, n: int) -> int:
    """Recompute the recorded top-3 ids and answerability of ``n`` pool rows (a seeded sample)."""
    from tasks.datasets import load_dataset

    rows = load_dataset("qa_pool", split="train", limit=n, seed=1)
    hits = top_passages(searcher, [ex.question.strip() for ex in rows])
    bad = [ex.id for ex, h in zip(rows, hits) if not answerable(h, ex.answers)]
    moved = [ex.id for ex, h in zip(rows, hits) if [x["id"] for x in h] != ex.meta["top3_ids"]]
    print(f"{len(rows)} pool rows rechecked: {len(bad)} no longer answerable, {len(moved)} with other top-3 ids")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", type=int, default=0, help="instead of building: recompute this many recorded pool rows")
    args = p.parse_args(argv)
    from provision.indexes import ensure_bundled_index
    from retriever.searcher import Searcher

    searcher = Searcher(ensure_bundled_index(None), device="cpu", bf16=False, encode_batch_size=128, encode_threads=2)
    if args.check:
        return check(searcher, args.check)
    t0 = time.perf_counter()
    record = build(searcher)
    print(json.dumps({k: record[k] for k in ("pool_size", "sources", "heldout")}, indent=1))
    print(f"done in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
