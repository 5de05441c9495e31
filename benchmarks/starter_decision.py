"""Does a starter's choice between answering and searching again follow the passages? (issue 53, the third starter)

    /work/heavy python benchmarks/starter_decision.py --runs /tmp/emapg-starter-comparison   # ~10 min a starter on 2 cores

Greedy decisions can hide a weak signal: a policy that leans one way answers (or searches again) on every question
whatever it was shown. This reads the third starter's recorded greedy trajectories (``starter_comparison.py``'s
evaluation runs, ``<key>_search`` and ``<key>_reader``) up to its think step's decision point (``<think> Doc k names
X;``) and scores, teacher-forced with the transformers engine, the log-probability of the two continuations the
demonstrations taught: ``" it answers the question."`` (answer now) and ``" the answer is not shown."`` (search
again). Per slice: the mean margin (answer minus search, nats) and the share of questions where answering wins; across
slices: the AUC of the margin for telling reader-slice questions (the first passages hold the gold: answer) from
search-slice ones (they do not: search again). AUC 0.5 is no signal from the passages at all.
Writes ``benchmarks/results/starter_decision.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
OUT = REPO / "benchmarks" / "results" / "starter_decision.json"
ANSWER, SEARCH = " it answers the question.", " the answer is not shown."


def decision_contexts(run: Path) -> list[str]:
    """prompt + response up to the first think step's ``;`` (the decision point), per recorded item that has one."""
    out = []
    for f in sorted((run / "items").glob("*.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            head, sep, _ = r["response"].partition("<think> Doc ")
            if not sep:
                continue
            rest = r["response"][len(head) + len(sep):]
            if ";" not in rest.split("</think>")[0]:
                continue
            out.append(r["prompt"] + head + sep + rest.split(";")[0] + ";")
    return out


def margins(model_dir: str, contexts: list[str]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()

    def logprob(ctx: str, cont: str) -> float:
        c = tok(ctx, add_special_tokens=False)["input_ids"]
        x = tok(ctx + cont, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([x])).logits[0, :-1].log_softmax(-1)
        return float(sum(logits[i, x[i + 1]] for i in range(len(c) - 1, len(x) - 1)))

    return [logprob(c, ANSWER) - logprob(c, SEARCH) for c in contexts]


def auc(pos: list[float], neg: list[float]) -> float | None:
    """P(a positive's margin exceeds a negative's), ties half."""
    if not pos or not neg:
        return None
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return round(wins / (len(pos) * len(neg)), 4)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", default="/tmp/emapg-starter-comparison", help="starter_comparison.py's --work folder")
    p.add_argument("--starter", action="append", default=[], metavar="KEY=MODEL",
                   help="the runs' key and its model (default: starter_v3=smollm2-135m-search-starter-v3)")
    args = p.parse_args(argv)
    from emapg.models import resolve_model

    t0 = time.perf_counter()
    result: dict = {"benchmark": "starter_decision", "continuations": {"answer": ANSWER, "search": SEARCH}}
    for spec in args.starter or ["starter_v3=smollm2-135m-search-starter-v3"]:
        key, model = spec.split("=", 1)
        side: dict = {"model": model}
        by_slice = {}
        for slice_name in ("search", "reader"):
            ctx = decision_contexts(Path(args.runs) / f"{key}_{slice_name}")
            m = margins(resolve_model(model), ctx)
            by_slice[slice_name] = m
            side[slice_name] = {"questions": len(m), "mean_margin_nats": round(sum(m) / max(1, len(m)), 4),
                                "answer_wins_share": round(sum(x > 0 for x in m) / max(1, len(m)), 4)}
            print(key, slice_name, side[slice_name], flush=True)
        side["auc_reader_over_search"] = auc(by_slice["reader"], by_slice["search"])
        print(key, "AUC", side["auc_reader_over_search"], flush=True)
        result[key] = side
        OUT.write_text(json.dumps(result, indent=1) + "\n")  # after each starter: a stopped run keeps what it measured
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result["date"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(OUT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
