"""Greedy vs sampled accuracy of a starter and an RL checkpoint: where did training's change go?

RL samples its training trajectories at a temperature (1.0 here); the held-out protocol scores the greedy answer.
Training can raise the accuracy of *sampled* answers (moving probability onto answers the model already gives
when decoding greedily) without moving the greedy answers at all. ``learning_search.py`` only sees the greedy
held-out score; this script measures both decodings for both models on the same held-out questions (the
``learning_search.py`` ones: ``--per-dataset`` per QA set, data seed 0, inside ``data/qa/heldout.json``), greedily
(``qa_quick``) and sampled (``--temperature``, ``--n`` samples per question, ``--seed``; the score is the mean over
samples, pass@1). Both models run on one shared generation engine server, each evaluation loading its model's
weights first, through one real retriever over the bundled index.

The training pool is not measured here: a run's contamination record marks every question it *could* sample as
trained on -- the whole pool -- and the guard leaves nothing of it to score. The sampled reward on the training
distribution is in the run's own metrics (``filter/sampled_reward_mean``, every question sampled, before the
dynamic-sampling filter).

Output: ``benchmarks/results/greedy_vs_sampled.json`` -- per set and decoding: the start and trained accuracy
(pooled percent), trained − start with a paired-bootstrap 95% interval, per dataset, and the questions compared.

    python studies/greedy_vs_sampled.py --trained RUN/step_12/policy     # ~25 min on 2 cores
    python studies/greedy_vs_sampled.py --quick                           # smoke run: tiny-qwen2 against itself
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from studies import harness  # noqa: E402
RESULTS = harness.RESULTS
DECODINGS = ("greedy", "sampled")


def protocol_overrides(decoding: str, temperature: float, n: int, seed: int) -> dict[str, Any]:
    """``qa_quick`` as it is (greedy), or sampled: ``n`` samples per question at ``temperature``."""
    if decoding == "greedy":
        return {}
    return {"temperature": temperature, "n": n, "seed": seed}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trained", default=None, help="the RL checkpoint's policy folder (e.g. RUN/step_12/policy)")
    p.add_argument("--start", default=None, help="the model training started from (default: the starter, emapg.models.STARTER)")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny-qwen2 against itself, 2k-passage index, 2 q/set")
    p.add_argument("--per-dataset", type=int, default=None, help="held-out questions per QA set (default 50: 350 questions)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the sampled decoding (training's: 1.0)")
    p.add_argument("--n", type=int, default=2, help="samples per question of the sampled decoding")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (same for both models: paired samples)")
    p.add_argument("--out", default=str(RESULTS / "greedy_vs_sampled.json"))
    p.add_argument("--work", default=None, help="folder for the evaluations (default: a temp folder, removed)")
    harness.add_arguments(p)
    args = p.parse_args(argv)
    if not args.quick and not args.trained:
        p.error("give --trained (an RL checkpoint's policy folder), or --quick")
    if args.n < 1 or args.temperature <= 0:
        p.error("--n must be >= 1 and --temperature > 0")
    provenance = harness.start(__file__, quick=args.quick, allow_dirty=args.allow_dirty)
    harness.environment()

    from emapg.config import load_config
    from emapg.models import STARTER
    from emapg.paths import CONFIG_DIR
    from eval.learning import answer_changes, compare_learning
    from eval.protocols import get_protocol
    from eval.runner import EvalConfig, run_eval
    from tasks.datasets import QA_DATASETS
    from trainer.config import TrainConfig

    t0 = time.perf_counter()
    if args.quick:
        start, trained, engine_kind, index_limit = "tiny-qwen2", args.trained or "tiny-qwen2", "hf", 2000
        base_protocol: dict[str, Any] = {"max_tokens": 24, "max_turns": 2}
        per_dataset = args.per_dataset or 2
    else:
        start, trained, engine_kind, index_limit = args.start or STARTER, args.trained, "vllm", None
        base_protocol = {}
        per_dataset = args.per_dataset or 50
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="greedy-vs-sampled-"))
    work.mkdir(parents=True, exist_ok=True)
    # the engine as learning_search.py starts it: the context of the training config the checkpoint came from
    rollout = load_config(TrainConfig, CONFIG_DIR / ("search_tiny_cpu.yaml" if args.quick else "demo_search_smollm2.yaml"), []).rollout
    max_model_len = rollout.max_prompt_tokens + rollout.max_response_tokens

    datasets = list(QA_DATASETS)
    dirs: dict[tuple[str, str], Path] = {}
    with harness.servers(start, engine=engine_kind, index_limit=index_limit, max_model_len=max_model_len, folder=work) as served:
        for label, model in (("start", start), ("trained", trained)):
            for decoding in DECODINGS:
                out = work / label / f"heldout_{decoding}"
                protocol = get_protocol("qa_quick", **base_protocol, **protocol_overrides(decoding, args.temperature, args.n, args.seed))
                run_eval(EvalConfig(model=model, out=str(out), protocol=protocol, datasets=datasets, limit=per_dataset,
                                    data_seed=0, engine="remote", engine_urls=[served.engine_url], retriever_url=served.retriever_url,
                                    progress=False, name=f"{label} heldout {decoding}", batch_across_datasets=True,
                                    batch_size=64))  # fmt: skip
                dirs[(label, decoding)] = out
                print(f"[greedy_vs_sampled] {label} {decoding}: done ({(time.perf_counter() - t0) / 60:.1f} min)", flush=True)

    report: dict[str, Any] = {
        "benchmark": "greedy_vs_sampled", "provenance": provenance, "mode": "quick" if args.quick else "default", "start": start, "trained": trained,
        "sampled": {"temperature": args.temperature, "n": args.n, "seed": args.seed, "score": "mean over samples (pass@1)"},
        "greedy": "qa_quick (temperature 0)",
        "heldout": {"datasets": datasets, "per_dataset": per_dataset, "data_seed": 0, "split": "subset of data/qa/heldout.json"},
        "results": {},
    }
    for decoding in DECODINGS:
        cmp = compare_learning(dirs[("start", decoding)], dirs[("trained", decoding)], datasets)
        pooled = cmp["pooled"]
        d = pooled["difference"]
        report["results"][decoding] = {
            "questions": pooled["n"], "start": pooled["base"], "trained": pooled["trained"],
            "trained_minus_start": {k: d[k] for k in ("mean", "low", "high", "confidence", "method")},
            "per_dataset": {ds: {"start": b["base"], "trained": b["trained"]} for ds, b in cmp["datasets"].items()},
        }
    # which greedy answers changed, by kind of question (yes/no, an option the question names, open)
    report["results"]["greedy"]["answer_changes"] = asdict(answer_changes(dirs[("start", "greedy")], dirs[("trained", "greedy")], datasets))
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    report["machine"] = harness.machine()
    out_path = harness.write_report(report, Path(args.out))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\nheld-out EM (%)\n{'decoding':<10}{'n':>5}{'start':>8}{'trained':>9}   trained - start (95% CI)")
    for decoding, r in report["results"].items():
        d = r["trained_minus_start"]
        print(f"{decoding:<10}{r['questions']:>5}{r['start']:>8.1f}{r['trained']:>9.1f}   "
              f"{d['mean']:+.1f} pp [{d['low']:+.1f}, {d['high']:+.1f}]")
    changes = report["results"]["greedy"]["answer_changes"]
    print(f"greedy answers changed: {changes['changed']} of {changes['questions']} (wrong -> right {changes['gained']}, "
          f"right -> wrong {changes['lost']})")
    print(f"wall {report['wall_s'] / 60:.1f} min; wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
