"""Build the starter search policy ``smollm2-135m-search-starter`` and ship it under ``data/starter/``.

    flock /tmp/emapg-heavy.lock python scripts/build_starter.py            # ~10-20 min on 2 cores
    flock /tmp/emapg-heavy.lock python scripts/build_starter.py --config configs/sft_smollm2_starter_v2.yaml \
        --out data/starter/smollm2-135m-search-starter-v2                   # the second starter (multi-search)
    python scripts/build_starter.py --check-questions 21                    # more questions in the format check

Steps: the bundled corpus's MiniLM index (``provision.indexes.ensure_bundled_index``) is served on a
free local port; ``emapg sft`` runs with ``configs/sft_smollm2_starter.yaml`` (LoRA on SmolLM2-135M-Instruct,
trajectories constructed from the bundled NQ + HotpotQA *train* questions through that live retriever,
kept only when the passages contain the gold answer, no evaluation question); the adapter (peft format,
safetensors) is copied to ``data/starter/smollm2-135m-search-starter/`` with ``record.json``: data
counts, settings, the loss curve, build time, and the format rate of greedy rollouts (transformers
engine) on a few bundled evaluation questions. ``emapg.models.resolve_model("smollm2-135m-search-starter")``
merges the shipped adapter into a full policy folder once and returns it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def format_check(policy_dir: str, retriever, rollout, n_per_dataset: int) -> dict:
    """Greedy rollouts (transformers engine) on the first bundled test questions of every QA set."""
    from dataclasses import replace

    from agent.rollout import run_rollouts
    from provision.engines import EngineSpec, build_engine
    from tasks.datasets import QA_DATASETS, load_dataset
    from tasks.qa import exact_match, extract_answer

    examples = [ex for name in QA_DATASETS for ex in load_dataset(name, limit=n_per_dataset, seed=0)]
    engine = build_engine(EngineSpec("hf", policy_dir, max_model_len=rollout.max_prompt_tokens + rollout.max_response_tokens))
    try:
        trajs = run_rollouts(engine, examples, retriever, replace(rollout, temperature=0.0))
    finally:
        engine.close()
    answers = [extract_answer(t.model_text) for t in trajs]
    return {
        "questions": len(trajs),
        "datasets": list(QA_DATASETS),
        "format_rate": sum(a is not None for a in answers) / len(trajs),
        "exact_match": sum(exact_match(a, ex.answers) for a, ex in zip(answers, examples)) / len(trajs),
        "mean_searches": sum(t.num_searches for t in trajs) / len(trajs),
        "examples": [{"question": t.question, "model_text": t.model_text, "golden_answers": ex.answers}
                     for t, ex in list(zip(trajs, examples))[:3]],
    }


def searches_per_type(used: list[dict], cfg) -> dict:
    """Searches per trajectory trained on (and held out for the loss), by question type: a trajectories file's
    ``type`` field (the multi-search demonstrations), else the dataset it came from."""
    from trainer.sft.multisearch import searches_by_type

    types: dict[str, str] = {}
    if cfg.data.source == "file":
        for line in Path(cfg.data.path).read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                types[str(row.get("id"))] = row.get("type") or "file"
    return searches_by_type([{"type": types.get(str(r["id"]), r.get("data_source") or "unknown"),
                              "searches": len(r["queries"])} for r in used])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "configs/sft_smollm2_starter.yaml"))
    p.add_argument("--out", default=None, help="ship folder (default: data/starter/smollm2-135m-search-starter)")
    p.add_argument("--work", default=None, help="run folder for the full SFT output (default: a temp folder)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (run it under the heavy lock)")
    p.add_argument("--index", default=None, help="index folder to serve (default: the bundled corpus's, built if missing)")
    p.add_argument("--check-questions", type=int, default=3, help="format check: questions per QA dataset")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides of the SFT config")
    args = p.parse_args()

    import logging

    import torch

    from emapg.config import load_config, to_dict
    from emapg.models import STARTER_ADAPTER
    from provision.indexes import ensure_bundled_index
    from provision.retrievers import open_retriever
    from trainer.sft.train import run_sft
    from trainer.sft.config import SFTConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    index = Path(args.index) if args.index else ensure_bundled_index()
    work = Path(args.work or tempfile.mkdtemp(prefix="emapg-starter-"))
    with open_retriever(index_dir=index, topk=3) as retriever:
        url = retriever.urls[0]
        cfg = load_config(SFTConfig, args.config, [f"retriever.urls=[{url}]", f"run.output_dir={work}",
                                                   f"run.threads={args.threads}", *args.overrides])
        print(f"constructing trajectories through {url} and fine-tuning; run folder {work}", flush=True)
        result = run_sft(cfg, progress=lambda s, n, loss: print(f"step {s}/{n} loss {loss:.4f}", flush=True)
                         if s % 10 == 0 or s == n else None)
        sft_seconds = time.perf_counter() - start
        check = format_check(str(work / "policy"), retriever, cfg.rollout, args.check_questions)
    sft_record = json.loads((work / "sft_record.json").read_text())
    out = Path(args.out) if args.out else STARTER_ADAPTER
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in ("adapter_model.safetensors", "adapter_config.json", "trained_questions.json"):  # + eval's contamination record
        shutil.copyfile(work / "adapter" / name, tmp / name)
        os.chmod(tmp / name, 0o644)
    adapter_cfg = json.loads((tmp / "adapter_config.json").read_text())
    adapter_cfg["base_model_name_or_path"] = cfg.model.policy  # the alias, not this machine's cache path
    (tmp / "adapter_config.json").write_text(json.dumps(adapter_cfg, indent=2, sort_keys=True) + "\n")
    record = {
        "name": out.name,
        "built_by": "scripts/build_starter.py " + " ".join(sys.argv[1:]),
        "base_model": cfg.model.policy,
        "config": to_dict(cfg) | {"retriever": {"urls": ["<bundled index, served on a free port>"]},
                                  "run": to_dict(cfg.run) | {"output_dir": None}},
        "index": {"dir": index.name, "meta": json.loads((index / "meta.json").read_text()).get("corpus")},
        "data": sft_record["data"],
        "trajectories": sft_record["trajectories"],
        "trained_questions": sft_record["trained_questions"],
        "heldout_loss_before": sft_record["heldout_loss_before"],
        "heldout_loss_after": sft_record["heldout_loss_after"],
        "heldout_curve": sft_record["heldout_curve"],
        "train_loss": [round(x, 4) for x in sft_record["train_loss"]],
        "build_seconds": {"data_and_sft": round(sft_seconds, 1), "sft_only": sft_record["seconds"],
                          "total_with_format_check": round(time.perf_counter() - start, 1)},
        "machine": {"cpus": os.cpu_count(), "torch_threads": args.threads, "platform": platform.platform(),
                    "torch": torch.__version__},
        "format_check": check,
        "adapter_bytes": (tmp / "adapter_model.safetensors").stat().st_size,
    }
    # what it used: the ids of the trained (and held-out-loss) trajectories' questions, all from the training pool
    used = [json.loads(line) for line in (work / "trajectories.jsonl").read_text().splitlines() if line.strip()]
    record["question_ids"] = sorted(r["id"] for r in used)
    record["searches_per_question_by_type"] = searches_per_type(used, cfg)
    record["mean_searches"] = round(sum(len(r["queries"]) for r in used) / len(used), 4)
    (tmp / "record.json").write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    print(json.dumps({k: record[k] for k in ("data", "trajectories", "heldout_loss_before", "heldout_loss_after",
                                             "build_seconds", "adapter_bytes")}, indent=2))
    print(f"format rate {check['format_rate']:.2f} (EM {check['exact_match']:.2f}) on {check['questions']} questions")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
