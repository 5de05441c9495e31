"""Offline difficulty curation of the training pool: keep the questions the starter sometimes solves.

GRPO learns only from groups whose rewards differ. On the answerable pool (``qa_pool``) the starter's
per-question success is bimodal: measured on 48 questions x 8 samples at T = 1.0, 54% of the questions are
never solved and some are always solved, so only 34% of groups of 4 carry a gradient and dynamic sampling
pays for up to three extra prompt batches per step. This script measures the starter itself, once, offline
(the difficulty filtering of POLARIS / Skywork-OR1; DAPO's dynamic sampling done ahead of time):

1. a seeded sample of ``--questions`` pool questions, leaving out those the starter was warm-started on
   (its ``trained_questions.json``);
2. ``--samples`` trajectories each, sampled by the starter with the demo's rollout settings (the ``qa_quick``
   loop: 2 searches of top-3 passages, 64 tokens per turn, 256-token observations) at the training
   temperature, through the real retriever over the bundled index, scored by exact match
   (:func:`eval.runner.run_eval`);
3. ``data/qa/pool/informative.jsonl.gz``: the questions solved by some but not all samples (each row keeps
   its pool fields plus ``starter_pass``: correct / samples), registered as the dataset
   ``qa_pool_informative``; ``data/qa/pool/informative_record.json``: the starter, protocol, the histogram
   of correct counts and the measured rates.

The kept questions were selected on these very samples, so their informative share on *fresh* samples is
lower than 100% (regression to the mean); the trainer measures it at every step
(``filter/first_round_informative_frac``), and that is the number the docs report.

    python scripts/curate_pool.py                      # 160 questions x 4 samples (~6 min on 2 cores)
    python scripts/curate_pool.py --quick              # smoke run: tiny-qwen2, 8 questions x 2, a 2k-passage index
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

POOL_DIR = ROOT / "data" / "qa" / "pool"
POOL_FILE = POOL_DIR / "train.jsonl.gz"
OUT_FILE = POOL_DIR / "informative.jsonl.gz"
RECORD_FILE = POOL_DIR / "informative_record.json"


def read_pool(path: Path = POOL_FILE) -> list[dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def candidates(pool: list[dict[str, Any]], n: int, seed: int, starter: str) -> list[dict[str, Any]]:
    """``n`` pool rows chosen by the datasets' seeded sampler, none of them in the starter's warm-start data."""
    from emapg.models import resolve_model
    from tasks.contamination import read_trained_questions
    from tasks.datasets import load_dataset

    trained = read_trained_questions(resolve_model(starter))
    eligible = [ex for ex in load_dataset("qa_pool", split="train")
                if trained is None or not trained.contains(ex.question)]
    # The datasets' seeded sampler (sha256 of seed and id): a larger --questions contains the smaller choice.
    ranked = sorted(eligible, key=lambda ex: hashlib.sha256(f"{seed}\x00{ex.id}".encode()).digest())
    chosen = {ex.id for ex in ranked[:n]}
    return [r for r in pool if r["id"] in chosen]


def correct_counts(eval_dir: Path) -> dict[str, tuple[int, int]]:
    """``{question id: (correct, samples)}`` from an evaluation folder's per-item records."""
    from emapg.jsonl import read_jsonl

    counts: dict[str, tuple[int, int]] = {}
    for path in sorted(eval_dir.rglob("*.jsonl")):
        for item in read_jsonl(path):
            samples = item.get("samples") or []
            if samples:  # a QA item: every sample's exact match (the trainer's reward)
                counts[str(item["id"])] = (sum(s["scores"]["em"] >= 1.0 for s in samples), len(samples))
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--questions", type=int, default=160, help="pool questions to measure (a seeded sample)")
    p.add_argument("--samples", type=int, default=4, help="trajectories per question (the demo's group size)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (the demo's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the question sample and of the sampling")
    p.add_argument("--policy", default=None, help="the policy to measure (default: emapg.models.STARTER)")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny-qwen2, 8 questions x 2 samples, 2k-passage index, hf engine")
    p.add_argument("--out", default=None, help=f"output file (default {OUT_FILE.relative_to(ROOT)}; quick: a temp folder)")
    p.add_argument("--work", default=None, help="folder for the evaluation (default: a temp folder, removed)")
    args = p.parse_args(argv)
    for k, v in {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_KVCACHE_SPACE": "3"}.items():
        os.environ.setdefault(k, v)

    from emapg.models import STARTER
    from eval.protocols import get_protocol
    from eval.runner import EvalConfig, run_eval
    from provision.indexes import ensure_bundled_index
    from provision.retrievers import open_retriever
    from scripts.build_qa_pool import write_gzip_jsonl

    t0 = time.perf_counter()
    policy = "tiny-qwen2" if args.quick else (args.policy or STARTER)
    n_questions, n_samples = (8, 2) if args.quick else (args.questions, args.samples)
    if n_samples < 2:
        p.error("--samples must be >= 2: one sample cannot tell 'sometimes' from 'always'")
    work = Path(args.work or tempfile.mkdtemp(prefix="curate-pool-"))
    out = Path(args.out) if args.out else (work / OUT_FILE.name if args.quick else OUT_FILE)
    pool = read_pool()
    rows = candidates(pool, n_questions, args.seed, policy)
    questions_file = work / "candidates.jsonl"
    questions_file.parent.mkdir(parents=True, exist_ok=True)
    questions_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    protocol = get_protocol("qa_quick", n=n_samples, temperature=args.temperature, top_p=1.0, seed=args.seed,
                            **({"max_tokens": 24} if args.quick else {}))
    index_dir = ensure_bundled_index(2000 if args.quick else None)
    with open_retriever(index_dir=index_dir, log_path=work / "retriever.log") as retriever:
        cfg = EvalConfig(model=policy, out=str(work / "eval"), protocol=protocol, datasets=["qa_pool"],
                         data_paths={"qa_pool": str(questions_file)}, engine="hf" if args.quick else "vllm",
                         retriever_url=retriever.urls[0], batch_size=64, progress=True, name="curate_pool")
        run_eval(cfg)
    counts = correct_counts(work / "eval")
    missing = [r["id"] for r in rows if r["id"] not in counts]
    if missing:
        raise SystemExit(f"curate_pool: {len(missing)} questions have no result (e.g. {missing[:3]}); see {work}")
    kept = [{**r, "starter_pass": [counts[r["id"]][0], n_samples]} for r in rows if 0 < counts[r["id"]][0] < n_samples]
    write_gzip_jsonl(out, kept)
    hist = Counter(c for c, _ in counts.values())
    solved = sum(c for c, _ in counts.values()) / (n_samples * len(rows))
    record = {
        "what": "pool questions the starter solves sometimes but not always (offline difficulty curation)",
        "policy": policy, "questions_measured": len(rows), "samples_per_question": n_samples,
        "temperature": args.temperature, "seed": args.seed,
        "protocol": {k: getattr(protocol, k) for k in ("name", "max_turns", "max_tokens", "max_obs_tokens",
                                                       "retrieval_topk", "max_response_tokens", "top_p")},
        "correct_count_histogram": {str(c): hist.get(c, 0) for c in range(n_samples + 1)},
        "trajectories_correct_frac": round(solved, 4),
        "never_solved_frac": round(hist.get(0, 0) / len(rows), 4),
        "always_solved_frac": round(hist.get(n_samples, 0) / len(rows), 4),
        "kept": len(kept), "kept_frac": round(len(kept) / len(rows), 4),
        "kept_by_origin": dict(sorted(Counter(r.get("origin", r.get("data_source", "?")) for r in kept).items())),
        "wall_s": round(time.perf_counter() - t0, 1),
        "note": "selected on these samples: the informative share on fresh samples is lower (regression to the mean); "
                "the trainer logs it per step as filter/first_round_informative_frac",
    }
    record_path = out.with_name("informative_record.json") if args.out or args.quick else RECORD_FILE
    record_path.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: record[k] for k in ("questions_measured", "correct_count_histogram", "trajectories_correct_frac",
                                             "kept", "kept_frac", "wall_s")}))
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
