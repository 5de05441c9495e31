"""Retrieval server under load, as its users see it: micro-batching on vs off, and single-query traffic vs the batch-of-32 ceiling.

Every measurement uses the same index and the same load harness: N closed-loop clients, each with
one keep-alive HTTP/1.1 connection (the way verl/Search-R1 trajectories call the retriever), topk 3,
scores returned. Throughput is queries/s over a measured window that opens once every client has
had an answer; latency is per request. The load generator runs on the same cores as the servers
(2 here), so it uses a lean HTTP client (:class:`LeanHTTPClient`) for every row. Each row also
reports the servers' own account of a request's time (``/metrics``): queue wait, the worker's
encode/search/lookup time per batch, the wait for company, the event loop's delivery lag.

In a closed loop the mean latency is fixed by throughput (Little's law: clients / (requests/s)):
at 32 clients, p99 <= 150 ms needs well over 32 / 0.15 = 213 requests/s.

1. **Engine comparison**, query cache off: a ``--max-batch 64`` and a ``--max-batch 1`` server, one
   NQ question per request, the encoder in the server's default dtype (bf16 where the CPU has bf16
   instructions, else fp32; ``--bf16``/``--no-bf16`` choose), at each concurrency level (alternating which server goes first);
   q/s, p50/p99 and the ratio batched/unbatched.
2. **Ceiling**, query cache off, ``--rounds`` times in alternating order: the batched server under 32
   clients sending one question per request; the same server answering one client's requests of 32
   questions each (every micro-batch holds 32 queries); and encoder + FAISS + doc lookup alone in
   this process on batches of 32 with the server's thread count. Ratios single/batch-of-32 per round,
   reported as min/median/max over the rounds. fp32, and bf16 with ``--dtypes`` (by default where the
   CPU has bf16 instructions, full mode only: elsewhere bf16 is emulated and ~8x slower than fp32).
3. **GRPO repeats**: 32 clients asking questions in groups of ``--group`` identical ones (the G
   rollouts of one prompt often search the same first query), query cache on vs off.
4. Full mode only: Flat vs IVF-SQ8 vs IVF-PQ over the whole bundled corpus from one set of
   embeddings: encoding passages/s, index memory, recall@3 against Flat on 500 NQ questions.

    python benchmarks/retriever_load.py --quick     # ~2 min on 2 cores
    python benchmarks/retriever_load.py             # full

Writes ``benchmarks/results/retriever_load.json``. Other work on the machine skews absolute numbers
(the load average is recorded); the ratios are measured side by side and their spread is reported.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import gzip
import itertools
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from emapg.cpu import cpu_has_bf16  # noqa: E402
from emapg.paths import cache_dir  # noqa: E402
from retriever.index_builder import BuildConfig, build_index  # noqa: E402
from retriever.index_files import META_FILE, read_meta
from retriever.launch import RetrieverServer  # noqa: E402

CORPUS = REPO / "data" / "corpus" / "wiki_mini.jsonl.gz"
QUESTIONS = REPO / "data" / "qa" / "nq" / "test.jsonl.gz"
OUT = REPO / "benchmarks" / "results" / "retriever_load.json"
TOPK = 3
MAX_WAIT_MS = 5.0
CEILING_CLIENTS = 32  # single-query clients in the ceiling comparison
CEILING_BATCH = 32  # queries per request of the batch-of-32 ceiling
TARGET_CEILING_RATIO = 0.9  # single-query q/s at 32 clients >= 90% of the batch-of-32 q/s
TARGET_P99_MS = 150.0


def questions(n: int) -> list[str]:
    with gzip.open(QUESTIONS, "rt", encoding="utf-8") as f:
        return [json.loads(line)["question"] for _, line in zip(range(n), f)]


def cached_index(n_passages: int | None, max_length: int) -> tuple[Path, float | None]:
    """Index over the first ``n_passages`` bundled passages (all if None), cached by settings.

    The whole corpus at the encoder's default length is built from the shipped passage vectors when
    they match (``provision.indexes``: 8.6 s instead of ~45 min of encoding on one thread); serving
    cost does not depend on how the passage vectors were made. Returns (folder, passages/s encoded,
    None when nothing was encoded here)."""
    from provision.indexes import BUNDLED_VECTORS, shipped_vectors_usable
    from retriever.corpus import file_checksum

    shipped = n_passages is None and max_length == 256 and shipped_vectors_usable()
    key = f"wiki_mini-{file_checksum(CORPUS)[7:19]}-{n_passages or 'all'}-minilm-{max_length}{'-shipped' if shipped else ''}"
    out = cache_dir() / "bench-indexes" / key
    if (out / META_FILE).is_file():
        return out, None
    res = build_index(
        BuildConfig(corpus=str(CORPUS), out=str(out), limit=n_passages, max_length=max_length, chunk_size=4096, batch_size=64, device="cpu",
                    progress=False, vectors=str(BUNDLED_VECTORS) if shipped else None),
        log=lambda m: None,
    )  # fmt: skip
    return out, None if shipped else res.passages_per_s


# ----------------------------------------------------------------------------- load harness

# A request body for client c's i-th request, and how many queries it holds.
BodyFn = Callable[[int, int], dict]


def single_queries(qs: list[str]) -> BodyFn:
    """One question per request, each client walking the questions from its own offset."""
    return lambda c, i: {"queries": [qs[(c * 13 + i * 97) % len(qs)]], "topk": TOPK, "return_scores": True}


def batches_of(qs: list[str], n: int) -> BodyFn:
    return lambda c, i: {"queries": [qs[((c * 1000 + i) * n + j) % len(qs)] for j in range(n)], "topk": TOPK, "return_scores": True}


def grpo_groups(qs: list[str], group: int) -> BodyFn:
    """Every question ``group`` times in a row across all clients, as G rollouts of one prompt ask it."""
    slots = itertools.count()
    return lambda c, i: {"queries": [qs[(next(slots) // group) % len(qs)]], "topk": TOPK, "return_scores": True}


# The load generator shares the 2 cores with the server: httpx spends ~1 ms of CPU per request in Python (h11,
# headers, its pool), CPU the server under test then lacks. Every row of this benchmark uses this bare asyncio
# client (one keep-alive connection, reconnecting when the server closes), so the comparisons stay like for like.
from retriever.loadgen import LeanHTTPClient  # noqa: E402


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
        self.queries = 0
        self.errors: list[str] = []


async def _client(url: str, body: BodyFn, c: int, w: _Window) -> None:
    http = LeanHTTPClient(url)
    try:
        for i in itertools.count():
            if w.stop:
                return
            payload = body(c, i)
            t0 = time.perf_counter()
            try:
                status, data = await asyncio.wait_for(http.post("/retrieve", payload), 120)
                ok = status == 200 and len(json.loads(data)["result"]) == len(payload["queries"])
                if not ok:
                    w.errors.append(f"HTTP {status}")
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, KeyError, ValueError) as e:
                ok = False
                w.errors.append(type(e).__name__)
                await http.close()
            t1 = time.perf_counter()
            if ok and w.start <= t1 <= w.end:  # completions inside the measured window
                w.latencies.append(t1 - t0)
                w.queries += len(payload["queries"])
            if i == 0:
                w.warm_clients += 1
                if w.warm_clients == w.concurrency:
                    w.all_warm.set()
    finally:
        await http.close()


def server_counters(url: str) -> dict[str, float]:
    """The /metrics counters this benchmark reads (summed over labels)."""
    import httpx

    return parse_counters(httpx.get(url + "/metrics", timeout=30).text)


def parse_counters(metrics: str) -> dict[str, float]:
    """The counters this benchmark reads from a /metrics text (summed over labels)."""
    out: dict[str, float] = {}
    for line in metrics.splitlines():
        m = re.match(r"^(retriever_(?:batch_size_sum|batch_size_count|batch_seconds_sum|queries_total|query_cache_hits_total|queue_wait_seconds_sum"
                     r"|queue_wait_seconds_count|gather_wait_seconds_total|delivery_lag_seconds_sum|delivery_lag_seconds_count"
                     r"|request_latency_seconds_sum|request_latency_seconds_count|gather_timeouts_total))(?:\{.*\})? (\S+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
        m = re.match(r'^retriever_(batch_seconds|request_latency_seconds)_bucket\{le="(0\.1|0\.15)"\} (\S+)$', line)
        if m:  # batches / requests that took at most 100 or 150 ms
            out[f"{m.group(1)}_le_{m.group(2)}"] = float(m.group(3))
        m = re.match(r'^retriever_stage_seconds_total\{stage="(\w+)"\} (\S+)$', line)
        if m:
            out[f"stage_{m.group(1)}"] = float(m.group(2))
    return out


def server_settings(url: str) -> dict:
    """The serving settings a server reports in GET /health (batch workers, max batch, waits)."""
    import httpx

    info = httpx.get(url + "/health", timeout=30).json()["index"]
    return {k: info[k] for k in ("batch_workers", "max_batch", "max_wait_ms", "regroup_wait_ms", "encoder_parallel_forwards")}


def _server_stats(before: dict[str, float], after: dict[str, float], seconds: float, workers: int = 1) -> dict:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    batches, queries = d.get("retriever_batch_size_count", 0.0), d.get("retriever_batch_size_sum", 0.0)
    stats = {
        "batches": int(batches),
        "mean_batch_size": round(queries / batches, 2) if batches else None,
        # the batch workers' busy fraction (encode + search + lookup) over the window, per worker
        "worker_busy_fraction": round(d.get("retriever_batch_seconds_sum", 0.0) / (seconds * workers), 3),
    }
    if batches:  # where a request's time goes: waiting for the batch ahead, the worker's stages, handing results out
        ms = lambda key: round(1000 * d.get(key, 0.0) / batches, 2)  # noqa: E731
        stats["per_batch_ms"] = {"encode": ms("stage_encode"), "search": ms("stage_search"), "lookup": ms("stage_lookup"),
                                 "gather_wait": ms("retriever_gather_wait_seconds_total")}  # fmt: skip
        # batches that started when the wait for company hit its bound: clients still on their way missed them
        stats["gather_timeout_fraction"] = round(d.get("retriever_gather_timeouts_total", 0.0) / batches, 3)
        # the batches' own time (encode + search + lookup) above 100 / 150 ms: a request's latency is at
        # least its batch's, so these set a floor under the latency tail that no scheduling removes
        stats["batches_over_ms"] = {ms_: round(1 - d.get(f"batch_seconds_le_{le}", batches) / batches, 3) for ms_, le in (("100", "0.1"), ("150", "0.15"))}
    if d.get("retriever_queue_wait_seconds_count"):
        stats["mean_queue_wait_ms"] = round(1000 * d["retriever_queue_wait_seconds_sum"] / d["retriever_queue_wait_seconds_count"], 2)
    if d.get("retriever_request_latency_seconds_count"):  # inside the server's handler, vs the client's p50/p99
        n = d["retriever_request_latency_seconds_count"]
        stats["mean_server_latency_ms"] = round(1000 * d["retriever_request_latency_seconds_sum"] / n, 2)
        stats["server_requests_over_150ms"] = round(1 - d.get("request_latency_seconds_le_0.15", n) / n, 4)
    if d.get("retriever_delivery_lag_seconds_count"):
        stats["mean_delivery_lag_ms"] = round(1000 * d["retriever_delivery_lag_seconds_sum"] / d["retriever_delivery_lag_seconds_count"], 2)
    if "retriever_query_cache_hits_total" in d and queries:  # of the queries the worker answered, how many skipped the encoder
        stats["query_cache_hit_fraction"] = round(d["retriever_query_cache_hits_total"] / queries, 3)
    return stats


async def _level(url: str, body: BodyFn, concurrency: int, warmup_s: float, duration_s: float) -> dict:
    w = _Window(concurrency)
    clients = asyncio.gather(*(_client(url, body, c, w) for c in range(concurrency)))
    try:  # new connections and the first big batch are not steady state; capped to bound the run time
        await asyncio.wait_for(w.all_warm.wait(), timeout=max(5.0, 2 * duration_s))
    except asyncio.TimeoutError:
        pass
    await asyncio.sleep(warmup_s)
    workers = (await asyncio.to_thread(server_settings, url))["batch_workers"]
    before = await asyncio.to_thread(server_counters, url)
    w.start = time.perf_counter()
    await asyncio.sleep(duration_s)
    w.end = time.perf_counter()
    after = await asyncio.to_thread(server_counters, url)
    w.stop = True
    await clients
    arr = np.array(w.latencies) * 1000
    return {
        "concurrency": concurrency,
        "requests": len(arr),
        "qps": round(w.queries / (w.end - w.start), 1),
        "p50_ms": round(float(np.percentile(arr, 50)), 1) if len(arr) else None,
        "p99_ms": round(float(np.percentile(arr, 99)), 1) if len(arr) else None,
        "errors": len(w.errors),
        **_server_stats(before, after, w.end - w.start, workers),
    }


def measure(url: str, body: BodyFn, concurrency: int, warmup_s: float, duration_s: float) -> dict:
    # The load generator's own full garbage collections would stall every client mid-window: this
    # process also holds the in-process encoder (~470k tracked objects, ~0.3 s per full collection,
    # measured), so what is alive now moves to the permanent generation, as the servers do after load.
    gc.freeze()
    return asyncio.run(_level(url, body, concurrency, warmup_s, duration_s))


# ----------------------------------------------------------------------------- the four parts


def start_servers(index_dir: Path, specs: dict[str, dict], threads: int, stack) -> dict[str, RetrieverServer]:
    """Start every server at once (start-up is mostly imports); an idle server costs nothing."""
    from concurrent.futures import ThreadPoolExecutor

    servers = {
        name: RetrieverServer(
            index_dir, max_batch=spec["max_batch"], max_wait_ms=MAX_WAIT_MS, omp_num_threads=threads, device="cpu",
            extra_args=["--query-cache-size", str(spec["query_cache_size"]),
                        "--bf16" if spec["bf16"] else "--no-bf16"],
        )
        for name, spec in specs.items()
    }  # fmt: skip
    for server in servers.values():
        stack.callback(server.stop)
    with ThreadPoolExecutor(len(servers)) as pool:
        list(pool.map(lambda srv: srv.start(), servers.values()))
    return servers


def engine_comparison(servers: dict[str, RetrieverServer], levels: list[int], qs: list[str], warmup_s: float, duration_s: float) -> dict:
    """Batched vs unbatched server at each level; the order alternates so drift favours neither."""
    modes = {"batched": 64, "unbatched": 1}
    results: dict[str, dict] = {name: {"max_batch": mb, "levels": {}} for name, mb in modes.items()}
    for k, c in enumerate(levels):
        for name in list(modes) if k % 2 == 0 else list(reversed(modes)):
            r = measure(servers[name].url, single_queries(qs), c, warmup_s, duration_s)
            results[name]["levels"][str(c)] = r
            print(f"  {name:<9s} max_batch={modes[name]:<3d} {r}", flush=True)
    return results


def encoder_qps(searcher, qs: list[str], batch: int, duration_s: float) -> float:
    """Queries/s of ``searcher.retrieve`` (encode + FAISS + doc lookup) on batches of ``batch`` questions."""
    searcher.retrieve(qs[:batch], TOPK)  # warm-up
    n, i, t0 = 0, 0, time.perf_counter()
    while time.perf_counter() - t0 < duration_s:
        searcher.retrieve([qs[(i * batch + j) % len(qs)] for j in range(batch)], TOPK)
        n, i = n + batch, i + 1
    return n / (time.perf_counter() - t0)


def spread(values: list[float]) -> dict:
    return {"min": round(min(values), 3), "median": round(float(np.median(values)), 3), "max": round(max(values), 3)}


def ceiling(server: RetrieverServer, index_dir: Path, bf16: bool, qs: list[str], rounds: int, warmup_s: float, duration_s: float) -> dict:
    """Single-query traffic at 32 clients vs the same server's batch-of-32 throughput vs the encoder alone."""
    from retriever.searcher import Searcher

    from retriever.encoder import default_encode_threads

    searcher = Searcher(index_dir, device="cpu", bf16=bf16, query_cache_size=0, encode_threads=default_encode_threads())  # as the servers
    per_round = []
    for r in range(rounds):
        row: dict = {}
        steps = {
            "single_c32": lambda: measure(server.url, single_queries(qs), CEILING_CLIENTS, warmup_s, duration_s),
            "batch32_c1": lambda: measure(server.url, batches_of(qs, CEILING_BATCH), 1, warmup_s, duration_s),
            "encoder_batch32_qps": lambda: round(encoder_qps(searcher, qs, CEILING_BATCH, duration_s), 1),
        }
        for name in list(steps) if r % 2 == 0 else list(reversed(steps)):
            row[name] = steps[name]()
        row["single_over_batch32"] = round(row["single_c32"]["qps"] / row["batch32_c1"]["qps"], 3)
        row["single_over_encoder"] = round(row["single_c32"]["qps"] / row["encoder_batch32_qps"], 3)
        per_round.append(row)
        one = row["single_c32"]
        print(f"  round {r + 1}: single c=32 {one['qps']} q/s (p50 {one['p50_ms']} / p99 {one['p99_ms']} ms, mean batch "
              f"{one['mean_batch_size']}, queue wait {one.get('mean_queue_wait_ms')} ms, per batch {one.get('per_batch_ms')}, "
              f"batches over 100/150 ms {one.get('batches_over_ms')}), batch-of-32 {row['batch32_c1']['qps']} q/s, encoder alone "
              f"{row['encoder_batch32_qps']} q/s -> single/batch32 {row['single_over_batch32']}, single/encoder {row['single_over_encoder']}", flush=True)  # fmt: skip
    return {
        "rounds": per_round,
        "single_c32_qps": spread([r["single_c32"]["qps"] for r in per_round]),
        "single_c32_p99_ms": spread([r["single_c32"]["p99_ms"] for r in per_round]),
        "batch32_qps": spread([r["batch32_c1"]["qps"] for r in per_round]),
        "encoder_batch32_qps": spread([r["encoder_batch32_qps"] for r in per_round]),
        "single_over_batch32": spread([r["single_over_batch32"] for r in per_round]),
        "single_over_encoder": spread([r["single_over_encoder"] for r in per_round]),
        # of the single-query batches, those whose own encode + search + lookup took over 150 ms
        "single_c32_batches_over_150ms": spread([r["single_c32"].get("batches_over_ms", {}).get("150", 0.0) for r in per_round]),
    }


