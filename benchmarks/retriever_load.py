"""Retrieval server under load: cross-request micro-batching on vs off, side by side.

For each mode (``--max-batch 64`` vs ``--max-batch 1``, same server build, same index, same run)
and each concurrency level, N closed-loop clients each hold one keep-alive connection and send
one NQ question per request (the way verl/Search-R1 trajectories call the retriever). Reports
queries/s and p50/p99 latency per level and the throughput ratio batched/unbatched.

Full mode (no ``--quick``) also builds Flat, IVF-SQ8 and IVF-PQ indexes over the whole bundled
corpus from one set of embeddings and reports encoding passages/s, index memory and recall@3
against Flat on 500 NQ questions.

    python benchmarks/retriever_load.py --quick     # < 90 s on 2 cores
    python benchmarks/retriever_load.py             # full

Writes ``benchmarks/results/retriever_load.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from emapg.paths import cache_dir  # noqa: E402
from retriever.index_builder import META_FILE, BuildConfig, build_index, read_meta  # noqa: E402
from retriever.launch import RetrieverServer  # noqa: E402

CORPUS = REPO / "data" / "corpus" / "wiki_mini.jsonl.gz"
QUESTIONS = REPO / "data" / "qa" / "nq" / "test.jsonl.gz"
OUT = REPO / "benchmarks" / "results" / "retriever_load.json"


def questions(n: int) -> list[str]:
    with gzip.open(QUESTIONS, "rt", encoding="utf-8") as f:
        return [json.loads(line)["question"] for _, line in zip(range(n), f)]


def cached_index(n_passages: int | None, max_length: int) -> tuple[Path, float | None]:
    """Index over the first ``n_passages`` bundled passages (all if None), cached by settings."""
    from retriever.corpus import file_checksum

    key = f"wiki_mini-{file_checksum(CORPUS)[7:19]}-{n_passages or 'all'}-minilm-{max_length}"
    out = cache_dir() / "bench-indexes" / key
    if (out / META_FILE).is_file():
        return out, None
    res = build_index(
        BuildConfig(corpus=str(CORPUS), out=str(out), limit=n_passages, max_length=max_length, chunk_size=4096, batch_size=64, device="cpu", progress=False),
        log=lambda m: None,
    )
    return out, res.passages_per_s


class _Window:
    """Measured window of one level: opens ``warmup_s`` after every client has had an answer."""

    def __init__(self, concurrency: int):
        self.concurrency = concurrency
        self.warm_clients = 0
        self.all_warm = asyncio.Event()
        self.start = float("inf")
        self.end = float("inf")
        self.stop = False
        self.latencies: list[float] = []
        self.errors: list[str] = []


async def _client(url: str, qs: list[str], offset: int, w: _Window) -> None:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=1)) as http:
        i, first = offset, True
        while not w.stop:
            t0 = time.perf_counter()
            try:
                r = await http.post("/retrieve", json={"queries": [qs[i % len(qs)]], "topk": 3, "return_scores": True})
                ok = r.status_code == 200
                if not ok:
                    w.errors.append(f"HTTP {r.status_code}")
            except httpx.HTTPError as e:
                ok = False
                w.errors.append(type(e).__name__)
            t1 = time.perf_counter()
            if ok and w.start <= t1 <= w.end:  # completions inside the measured window
                w.latencies.append(t1 - t0)
            if first:
                first = False
                w.warm_clients += 1
                if w.warm_clients == w.concurrency:
                    w.all_warm.set()
            i += 97


async def _level(url: str, qs: list[str], concurrency: int, warmup_s: float, duration_s: float) -> dict:
    w = _Window(concurrency)
    clients = asyncio.gather(*(_client(url, qs, c * 13, w) for c in range(concurrency)))
    try:  # new connections and the first big batch are not steady state; capped to bound the run time
        await asyncio.wait_for(w.all_warm.wait(), timeout=max(5.0, 2 * duration_s))
    except asyncio.TimeoutError:
        pass
    await asyncio.sleep(warmup_s)
    w.start = time.perf_counter()
    await asyncio.sleep(duration_s)
    w.end = time.perf_counter()
    w.stop = True
    await clients
    arr = np.array(w.latencies) * 1000
    return {
        "concurrency": concurrency,
        "requests": len(arr),
        "qps": round(len(arr) / (w.end - w.start), 1),
        "p50_ms": round(float(np.percentile(arr, 50)), 1) if len(arr) else None,
        "p99_ms": round(float(np.percentile(arr, 99)), 1) if len(arr) else None,
        "errors": len(w.errors),
    }


def _mean_batch(url: str) -> float | None:
    import httpx

    lines = httpx.get(url + "/metrics").text.splitlines()
    total = [float(x.split()[1]) for x in lines if x.startswith("retriever_batch_size_sum")]
    count = [float(x.split()[1]) for x in lines if x.startswith("retriever_batch_size_count")]
    return round(total[0] / count[0], 2) if total and count and count[0] else None


def run_modes(index_dir: Path, modes: dict[str, int], levels: list[int], qs: list[str], warmup_s: float, duration_s: float, threads: int, bf16: bool) -> dict:
    """Both servers run side by side (an idle one costs nothing); levels alternate the order of
    the modes, so drift in the machine's load does not favour either."""
    from concurrent.futures import ThreadPoolExecutor
    from contextlib import ExitStack

    with ExitStack() as stack:
        servers = {
            name: RetrieverServer(
                index_dir, max_batch=mb, max_wait_ms=5.0, omp_num_threads=threads, device="cpu",
                # clients repeat questions: measure encoding, not the cache
                extra_args=["--query-cache-size", "0", *(["--bf16"] if bf16 else [])],
            )
            for name, mb in modes.items()
        }
        for server in servers.values():
            stack.callback(server.stop)
        with ThreadPoolExecutor(len(servers)) as pool:  # start both at once: start-up is mostly imports
            list(pool.map(lambda srv: srv.start(), servers.values()))
        results: dict[str, dict] = {name: {"max_batch": mb, "levels": {}} for name, mb in modes.items()}
        for k, c in enumerate(levels):
            order = list(modes) if k % 2 == 0 else list(reversed(modes))
            for name in order:
                r = asyncio.run(_level(servers[name].url, qs, c, warmup_s, duration_s))
                results[name]["levels"][str(c)] = r
                print(f"  {name:<9s} max_batch={modes[name]:<3d} {r}", flush=True)
        for name in modes:
            results[name]["mean_batch_size"] = _mean_batch(servers[name].url)
    return results


