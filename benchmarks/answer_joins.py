"""How often does a right final answer score 0 because an earlier, cut-off answer was joined to it?

The search task reads the answer with Search-R1's pattern (``tasks.qa.extract_answer``): the non-greedy
``<answer>(.*?)</answer>`` over the model's turns joined by newlines. A turn that runs out of tokens inside
``<answer>`` leaves it open; the corrective message follows, the model answers again, and the pattern then reads
from the first ``<answer>`` to the only ``</answer>``: ``"New Yo … <answer> New York City"``, which matches no gold.
``reward.qa_answer=last_complete`` reads the last complete answer instead (training only; evaluation keeps the
paper's rule).

No run stores its trajectories' texts in the repository (``benchmarks/results`` holds numbers; demo and benchmark
run folders are not kept), so this script measures fresh rollouts of the shipped starter under the demo's protocol
(``qa_quick``: 2 searches, 64 tokens per turn) through the real retriever over the bundled index:

* ``heldout_greedy`` / ``heldout_sampled``: the demo's 105 held-out questions (15 per QA set, data seed 0), greedy
  and ``--n`` samples at T = 1 (the demo's sampled evaluation: mean@2, seed 1);
* ``pool_sampled``: ``--pool`` questions of the training pool (``qa_pool``), ``--n`` samples at T = 1 (what the demo's
  training samples at its first step);
* any ``--train-run`` folders: their ``samples.jsonl`` (the trajectories a training run logged,
  ``logging.log_samples``).

A sample counts as *lost* when its scored prediction joined an earlier answer (``tasks.qa.joined_answer``), it
scored 0, and its last complete answer is an exact match. Output: ``benchmarks/results/answer_joins.json``.

    python benchmarks/answer_joins.py --work /tmp/answer_joins            # ~7 min on 2 cores (vLLM)
    python benchmarks/answer_joins.py --work DIR --count-only --train-run RUN   # count what DIR and RUN hold
    python benchmarks/answer_joins.py --count-only --eval-run EVAL --out /tmp/j.json   # any evaluation
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"


def eval_commands(work: Path, n: int, pool: int) -> dict[str, list[str]]:
    """The ``emapg eval`` runs, by name (the demo's held-out questions and protocol; the pool as training samples it)."""
    from emapg.models import STARTER

    base = ["eval", "--model", STARTER, "--suite", "qa", "--protocol", "qa_quick", "--no-progress", "--batch-across-datasets"]
    heldout = ["--limit", "15", "--data-seed", "0", "--batch-size", "105"]
    sampled = ["--n", str(n), "--temperature", "1.0", "--top-p", "1.0"]
    return {
        "heldout_greedy": [*base, *heldout, "--out", str(work / "heldout_greedy")],
        "heldout_sampled": [*base, *heldout, *sampled, "--seed", "1", "--out", str(work / "heldout_sampled")],
        "pool_sampled": [*base, "--datasets", "nq", "--data-path", f"nq={ROOT / 'data/qa/pool/train.jsonl.gz'}",
                         "--limit", str(pool), "--data-seed", "0", "--batch-size", str(pool), *sampled, "--seed", "0",
                         "--score-trained-apart", "--out", str(work / "pool_sampled")],
    }


def classify(prediction: str | None, golds: list[str]) -> dict[str, int]:
    """One scored sample: answered, joined (its prediction swallowed an open ``<answer>``), lost (joined, scored 0,
    and its last complete answer is right)."""
    from tasks.qa import exact_match, joined_answer, last_complete_answer

    joined = joined_answer(prediction)
    last = last_complete_answer(prediction).strip() if joined else prediction
    lost = joined and exact_match(prediction, golds) == 0.0 and exact_match(last, golds) == 1.0
    return {"samples": 1, "answered": int(prediction is not None), "joined": int(joined), "lost": int(lost),
            "right": int(exact_match(prediction, golds) == 1.0)}


def _add(total: dict[str, int], one: dict[str, int]) -> None:
    for k, v in one.items():
        total[k] = total.get(k, 0) + v


def count_eval(run_dir: Path) -> dict[str, Any]:
    """Counts over every sample of an ``emapg eval`` run's items (every dataset it scored)."""
    total: dict[str, int] = {}
    examples = []
    for path in sorted((run_dir / "items").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            for s in row.get("samples") or [row]:
                one = classify(s.get("prediction"), row["golds"])
                _add(total, one)
                if one["lost"] and len(examples) < 5:
                    examples.append({"id": row["id"], "golds": row["golds"][:3], "prediction": s["prediction"]})
    return {**total, "examples": examples}


def count_samples(rows: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Counts over a training run's ``samples.jsonl`` rows (``answer`` is the scored prediction)."""
    total: dict[str, int] = {}
    examples = []
    for row in rows:
        one = classify(row.get("answer"), row["golds"])
        _add(total, one)
        if one["lost"] and len(examples) < 5:
            examples.append({"question": row["question"], "golds": row["golds"][:3], "prediction": row["answer"]})
    return {**total, "examples": examples}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default=None, help="folder for the evaluations (kept; a rerun resumes them); needed unless --count-only")
    p.add_argument("--n", type=int, default=2, help="samples per question of the sampled runs (T = 1; the demo's mean@2)")
    p.add_argument("--pool", type=int, default=96, help="training-pool questions sampled")
    p.add_argument("--train-run", action="append", default=[], help="a training run folder whose samples.jsonl to count")
    p.add_argument("--eval-run", action="append", default=[], help="any emapg eval output folder whose items to count")
    p.add_argument("--count-only", action="store_true", help="count what --work and --train-run hold; run nothing")
    p.add_argument("--note", default="", help="how the --train-run / --eval-run folders were made (recorded in the JSON)")
    p.add_argument("--out", default=str(RESULTS / "answer_joins.json"))
    args = p.parse_args(argv)
    for k, v in {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_KVCACHE_SPACE": "3"}.items():
        os.environ.setdefault(k, v)
    if args.work is None and not args.count_only:
        p.error("--work is needed to run the evaluations (or --count-only with --eval-run / --train-run)")
    work = Path(args.work) if args.work else None
    commands = eval_commands(work, args.n, args.pool) if work else {}
    t0 = time.perf_counter()
    if not args.count_only:
        for name, cmd in commands.items():
            print(f"[answer_joins] {name}: emapg {' '.join(cmd)}", flush=True)
            subprocess.run([sys.executable, "-m", "app.cli", *cmd], check=True, cwd=ROOT)
    runs = {name: count_eval(work / name) for name in commands if work and (work / name / "items").is_dir()}
    for run in args.eval_run:
        runs[f"eval:{Path(run).name}"] = count_eval(Path(run))
    for run in args.train_run:
        rows = [json.loads(x) for x in (Path(run) / "samples.jsonl").read_text().splitlines() if x.strip()]
        runs[f"train:{Path(run).name}"] = {**count_samples(rows), "steps": len({r.get("step") for r in rows})}
    if not runs:
        raise SystemExit("answer_joins: nothing to count (no eval items under --work, no --train-run)")
    for name, c in runs.items():
        print(f"{name}: {c['samples']} samples, {c['answered']} answered, {c['right']} right; joined {c['joined']}, "
              f"right but scored 0 {c['lost']} ({100 * c['lost'] / max(c['samples'], 1):.1f}% of samples, "
              f"{100 * c['lost'] / max(c['right'] + c['lost'], 1):.1f}% of right final answers)")
    report = {
        "benchmark": "answer_joins",
        "date": time.strftime("%Y-%m-%d"),
        "what": __doc__.split("\n\n")[0],
        "policy": "smollm2-135m-search-starter (the shipped starter)",
        "protocol": "qa_quick (2 searches, 64 tokens per turn, top-3 passages, 256-token observations)",
        "commands": {name: "emapg " + " ".join(cmd) for name, cmd in commands.items()},
        "train_runs": args.train_run,
        "note": args.note,
        "eval_runs": args.eval_run,
        "runs": runs,
        "lost_over_right": {name: c["lost"] / max(c["right"] + c["lost"], 1) for name, c in runs.items()},
        "count_only": args.count_only,  # true: the runs were made before (their commands above), only counted here
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