def grpo_repeats(servers: dict[str, RetrieverServer], qs: list[str], group: int, warmup_s: float, duration_s: float) -> dict:
    out = {"group_size": group, "concurrency": CEILING_CLIENTS}
    for name, key in (("cached", "cache_on"), ("batched", "cache_off")):
        out[key] = measure(servers[name].url, grpo_groups(qs, group), CEILING_CLIENTS, warmup_s, duration_s)
        print(f"  query cache {key[6:]:<3s} {out[key]}", flush=True)
    return out


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
    from_file = meta.get("vectors") is not None  # decoded from the shipped vector file: nothing was encoded
    report = {"passages": n, "dim": d, "passage_vectors": meta["build"]["dtype"],
              "encode_passages_per_s": None if from_file else meta["build"]["passages_per_s"], "types": {}}  # fmt: skip
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


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small index, short windows, fp32 only: ~2 min on 2 cores")
    p.add_argument("--passages", type=int, default=None, help="index the first N bundled passages (default: quick 128, full all 43,159)")
    p.add_argument("--levels", default="1,8,32,64", help="comma-separated concurrency levels of the engine comparison (default 1,8,32,64)")
    p.add_argument("--duration", type=float, default=None, help="measured seconds per level (default: quick 3, full 10)")
    p.add_argument("--warmup", type=float, default=None, help="unmeasured seconds before each level (default: quick 1, full 2)")
    p.add_argument("--rounds", type=int, default=None, help="repeats of the ceiling comparison (default 5)")
    p.add_argument("--group", type=int, default=5, help="identical questions per group in the GRPO-repeat row (default 5, Search-R1's rollouts per prompt)")
    p.add_argument("--dtypes", default=None, help="encoder dtypes of the ceiling comparison, e.g. fp32,bf16 (default: quick fp32; full fp32, plus bf16 where the CPU has bf16 instructions)")
    p.add_argument("--server-threads", type=int, default=1, help="OMP_NUM_THREADS of every server and of the in-process encoder (default 1: the load generator needs the other core)")
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None, help="encoder dtype of the engine comparison and GRPO rows: --bf16 or --no-bf16 (fp32); default: the server's (bf16 where the CPU has bf16 instructions, else fp32)")
    p.add_argument("--recall-queries", type=int, default=500, help="queries for recall@3 vs Flat in full mode (default 500)")
    p.add_argument("--out", default=str(OUT), help=f"JSON output (default {OUT.relative_to(REPO)})")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    n_passages = args.passages if args.passages is not None else (128 if args.quick else None)
    duration = args.duration if args.duration is not None else (3.0 if args.quick else 10.0)
    warmup = args.warmup if args.warmup is not None else (1.0 if args.quick else 2.0)
    rounds = args.rounds if args.rounds is not None else 5
    levels = [int(x) for x in args.levels.split(",")]
    if args.dtypes is not None:
        dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    else:
        dtypes = ["fp32"] + (["bf16"] if not args.quick and cpu_has_bf16() else [])
    if not set(dtypes) <= {"fp32", "bf16"} or not dtypes:
        p.error(f"--dtypes takes fp32 and/or bf16, got {args.dtypes!r}")
    os.environ["OMP_NUM_THREADS"] = str(args.server_threads)  # the in-process encoder too
    import torch

    torch.set_num_threads(args.server_threads)

    print(f"index: first {n_passages or 'all'} passages of {CORPUS.name}, MiniLM on CPU; load average {load_at_start}", flush=True)
    # Serving cost does not depend on the passages' length; quick mode truncates them to build fast.
    index_dir, built_pps = cached_index(n_passages, max_length=128 if args.quick else 256)
    qs = questions(1000)
    engine_bf16 = cpu_has_bf16() if args.bf16 is None else args.bf16  # the server's default unless told
    specs = {
        "batched": {"max_batch": 64, "query_cache_size": 0, "bf16": engine_bf16},  # clients repeat questions: measure encoding, not the cache
        "unbatched": {"max_batch": 1, "query_cache_size": 0, "bf16": engine_bf16},
        "cached": {"max_batch": 64, "query_cache_size": 4096, "bf16": engine_bf16},
    }
    for dt in dtypes:
        if (dt == "bf16") != engine_bf16:
            specs[f"batched_{dt}"] = {"max_batch": 64, "query_cache_size": 0, "bf16": dt == "bf16"}
    ceilings = {}
    from contextlib import ExitStack

    with ExitStack() as stack:
        servers = start_servers(index_dir, specs, args.server_threads, stack)
        settings = server_settings(servers["batched"].url)
        print(f"server settings (defaults): {settings}", flush=True)
        print(f"engine comparison (query cache off, one question per request, {duration:g} s per level):", flush=True)
        modes = engine_comparison(servers, levels, qs, warmup, duration)
        for dt in dtypes:
            name = "batched" if (dt == "bf16") == engine_bf16 else f"batched_{dt}"
            print(f"ceiling, {dt} encoder (query cache off, {rounds} rounds of {duration:g} s each):", flush=True)
            ceilings[dt] = ceiling(servers[name], index_dir, dt == "bf16", qs, rounds, warmup, duration)
        print(f"GRPO repeats (groups of {args.group} identical questions, {CEILING_CLIENTS} clients):", flush=True)
        grpo = grpo_repeats(servers, qs, args.group, warmup, duration)

    ratios = {}
    p99_ratios = {}
    for c in levels:
        b, u = modes["batched"]["levels"][str(c)], modes["unbatched"]["levels"][str(c)]
        ratios[str(c)] = round(b["qps"] / u["qps"], 2) if u["qps"] else None
        p99_ratios[str(c)] = round(b["p99_ms"] / u["p99_ms"], 2) if b["p99_ms"] and u["p99_ms"] else None
    for mode in modes.values():  # over the measured windows of all levels
        batches = sum(lv["batches"] for lv in mode["levels"].values())
        queries = sum(lv["batches"] * lv["mean_batch_size"] for lv in mode["levels"].values() if lv["batches"])
        mode["mean_batch_size"] = round(queries / batches, 2) if batches else None
    main_ceiling = ceilings.get("fp32")
    result = {
        "benchmark": "retriever_load",
        "quick": args.quick,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpu_bf16_instructions": cpu_has_bf16(),
            "load_average_at_start": load_at_start,
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],  # other jobs on the box skew absolute numbers
        },
        "setup": {
            "encoder": f"minilm ({'bf16' if engine_bf16 else 'fp32'}, CPU)",
            "index": read_meta(index_dir)["index_type"],
            "passages": read_meta(index_dir)["rows"],
            "server_omp_threads": args.server_threads,
            "max_wait_ms": MAX_WAIT_MS,
            "query_cache": "off",
            "topk": TOPK,
            "queries_per_request": 1,
            "connections": "one keep-alive HTTP/1.1 connection per client (LeanHTTPClient), closed loop",
            "load_generator": "same machine and cores as the servers (asyncio, one process)",
            "server_encode_threads": "auto (--encode-threads 0: CPU cores / OMP threads)",
            "server_settings": settings,  # GET /health of the batched server: batch workers, waits
            "duration_s_per_level": duration,
            "warmup_s_per_level": warmup,
            "ceiling_rounds": rounds,
        },
        "batched": modes["batched"],
        "unbatched": modes["unbatched"],
        "batched_over_unbatched_qps_ratio": ratios,
        "batched_over_unbatched_p99_ratio": p99_ratios,
        "batched_over_unbatched_qps_ratio_c32": ratios.get("32"),
        "target_c32": {"qps_ratio_at_least": 3.0, "met": bool(ratios.get("32") and ratios["32"] >= 3.0), "p99_no_worse": bool(p99_ratios.get("32") and p99_ratios["32"] <= 1.0)},
        "ceiling": ceilings,
        # fp32, query cache off: median over rounds of (single-query q/s at 32 clients) / (same server, requests of 32 queries)
        "single_over_batch32_ceiling_c32": main_ceiling["single_over_batch32"]["median"] if main_ceiling else None,
        "single_over_encoder_ceiling_c32": main_ceiling["single_over_encoder"]["median"] if main_ceiling else None,
        # fp32, query cache off: median over rounds of the single-query p99 at 32 clients (target <= TARGET_P99_MS)
        "single_p99_ms_c32": main_ceiling["single_c32_p99_ms"]["median"] if main_ceiling else None,
        "target_ceiling_c32": {
            "ratio_at_least": TARGET_CEILING_RATIO,
            "p99_ms_at_most": TARGET_P99_MS,
            "met": {dt: bool(c["single_over_batch32"]["median"] >= TARGET_CEILING_RATIO and c["single_c32_p99_ms"]["median"] <= TARGET_P99_MS) for dt, c in ceilings.items()},
        },
        "grpo_repeats": grpo,
        **({} if "bf16" in ceilings or cpu_has_bf16() else {"bf16": "not measured: this CPU has no bf16 instructions (AVX512-BF16/AMX); "
                                                                   "torch emulates bf16 matmuls there, ~8x slower than fp32"}),  # fmt: skip
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
    print(f"(the load generator ran on the same {os.cpu_count()} cores as the servers; load average {load_at_start} at start, "
          f"{result['machine']['load_average_at_end']} at end)")  # fmt: skip
    print(f"c=32: batched/unbatched qps ratio {ratios.get('32')}, p99 ratio {p99_ratios.get('32')}")
    for dt, c in ceilings.items():
        r, q, p99 = c["single_over_batch32"], c["single_c32_qps"], c["single_c32_p99_ms"]
        print(f"c=32 {dt}: single-query {q['median']} q/s [{q['min']}-{q['max']}]; batch-of-32 {c['batch32_qps']['median']} q/s; "
              f"single/batch-of-32 {r['median']} [{r['min']}-{r['max']}] (target >= {TARGET_CEILING_RATIO}: "
              f"{'met' if r['median'] >= TARGET_CEILING_RATIO else 'missed'}); p99 {p99['median']} ms [{p99['min']}-{p99['max']}] "
              f"(target <= {TARGET_P99_MS:g} ms: {'met' if p99['median'] <= TARGET_P99_MS else 'missed'}); "
              f"single/encoder alone {c['single_over_encoder']['median']} [{c['single_over_encoder']['min']}-{c['single_over_encoder']['max']}]; "
              f"encoder alone {c['encoder_batch32_qps']['min']}-{c['encoder_batch32_qps']['max']} q/s over rounds; "
              f"batches over 150 ms {c['single_c32_batches_over_150ms']['median']}")  # fmt: skip
    print(f"GRPO groups of {args.group}: cache on {grpo['cache_on']['qps']} q/s (hit fraction {grpo['cache_on'].get('query_cache_hit_fraction')}), "
          f"cache off {grpo['cache_off']['qps']} q/s  -> {out}  ({result['wall_s']} s)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