def index_types_report(index_dir: Path, n_queries: int) -> dict:
    """Flat vs IVF-SQ8 vs IVF-PQ from the same embeddings: build time, memory, recall@3 vs Flat."""
    import faiss

    from retriever.encoder import Encoder, EncoderSpec

    meta = read_meta(index_dir)
    chunks = sorted((index_dir / "emb").glob("chunk_*.npy"))
    xb = np.concatenate([np.load(c) for c in chunks]).astype(np.float32)
    n, d = xb.shape
    nlist = 256 if n >= 256 * 39 else max(4, n // 39)
    enc = Encoder(EncoderSpec.from_dict(meta["encoder"]), device="cpu")
    xq = enc.encode_queries(questions(n_queries))
    report = {"passages": n, "dim": d, "encode_passages_per_s": meta["build"]["passages_per_s"], "types": {}}
    flat_ids = None
    pq = "PQ16" if n >= 39 * 256 else "PQ16x4"  # 8-bit codebooks need >= 256 (ideally 39x) training points
    for spec in ("Flat", f"IVF{nlist},SQ8", f"IVF{nlist},{pq}"):
        index = faiss.index_factory(d, spec, faiss.METRIC_INNER_PRODUCT)
        t0 = time.perf_counter()
        if not index.is_trained:
            rng = np.random.default_rng(0)
            index.train(xb[rng.choice(n, size=min(n, 100_000), replace=False)])
        index.add(xb)
        build_s = time.perf_counter() - t0
        ivf = faiss.try_extract_index_ivf(index)
        if ivf is not None:
            ivf.nprobe = min(16, ivf.nlist)
        t0 = time.perf_counter()
        _, ids = index.search(xq, 3)
        search_s = time.perf_counter() - t0
        if flat_ids is None:
            flat_ids = ids
        recall = float(np.mean([len(set(a) & set(b)) / 3 for a, b in zip(ids.tolist(), flat_ids.tolist())]))
        report["types"][spec] = {
            "faiss_build_s": round(build_s, 3),
            "memory_bytes": int(faiss.serialize_index(index).size),
            "recall_at_3_vs_flat": round(recall, 4),
            "search_ms_per_query": round(1000 * search_s / len(xq), 3),
            "nprobe": ivf.nprobe if ivf is not None else None,
        }
        print(f"  {spec:<16s} {report['types'][spec]}", flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small index, short levels: < 90 s on 2 cores")
    p.add_argument("--passages", type=int, default=None, help="index the first N bundled passages (default: quick 128, full all 43,159)")
    p.add_argument("--levels", default="1,8,32,64", help="comma-separated concurrency levels (default 1,8,32,64)")
    p.add_argument("--duration", type=float, default=None, help="measured seconds per level (default: quick 2.5, full 10)")
    p.add_argument("--warmup", type=float, default=None, help="unmeasured seconds before each level (default: quick 0.5, full 2)")
    p.add_argument("--server-threads", type=int, default=1, help="OMP_NUM_THREADS of the server in both modes (default 1: the load generator needs the other core)")
    p.add_argument("--bf16", action="store_true", help="serve with the opt-in bf16 query encoder in both modes (default fp32)")
    p.add_argument("--recall-queries", type=int, default=500, help="queries for recall@3 vs Flat in full mode (default 500)")
    p.add_argument("--out", default=str(OUT), help=f"JSON output (default {OUT.relative_to(REPO)})")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    n_passages = args.passages if args.passages is not None else (128 if args.quick else None)
    duration = args.duration if args.duration is not None else (2.5 if args.quick else 10.0)
    warmup = args.warmup if args.warmup is not None else (0.5 if args.quick else 2.0)
    levels = [int(x) for x in args.levels.split(",")]
    os.environ["OMP_NUM_THREADS"] = str(args.server_threads)  # the in-process encoder (full mode) too

    print(f"index: first {n_passages or 'all'} passages of {CORPUS.name}, MiniLM on CPU", flush=True)
    # Serving cost does not depend on the passages' length; quick mode truncates them to build fast.
    index_dir, built_pps = cached_index(n_passages, max_length=128 if args.quick else 256)
    qs = questions(1000)
    modes = run_modes(index_dir, {"batched": 64, "unbatched": 1}, levels, qs, warmup, duration, args.server_threads, args.bf16)

    ratios = {}
    p99_ratios = {}
    for c in levels:
        b, u = modes["batched"]["levels"][str(c)], modes["unbatched"]["levels"][str(c)]
        ratios[str(c)] = round(b["qps"] / u["qps"], 2) if u["qps"] else None
        p99_ratios[str(c)] = round(b["p99_ms"] / u["p99_ms"], 2) if b["p99_ms"] and u["p99_ms"] else None
    result = {
        "benchmark": "retriever_load",
        "quick": args.quick,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],  # other jobs on the box skew absolute numbers
        },
        "setup": {
            "encoder": f"minilm ({'bf16' if args.bf16 else 'fp32'}, CPU)",
            "index": read_meta(index_dir)["index_type"],
            "passages": read_meta(index_dir)["rows"],
            "server_omp_threads": args.server_threads,
            "max_wait_ms": 5.0,
            "query_cache": "off",
            "topk": 3,
            "queries_per_request": 1,
            "connections": "one keep-alive connection per client, closed loop",
            "duration_s_per_level": duration,
            "warmup_s_per_level": warmup,
        },
        "batched": modes["batched"],
        "unbatched": modes["unbatched"],
        "batched_over_unbatched_qps_ratio": ratios,
        "batched_over_unbatched_p99_ratio": p99_ratios,
        "batched_over_unbatched_qps_ratio_c32": ratios.get("32"),
        "target_c32": {"qps_ratio_at_least": 3.0, "met": bool(ratios.get("32") and ratios["32"] >= 3.0), "p99_no_worse": bool(p99_ratios.get("32") and p99_ratios["32"] <= 1.0)},
        "reference": "Search-R1's server on the same 2-core machine class: 38-51 req/s at c=32, p99 0.8-1.2 s (docs PRIOR_ART.md)",
    }
    if built_pps:
        result["quick_index_encode_passages_per_s"] = round(built_pps, 1)
    if not args.quick:
        print("index types (Flat vs IVF-SQ8 vs IVF-PQ):", flush=True)
        result["index_types"] = index_types_report(index_dir, args.recall_queries)
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkstemp(dir=out.parent, suffix=".json.tmp")[1])
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    shutil.move(tmp, out)
    print(f"c=32: batched/unbatched qps ratio {ratios.get('32')}, p99 ratio {p99_ratios.get('32')}  -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
