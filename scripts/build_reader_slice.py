"""Record the reader slice (``data/qa/reader_slice.json``, :mod:`eval.reader_slice`): the held-out questions whose
gold answer the shipped starter is shown when it answers greedily.

One greedy evaluation (``qa_quick``) of the starter on the whole recorded held-out split (100 questions per QA
set, ``data/qa/heldout.json``) through the real retriever over the bundled index; every question is recorded with
its greedy searches' retrieved passage ids and whether it is in the slice (:data:`eval.reader_slice.RULE`), with
the starter's digest. Run it again only when the starter is rebuilt (``tests/eval/test_reader_slice.py`` fails
while the digest differs); never after looking at an RL result.

    python scripts/build_reader_slice.py            # ~8 min on 2 cores (vLLM)
    python scripts/build_reader_slice.py --quick    # smoke run: tiny-qwen2, 2 questions per set, hf engine, a temp file
    python scripts/build_reader_slice.py --compare-recorded   # the recorded slice under today's rule (nothing written)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny-qwen2, 2 held-out questions per set, hf engine")
    p.add_argument("--out", default=None, help="output file (default data/qa/reader_slice.json; quick: a temp folder)")
    p.add_argument("--work", default=None, help="folder for the evaluation (default: a temp folder, removed)")
    p.add_argument("--compare-recorded", action="store_true",
                   help="recompute the recorded slice's membership by its own rule and by today's (eval.reader_slice.RULE) "
                        "from its recorded passages, print what today's rule would change, write nothing")
    p.add_argument("--json", default=None, help="--compare-recorded: also write the comparison to this JSON file "
                                                "(benchmarks/results/reader_slice_rule.json)")
    args = p.parse_args(argv)
    if args.compare_recorded:
        return compare_recorded(args.json)
    for k, v in {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_KVCACHE_SPACE": "3"}.items():
        os.environ.setdefault(k, v)

    from emapg.atomic import write_text_atomic
    from emapg.models import STARTER
    from eval.protocols import get_protocol
    from eval.reader_slice import READER_SLICE_FILE, slice_from_eval
    from eval.runner import EvalConfig, run_eval
    from provision.indexes import ensure_bundled_index
    from provision.retrievers import open_retriever
    from tasks.datasets import QA_DATASETS, heldout_ids

    t0 = time.perf_counter()
    policy = "tiny-qwen2" if args.quick else STARTER
    per_dataset = 2 if args.quick else 100
    work = Path(args.work or tempfile.mkdtemp(prefix="reader-slice-"))
    work.mkdir(parents=True, exist_ok=True)
    out = Path(args.out) if args.out else (work / READER_SLICE_FILE.name if args.quick else READER_SLICE_FILE)
    protocol = get_protocol("qa_quick", **({"max_tokens": 24} if args.quick else {}))
    with open_retriever(index_dir=ensure_bundled_index(2000 if args.quick else None), log_path=work / "retriever.log") as retriever:
        cfg = EvalConfig(model=policy, out=str(work / "eval"), protocol=protocol, datasets=list(QA_DATASETS), limit=per_dataset,
                         data_seed=0, engine="hf" if args.quick else "vllm", retriever_url=retriever.urls[0],
                         batch_across_datasets=True, batch_size=per_dataset * len(QA_DATASETS), progress=True, name="reader_slice")
        run_eval(cfg)
    from transformers import AutoTokenizer

    from emapg.models import resolve_model

    record = slice_from_eval(work / "eval", QA_DATASETS, starter=policy, tokenizer=AutoTokenizer.from_pretrained(resolve_model(policy)),
                             protocol={k: getattr(protocol, k) for k in ("name", "max_turns", "max_tokens", "max_obs_tokens",
                                                                         "retrieval_topk", "temperature")})
    for ds, rows in record["questions"].items():
        outside = {q["id"] for q in rows} - set(heldout_ids(ds))
        if outside:
            raise SystemExit(f"build_reader_slice: {ds}: {len(outside)} evaluated questions are not held out")
    record["wall_s"] = round(time.perf_counter() - t0, 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, json.dumps(record, indent=1) + "\n")
    print(f"reader slice: {record['size']} of {record['heldout_questions']} held-out questions "
          f"({', '.join(f'{ds} {len(v)}' for ds, v in record['ids'].items())}); wrote {out}")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0


def compare_recorded(json_out: str | None = None) -> int:
    """The recorded slice by its own rule (must give its recorded membership) and by :data:`eval.reader_slice.RULE`."""
    from transformers import AutoTokenizer

    from emapg.models import resolve_model
    from eval.reader_slice import RULE_NAME, load_reader_slice, recompute, rule_name

    recorded = load_reader_slice()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(recorded.starter))
    own = recompute(recorded, tokenizer, rule=rule_name(recorded.rule))
    today = recompute(recorded, tokenizer, rule=RULE_NAME)
    mismatch = [(ds, q["id"]) for ds, rows in recorded.questions.items() for q in rows if own[ds][q["id"]] != q["in_slice"]]
    if mismatch:
        raise SystemExit(f"build_reader_slice: {len(mismatch)} recorded memberships do not recompute, e.g. {mismatch[:3]}")
    print(f"recorded slice: {recorded.size} questions by {rule_name(recorded.rule)} (recomputed: identical); by {RULE_NAME}:")
    changed, per_dataset = 0, {}
    for ds, rows in recorded.questions.items():
        out = [q["id"] for q in rows if q["in_slice"] and not today[ds][q["id"]]]
        inn = [q["id"] for q in rows if not q["in_slice"] and today[ds][q["id"]]]
        changed += len(out) + len(inn)
        per_dataset[ds] = {"recorded": len(recorded.ids[ds]), "today": len(recorded.ids[ds]) - len(out) + len(inn),
                           "leaving": out, "joining": inn}
        print(f"  {ds}: {len(recorded.ids[ds])} -> {per_dataset[ds]['today']}"
              + (f" (leaving: {', '.join(out)})" if out else "") + (f" (joining: {', '.join(inn)})" if inn else ""))
    print(f"{changed} of {recorded.size} slice questions would change; the file is unchanged")
    # the starter's greedy answers on the slice, as the file records them (its per-question ``em``): the gap to its
    # sampled mean@k EM is what docs/learning.md quotes
    greedy_right = sum(q.get("em", 0.0) for rows in recorded.questions.values() for q in rows if q["in_slice"])
    print(f"the starter's recorded greedy answers: {greedy_right:g} of {recorded.size} slice questions right")
    if json_out:
        Path(json_out).write_text(json.dumps({
            "benchmark": "reader_slice_rule", "date": time.strftime("%Y-%m-%d"),
            "what": "the recorded reader slice (data/qa/reader_slice.json, unchanged) recomputed from its recorded passages "
                    "by its own rule and by today's, which leaves out gold answers the question names",
            "command": "python scripts/build_reader_slice.py --compare-recorded --json " + json_out,
            "recorded_rule": rule_name(recorded.rule), "today_rule": RULE_NAME, "recorded_questions": recorded.size,
            "recomputed_identical": True, "changed": changed, "today_questions": sum(v["today"] for v in per_dataset.values()),
            "recorded_starter_greedy_right": greedy_right,
            "per_dataset": per_dataset}, indent=2) + "\n")
        print(f"wrote {json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
