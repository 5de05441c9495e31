"""The retriever at Wikipedia scale: the index ladder, the 21M x 768 extrapolation, and the router's overhead.

1. **Ladder on the real bundled vectors** (43,159 MiniLM passages, built from the shipped
   ``data/corpus/wiki_mini.minilm-uint8.npz``; real NQ test questions encoded by MiniLM): every rung of
   :func:`retriever.ladder.default_rungs` -- recall@1/3/10 vs Flat, answer recall, bytes/passage, build
   time and peak build RSS, q/s at batch 1 and 32, and q/s / p50 / p99 through a real ``emapg serve`` at
   32 closed-loop clients (``--quick``: only Flat and the recommended rung, served side by side, below).
2. **The recommended rung vs Flat fp32, side by side**: both served by real ``emapg serve`` processes at
   once (query cache off), 32 closed-loop clients on one, then the other, in alternating windows
   (A B B A ...); the ratio of the median q/s (and p99) is printed.
3. **Router overhead**: the same index split into 2 shards (aligned to FAISS's 1024-row BLAS block), two
   ``emapg serve`` + ``emapg router --docs`` (and, side by side, a router whose shards send the passages)
   vs one ``emapg serve``: exactness over 200 questions sent one request at a time (passages, order,
   bit-identical scores) and q/s / p50 / p99 at c = 32 (windows in rotating order) and c = 1; per window
   the CPU time per answered query of every process, and the mean latency split from the servers'
   ``/metrics`` (queue wait for the encoder, the shards' round trip). Every process -- the unsharded
   server, or the router and both shards -- and the load generator share this machine's cores
   (``machine.cpus``): the sharded side runs 3 processes on them, so the comparison charges it every
   cycle its extra hop costs. ``--router-only``: this part alone (6 rounds), to ``retriever_scale_router.json``.
4. Full mode only: **a synthetic 2M x 768 set** (``--synthetic-rows``): 4,096 Gaussian cluster centres
   on the unit sphere, cluster sizes Zipf-distributed (s = 1.1), each vector a centre plus isotropic
   noise (per-cluster spread drawn from [0.35, 0.7] of the centre norm), normalised; queries drawn the
   same way from held-out noise. Written as float16 chunk files (memory-mapped). The ladder runs in
   process only (no encoder makes 768-d queries from text); Flat fp32 and HNSW are measured on the
   first 100k rows and say so; the IVF rungs share one coarse quantizer (k-means once). No OPQ rung:
   OPQ96's rotation training at 768-d did not finish in 10 min on 2 cores (and on the 43k set OPQ48
   lifted IVF-PQ's recall@3 only from 0.70 to 0.75: the exact re-rank, not OPQ, reaches the floor).
   Bounded by ``--time-budget-min``: no rung starts after it, and the JSON is rewritten after every rung,
   so a run stopped early leaves what it measured, marked ``"status": "partial: ..."``.

    python benchmarks/retriever_scale.py --quick   # <= 5 min on 2 cores -> results/retriever_scale.json
    python benchmarks/retriever_scale.py           # ~30 min -> results/retriever_scale_full.json

JSON: ``rungs`` (name, recall_at_3, bytes_per_passage, qps_c32, ...), ``recommended``, ``target_21m_768``,
``recommended_vs_flat``, ``router``, ``targets`` (and ``synthetic``, ``status`` in full mode).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from emapg.paths import cache_dir  # noqa: E402
from retriever.ladder import LadderConfig, default_rungs, format_table, run_ladder  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "retriever_scale.json"
OUT_FULL = REPO / "benchmarks" / "results" / "retriever_scale_full.json"
OUT_SYNTHETIC = REPO / "benchmarks" / "results" / "retriever_scale_synthetic.json"
OUT_ROUTER = REPO / "benchmarks" / "results" / "retriever_scale_router.json"
VECTORS = REPO / "data" / "corpus" / "wiki_mini.minilm-uint8.npz"
CORPUS = REPO / "data" / "corpus" / "wiki_mini.jsonl.gz"
BYTES_TARGET = 256
RECALL_FLOOR = 0.95


def ladder(work: Path, quick: bool) -> dict:
    """The 43k ladder. --quick serves no rung here: Flat and the recommended rung are served side by side
    afterwards (:func:`recommended_vs_flat`), which fills their ``qps_c32``; at 43k rows every rung's server is
    encoder-bound (the full mode serves them all)."""
    index = cache_dir() / "indexes" / "wiki_mini-minilm-flat-from-vectors"
    cfg = LadderConfig(index=str(index), out=str(work / "ladder"), vectors=str(VECTORS), corpus=str(CORPUS), questions="nq",
                       n_questions=300 if quick else 500, dim=768, target_rows=21_000_000, serve=not quick,
                       load_seconds=5.0, train_sample=20_000 if quick else 43_159, progress=False)  # fmt: skip
    report = run_ladder(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    print(format_table(report), file=sys.stderr, flush=True)
    return report


def alternate(urls: dict[str, str], questions: list[str], *, rounds: int, seconds: float, concurrency: int,
              pids: dict[str, int] | None = None) -> list[dict]:  # fmt: skip
    """Closed-loop windows on each server in turn, each round starting one server later (A B C, B C A, C A B, ...;
    two servers: A B, B A), so that no server always runs first or in the middle. ``pids``
    (process name -> pid): each window also says the CPU time every one of them spent per answered query."""
    from retriever.loadgen import closed_loop

    windows = []
    for r in range(rounds):
        names = list(urls)[r % len(urls) :] + list(urls)[: r % len(urls)]
        for name in names:
            before = {p: cpu_seconds(pid) for p, pid in (pids or {}).items()}
            window = {"round": r, "who": name, **closed_loop(urls[name], questions, concurrency=concurrency, seconds=seconds)}
            answered = window["qps"] * seconds
            if pids and answered:
                window["cpu_ms_per_query"] = {p: round((cpu_seconds(pid) - before[p]) / answered * 1000, 3) for p, pid in pids.items()}
            windows.append(window)
    return windows


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def median_of(windows: list[dict], who: str, key: str) -> float:
    return float(np.median([w[key] for w in windows if w["who"] == who]))


def recommended_vs_flat(work: Path, report: dict, quick: bool) -> dict:
    """q/s and p99 at c = 32 of the recommended rung and of Flat fp32, both served at once, alternating windows."""
    from retriever.launch import RetrieverServer
    from retriever.ladder import parse_rung, read_questions, rss_of

    best = report["recommended"]
    dirs = {"flat": work / "ladder" / parse_rung("Flat").slug, "recommended": work / "ladder" / parse_rung(best).slug}
    questions, _ = read_questions("nq", 300)
    args = ["--query-cache-size", "0"]
    seconds, rounds = (3.0, 3) if quick else (5.0, 4)
    with RetrieverServer(dirs["flat"], extra_args=args, omp_num_threads=1) as flat, \
            RetrieverServer(dirs["recommended"], extra_args=args, omp_num_threads=1) as rec:  # fmt: skip
        windows = alternate({"flat": flat.url, "recommended": rec.url}, questions, rounds=rounds, seconds=seconds, concurrency=32)
        rss = {"flat": rss_of(flat.proc.pid), "recommended": rss_of(rec.proc.pid)}
    qps = {w: median_of(windows, w, "qps") for w in ("flat", "recommended")}
    p99 = {w: median_of(windows, w, "p99_ms") for w in ("flat", "recommended")}
    p50 = {w: median_of(windows, w, "p50_ms") for w in ("flat", "recommended")}
    for who, name in (("flat", "Flat"), ("recommended", best)):  # rungs the ladder did not serve get these numbers
        rung = next(r for r in report["rungs"] if r["name"] == name)
        if rung.get("qps_c32") is None:
            rung.update(qps_c32=qps[who], p50_ms=p50[who], p99_ms=p99[who], qps_c32_vs_flat=round(qps[who] / qps["flat"], 3) if qps["flat"] else None,
                        server={"side_by_side": True, "server_rss_bytes": rss[who]})  # fmt: skip
    return {"recommended": best, "concurrency": 32, "windows": windows, "qps_c32": qps, "p99_ms": p99, "p50_ms": p50, "server_rss_bytes": rss,
            "qps_ratio": round(qps["recommended"] / qps["flat"], 3), "p99_ratio": round(p99["recommended"] / p99["flat"], 3),
            "note": f"both served by `emapg serve` (1 FAISS thread, query cache off) on {os.cpu_count()} cores, alternating "
                    f"{seconds:g}-s windows, medians of {rounds} windows each; at {report['source']['rows']:,} rows "
                    "the query encoder, not the search, takes most of a request's CPU"}  # fmt: skip


COUNTERS = ("router_fanouts_total", "router_fanout_queries_total", "retriever_request_latency_seconds_sum", "retriever_request_latency_seconds_count",
            "retriever_queue_wait_seconds_sum", "retriever_queue_wait_seconds_count", 'router_shard_latency_seconds_sum{shard="0"}',
            'router_shard_latency_seconds_count{shard="0"}', 'router_shard_latency_seconds_sum{shard="1"}', 'router_shard_latency_seconds_count{shard="1"}')  # fmt: skip


def _router_counters(url: str) -> dict[str, float]:
    import httpx

    text = httpx.get(url + "/metrics", timeout=30).text
    return {name: float(line.split()[-1]) for line in text.splitlines() for name in COUNTERS if line.startswith(name + " ")}


def _latency_split(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean ms per request between two ``/metrics`` reads: whole request, queue wait for the encoder, and per shard the fan-out round trip."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    mean = lambda name: round(1000 * d[name + "_sum"] / d[name + "_count"], 2) if d.get(name + "_count") else None  # noqa: E731
    out = {"request_ms": mean("retriever_request_latency_seconds"), "queue_wait_ms": mean("retriever_queue_wait_seconds")}
    for shard in ("0", "1"):
        if d.get(f'router_shard_latency_seconds_count{{shard="{shard}"}}'):
            out[f"shard_{shard}_round_trip_ms"] = round(1000 * d[f'router_shard_latency_seconds_sum{{shard="{shard}"}}']
                                                        / d[f'router_shard_latency_seconds_count{{shard="{shard}"}}'], 2)  # fmt: skip
    return out


def router_overhead(work: Path, index: Path, quick: bool, rounds: int | None = None, fixed_regroup: bool = False,
                    seconds: float | None = None) -> dict:
    """Exactness and c = 32 / c = 1 load of the same index as 2 shards + ``emapg router`` against one ``emapg serve``;
    side by side, ``emapg router --docs`` and, with ``fixed_regroup``, the router with the server's fixed regroup wait
    (``--no-regroup-follows-fanout``, as it was before the wait followed the fan-out's round trip)."""
    import httpx

    from retriever.launch import RetrieverServer, RouterServer
    from retriever.ladder import read_questions
    from retriever.loadgen import closed_loop
    from retriever.sharding import ShardConfig, shard_index

    shards = shard_index(ShardConfig(index=str(index), out=str(work / "shards"), shards=2, overwrite=True), log=lambda m: None)
    questions, _ = read_questions("nq", 200)
    args = ["--query-cache-size", "0"]
    docs_args = ["--docs", str(index)]
    out: dict = {"shards": 2, "rows": [json.loads((d / "meta.json").read_text())["shard"]["row_offset"] for d in shards],
                 "router_args": [], "router_docs_args": ["--docs", "<the unsharded index>"]}  # fmt: skip
    with RetrieverServer(index, extra_args=args, omp_num_threads=1) as one, \
            RetrieverServer(shards[0], extra_args=args, omp_num_threads=1) as s0, \
            RetrieverServer(shards[1], extra_args=args, omp_num_threads=1) as s1, \
            RouterServer([[s0.url], [s1.url]]) as router, \
            RouterServer([[s0.url], [s1.url]], extra_args=docs_args) as docs, \
            contextlib.ExitStack() as more:  # fmt: skip
        # "router": the default router (the shards send their top-k passages); "router_docs": with --docs (the shards
        # send rows and scores, the router reads the merged passages from the source index).
        sides = {"unsharded": one.url, "router": router.url, "router_docs": docs.url}
        pids = {"unsharded": one.proc.pid, "shard_0": s0.proc.pid, "shard_1": s1.proc.pid, "router": router.proc.pid,
                "router_docs": docs.proc.pid}  # fmt: skip
        if fixed_regroup:
            fixed = more.enter_context(RouterServer([[s0.url], [s1.url]], extra_args=["--no-regroup-follows-fanout"]))
            sides["router_fixed_regroup"], pids["router_fixed_regroup"] = fixed.url, fixed.proc.pid
        checked = ("router",) if quick else ("router", "router_docs")  # --quick: within its 5 minutes (the merge is shared)
        out["exactness"] = {who: _exactness(one.url, sides[who], questions) for who in checked}
        default_seconds, default_rounds = (3.0, 3) if quick else (5.0, 4)
        rounds, seconds = rounds or default_rounds, seconds or default_seconds
        before_counts = _router_counters(router.url)
        before_one = _router_counters(one.url)
        rounds_c32 = alternate(sides, questions, rounds=rounds, seconds=seconds, concurrency=32, pids=pids)
        after = _router_counters(router.url)
        out["latency_split_c32"] = {"unsharded": _latency_split(before_one, _router_counters(one.url)), "router": _latency_split(before_counts, after)}
        out["load_c32"] = rounds_c32
        fanouts = after["router_fanouts_total"] - before_counts["router_fanouts_total"]
        out["router_queries_per_fanout_c32"] = round((after["router_fanout_queries_total"] - before_counts["router_fanout_queries_total"]) / fanouts, 2)
        c1 = {name: closed_loop(url, questions, concurrency=1, seconds=seconds) for name, url in sides.items()}
        out["load_c1"] = c1
    whos = list(sides)
    p99 = {w: median_of(rounds_c32, w, "p99_ms") for w in whos}
    qps = {w: median_of(rounds_c32, w, "qps") for w in whos}
    out["p99_ms_c32"], out["qps_c32"] = p99, qps
    out["p99_overhead_c32"] = round(p99["router"] / p99["unsharded"] - 1, 3)
    out["qps_ratio_c32"] = round(qps["router"] / qps["unsharded"], 3)
    out["p50_overhead_c1"] = round(c1["router"]["p50_ms"] / c1["unsharded"]["p50_ms"] - 1, 3)
    out["docs"] = {"p99_overhead_c32": round(p99["router_docs"] / p99["unsharded"] - 1, 3),
                   "qps_ratio_c32": round(qps["router_docs"] / qps["unsharded"], 3),
                   "p50_overhead_c1": round(c1["router_docs"]["p50_ms"] / c1["unsharded"]["p50_ms"] - 1, 3)}  # fmt: skip
    if fixed_regroup:
        out["fixed_regroup"] = {"p99_overhead_c32": round(p99["router_fixed_regroup"] / p99["unsharded"] - 1, 3),
                                "qps_ratio_c32": round(qps["router_fixed_regroup"] / qps["unsharded"], 3),
                                "router_args": ["--no-regroup-follows-fanout"]}  # fmt: skip
    out["cpu_ms_per_query_c32"] = _cpu_per_side(rounds_c32)
    out["passage_cost_per_fanout"] = passage_cost(index)
    out["note"] = (f"{os.cpu_count()} cores shared by everything: one `emapg serve` (unsharded) against `emapg router` "
                   "(encodes each query once, micro-batched; one /search per shard per joined batch; the shards send their "
                   "top-k passages) + 2 shard `emapg serve` processes, and `emapg router --docs <the unsharded index>` (docs: "
                   "the shards send rows and scores, the router reads the merged passages itself), "
                   + ("and `emapg router --no-regroup-follows-fanout` (fixed_regroup: the server's fixed 5 ms regroup wait), "
                      if fixed_regroup else "")
                   + "plus the load generator; medians of "
                   f"{rounds} alternating {seconds:g}-s windows each; cpu_ms_per_query_c32: CPU time per answered query of "
                   "every process, medians over each side's windows")  # fmt: skip
    return out


def passage_cost(index: Path, queries: int = 16, topk: int = 3, shard_rows: int = 21504, repeat: int = 300) -> dict:
    """In process, CPU time: what the passages cost one fan-out of ``queries`` queries at ``topk`` over 2 shards, sent by
    the shards (each looks up, formats and JSON-encodes its top-k passages; the router decodes and checks both answers)
    against ``--docs`` (the shards send rows and scores; the router decodes them and looks the merged top-k up once)."""
    from emapg.server_input import json_response
    from retriever.corpus import DocStore
    from retriever.router import _shard_hits, merge_hits
    from retriever.server import format_result

    store = DocStore(index)
    rng = np.random.default_rng(0)
    rows = rng.integers(0, shard_rows, (queries, topk))
    scores = np.sort(rng.random((queries, topk)).astype(np.float32), axis=1)[:, ::-1]

    def shard_passages() -> bytes:
        docs = iter(store.lookup(rows.ravel()))
        return json_response(format_result([[{**next(docs), "score": float(s)} for s in q] for q in scores], True)).body

    def shard_rows_only() -> bytes:
        return json_response({"rows": [r.tolist() for r in rows], "scores": [s.tolist() for s in scores]}).body

    text, bare = shard_passages(), shard_rows_only()

    def router_passages() -> list:
        return merge_hits([_shard_hits(text, queries), _shard_hits(text, queries)], topk)

    def router_docs() -> list:
        answer = json.loads(bare)
        per_shard = [[[{"row": o + r, "score": x} for r, x in zip(rr, ss)] for rr, ss in zip(answer["rows"], answer["scores"])] for o in (0, shard_rows)]
        merged = merge_hits(per_shard, topk)
        docs = iter(store.lookup(np.array([h["row"] for q in merged for h in q], dtype=np.int64)))
        return [[{"document": next(docs), "score": h["score"]} for h in q] for q in merged]

    def cpu_ms(f) -> float:
        t = time.process_time()
        for _ in range(repeat):
            f()
        return (time.process_time() - t) / repeat * 1000

    from_shards = 2 * cpu_ms(shard_passages) + cpu_ms(router_passages)
    docs = 2 * cpu_ms(shard_rows_only) + cpu_ms(router_docs)
    return {"queries": queries, "topk": topk, "shard_answer_bytes": {"passages": len(text), "rows": len(bare)},
            "cpu_ms": {"passages_from_shards": round(from_shards, 3), "docs": round(docs, 3)}, "ratio": round(docs / from_shards, 3)}  # fmt: skip


def _exactness(reference: str, url: str, questions: list[str]) -> dict:
    """200 questions one request at a time to both: ids, order and bit-identical scores."""
    import httpx

    same_ids = same_scores = 0
    max_diff = 0.0
    for q in questions:
        a = httpx.post(reference + "/retrieve", json={"queries": [q], "topk": 10, "return_scores": True}, timeout=60).json()["result"][0]
        b = httpx.post(url + "/retrieve", json={"queries": [q], "topk": 10, "return_scores": True}, timeout=60).json()["result"][0]
        same_ids += [h["document"] for h in a] == [h["document"] for h in b]
        same_scores += [h["score"] for h in a] == [h["score"] for h in b]
        max_diff = max(max_diff, *(abs(x["score"] - y["score"]) for x, y in zip(a, b)))
    return {"questions": len(questions), "topk": 10, "identical_ids_and_order": same_ids, "bit_identical_scores": same_scores,
            "max_abs_score_diff": max_diff}  # fmt: skip


def _cpu_per_side(windows: list[dict]) -> dict:
    """Per side, the median CPU ms per answered query of the processes that served it (and their sum)."""
    serving = {"unsharded": ["unsharded"], "router": ["router", "shard_0", "shard_1"],
               "router_docs": ["router_docs", "shard_0", "shard_1"],
               "router_fixed_regroup": ["router_fixed_regroup", "shard_0", "shard_1"]}  # fmt: skip
    out = {}
    for who, procs in serving.items():
        mine = [w["cpu_ms_per_query"] for w in windows if w["who"] == who and "cpu_ms_per_query" in w]
        if mine:
            out[who] = {p: round(float(np.median([m[p] for m in mine])), 3) for p in procs}
            out[who]["total"] = round(float(np.median([sum(m[p] for p in procs) for m in mine])), 3)
    return out


def synthetic(work: Path, rows: int, dim: int, n_queries: int, seed: int = 0) -> Path:
    """Clustered unit vectors as float16 chunk files (see the module docstring); returns the emb dir."""
    emb = work / f"synthetic-{rows}x{dim}" / "emb"
    done = emb.parent / "done.json"
    if done.is_file():
        return emb
    emb.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    k = 4096
    centres = rng.standard_normal((k, dim)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    weights = 1.0 / np.arange(1, k + 1) ** 1.1
    weights /= weights.sum()
    spread = rng.uniform(0.35, 0.7, k).astype(np.float32) / np.sqrt(dim)
    chunk = 65536

    def draw(n: int, r: np.random.Generator) -> np.ndarray:
        c = r.choice(k, size=n, p=weights)
        x = centres[c] + r.standard_normal((n, dim)).astype(np.float32) * spread[c, None]
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    for i, lo in enumerate(range(0, rows, chunk)):
        np.save(emb / f"chunk_{i:05d}.npy", draw(min(chunk, rows - lo), np.random.default_rng([seed, i])).astype(np.float16))
    np.save(emb.parent / "queries.npy", draw(n_queries, np.random.default_rng([seed, 10**6])))
    done.write_text(json.dumps({"rows": rows, "dim": dim, "chunk": chunk}))
    return emb


SYNTHETIC_HOW = ("4096 cluster centres, Zipf(1.1) sizes, Gaussian spread 0.35-0.7 of the centre norm, unit-normalised, float16 on disk; "
                 "queries drawn the same way; Flat and HNSW measured on the first 100k rows (recall against that subset's exact "
                 "top-10); the IVF rungs share one coarse quantizer; no OPQ rung (OPQ96 training did not finish in 10 min here)")


def synthetic_ladder(work: Path, rows: int, dim: int, deadline: float, on_rung) -> dict:
    """The ladder on the synthetic set, in process; the most telling rungs first. No rung starts after
    ``deadline`` (``time.monotonic()``); ``on_rung(partial_report)`` after every rung; measured rungs are
    stored (``result.json``) so a rerun resumes."""
    import faiss

    from retriever.ladder import build_rung, exact_topk, extrapolate, measure_rung, recommend, register_build
    from retriever.ondisk import DiskVectors

    emb = synthetic(work, rows, dim, 300)
    vectors = DiskVectors(emb, 65536, rows)
    queries = np.load(emb.parent / "queries.npy")
    faiss.omp_set_num_threads(2)
    subset = min(rows, 100_000)  # Flat fp32 (6 GB at 2M) and HNSW (its graph build) are measured on the first 100k rows
    sub_vectors = DiskVectors(emb, 65536, subset)
    truth, sub_truth = (_cached(emb.parent / f"truth-{n}.npy", lambda v=v: exact_topk(v, queries, 10, "ip")[1])
                        for n, v in ((rows, vectors), (subset, sub_vectors)))  # fmt: skip
    ladder_dir = work / "synthetic-ladder"
    rungs = [r for r in default_rungs(rows, dim) if not r.factory.startswith("OPQ")]  # OPQ96: see SYNTHETIC_HOW
    rungs.sort(key=_priority)
    on_subset = lambda r: r.factory.startswith("HNSW") or r.factory == "Flat"  # noqa: E731
    built: dict = {}
    for rung in rungs:  # earlier runs' builds (same coarse lists) are shared whatever the order
        register_build(built, rung, ladder_dir / rung.slug, subset if on_subset(rung) else rows)
    results, skipped = [], []
    report = lambda status: {"rows": rows, "dim": dim, "queries": len(queries), "status": status, "rungs": results,  # noqa: E731
                             "not_measured": skipped, "recommended": recommend(results, RECALL_FLOOR) if results else None, "how": SYNTHETIC_HOW}
    for i, rung in enumerate(rungs):
        if time.monotonic() > deadline:
            skipped = [r.name for r in rungs[i:]]
            break
        sub_rows, vs, tr = (subset, sub_vectors, sub_truth) if on_subset(rung) else (rows, vectors, truth)
        rdir = ladder_dir / rung.slug
        stored = rdir / "result.json"
        if stored.is_file() and json.loads(stored.read_text()).get("measured_rows") == sub_rows:
            results.append({**json.loads(stored.read_text()), "resumed": True})
            continue
        rdir.mkdir(parents=True, exist_ok=True)
        print(f"synthetic {rows}x{dim}: {rung.name} ...", file=sys.stderr, flush=True)
        build = build_rung(rung, rdir, vs, "ip", train_sample=100_000, seed=0, max_build_ram_mb=2048, threads=2, built=built)
        rec, _ = measure_rung(rung, rdir, vs, "ip", queries, tr, 2)
        rec.update(build, measured_rows=sub_rows, measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        rec["target"] = extrapolate(rec["layout"], rec["index_bytes"], sub_rows, dim, 21_000_000, 768, bool(rung.rerank))
        stored.write_text(json.dumps(rec, indent=1))
        results.append(rec)
        print(json.dumps({k: rec.get(k) for k in ("name", "recall_at_3", "bytes_per_passage", "qps_batch32", "build_seconds",
                                                   "peak_build_rss_bytes", "peak_build_anon_bytes")}), file=sys.stderr, flush=True)  # fmt: skip
        on_rung(report(f"partial: in progress ({len(results)} of {len(rungs)} rungs)"))
    return report("complete" if not skipped else f"partial: the time budget ended before {len(skipped)} of {len(rungs)} rungs")


def _priority(rung) -> int:
    """Synthetic ladder order: Flat (the reference, fast), IVF-PQ with and without re-rank (the recommendation
    at 43k), IVF-SQ8, then the rest (flat codes, which search 2M rows exhaustively, and the HNSW graph build)."""
    kinds = [lambda f: f == "Flat", lambda f: ",PQ" in f, lambda f: f.startswith("IVF") and f.endswith("SQ8"), lambda f: f.startswith("IVF"),
             lambda f: f == "SQ8", lambda f: f == "SQfp16"]  # fmt: skip
    return next((i for i, kind in enumerate(kinds) if kind(rung.factory)), len(kinds))


def _cached(path: Path, compute):
    if path.is_file():
        return np.load(path)
    value = compute()
    np.save(path, value)
    return value


def synthetic_only(work: Path, rows: int, deadline: float, out: Path, t0: float) -> int:
    result = {"mode": "full, synthetic only", "date": time.strftime("%Y-%m-%d", time.gmtime()),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg": os.getloadavg()}}  # fmt: skip

    def write(synthetic: dict) -> None:
        result.update(synthetic=synthetic, status=synthetic["status"], wall_seconds=round(time.perf_counter() - t0, 1))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))

    write(synthetic_ladder(work, rows, 768, deadline, write))
    syn = result["synthetic"]
    print(json.dumps({"status": syn["status"], "recommended": syn["recommended"], "not_measured": syn["not_measured"],
                      "rungs": [{k: r.get(k) for k in ("name", "recall_at_3", "bytes_per_passage", "qps_batch32", "measured_rows")}
                                for r in syn["rungs"]], "wall_seconds": result["wall_seconds"]}, indent=1))  # fmt: skip
    return 0


def router_only(work: Path, out: Path, t0: float, load_at_start: tuple) -> int:
    from retriever.index_builder import BuildConfig, build_index

    index = cache_dir() / "indexes" / "wiki_mini-minilm-flat-from-vectors"  # what the ladder (run_ladder) builds from VECTORS
    if not (index / "meta.json").is_file():
        build_index(BuildConfig(corpus=str(CORPUS), out=str(index), vectors=str(VECTORS), device="cpu", progress=False), log=lambda m: None)
    router = router_overhead(work, index, quick=True, rounds=6, fixed_regroup=True, seconds=5.0)
    result = {"mode": "router only", "date": time.strftime("%Y-%m-%d", time.gmtime()),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg_at_start": load_at_start, "loadavg": os.getloadavg()},
              "index": str(index), "router": router, "wall_seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: router[k] for k in ("exactness", "qps_c32", "p99_ms_c32", "p99_overhead_c32", "qps_ratio_c32", "p50_overhead_c1",
                                             "router_queries_per_fanout_c32", "docs", "fixed_regroup", "cpu_ms_per_query_c32", "latency_split_c32",
                                             "passage_cost_per_fanout")}, indent=1))  # fmt: skip
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the 43k ladder with a server subset, the side-by-side and the router, <= 5 min")
    p.add_argument("--synthetic-rows", type=int, default=2_000_000, help="full mode: rows of the synthetic 768-d set")
    p.add_argument("--time-budget-min", type=float, default=25.0, help="full mode: no synthetic rung starts after this many minutes")
    p.add_argument("--synthetic-only", action="store_true", help=f"full mode without the 43k parts (what --quick measures): the synthetic "
                                                                  f"ladder alone, to {OUT_SYNTHETIC.name}")  # fmt: skip
    p.add_argument("--router-only", action="store_true", help=f"only the router's exactness and overhead (part 3, as --quick "
                                                                f"measures it) on the 43k index, to {OUT_ROUTER.name}")  # fmt: skip
    p.add_argument("--work", default=str(cache_dir() / "retriever_scale"), help="working directory (rung indexes, shards; a rerun resumes)")
    p.add_argument("--out", default=None, help=f"JSON output (default: {OUT.name} with --quick, else {OUT_FULL.name})")
    args = p.parse_args()
    # stopped (`timeout`, a session's SIGTERM): unwind, so rung builds and servers end with the benchmark
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t0 = time.perf_counter()
    load_at_start = os.getloadavg()
    deadline = time.monotonic() + args.time_budget_min * 60
    out = Path(args.out or (OUT_ROUTER if args.router_only else OUT if args.quick else OUT_SYNTHETIC if args.synthetic_only else OUT_FULL))
    work = Path(args.work) / ("quick" if args.quick else "full")
    work.mkdir(parents=True, exist_ok=True)
    if args.synthetic_only and not args.quick:
        return synthetic_only(work, args.synthetic_rows, deadline, out, t0)
    if args.router_only:
        return router_only(work, out, t0, load_at_start)
    report = ladder(work, args.quick)
    rungs = report["rungs"]
    flat = rungs[0]
    best = next((r for r in rungs if r["name"] == report["recommended"]), None)
    side = recommended_vs_flat(work, report, args.quick) if best else None
    print(json.dumps({"recommended_vs_flat_c32": side and {k: side[k] for k in ("qps_c32", "qps_ratio", "p99_ms", "p99_ratio")}}),
          file=sys.stderr, flush=True)  # fmt: skip
    router = router_overhead(work, Path(report["source"]["index"]), args.quick, fixed_regroup=not args.quick)
    result = {
        "mode": "quick" if args.quick else "full",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg_at_start": load_at_start, "loadavg": os.getloadavg()},
        "source": report["source"], "questions": report["questions"],
        "rungs": rungs,
        "recommended": report["recommended"],
        "target_21m_768": report["recommended_target"],
        "recommended_vs_flat": side,
        "router": router,
        "targets": {
            "recall3_ge_095_at_le_256_bytes": bool(best and best["recall_at_3"] >= RECALL_FLOOR and best["target"]["bytes_per_passage"] <= BYTES_TARGET),
            "recommended_bytes_per_passage_at_768": best["target"]["bytes_per_passage"] if best else None,
            "recommended_qps_c32_ge_flat": bool(side and side["qps_ratio"] >= 1.0),
            "peak_build_rss_le_2gb_plus_index": all(r["peak_build_rss_bytes"] <= 2 * 2**30 + r["index_bytes"] for r in rungs),
            "sharded_identical": all(e["identical_ids_and_order"] == e["questions"] and e["bit_identical_scores"] == e["questions"]
                                     for e in router["exactness"].values()),
            "router_p99_overhead_le_10pct": router["p99_overhead_c32"] <= 0.10,
        },
    }  # fmt: skip

    def write(status: str) -> None:
        result["status"] = status
        result["wall_seconds"] = round(time.perf_counter() - t0, 1)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))

    if args.quick:
        write("complete")
    else:
        write("partial: the synthetic ladder has not started")

        def on_rung(partial: dict) -> None:
            result["synthetic"] = partial
            write(f"partial: synthetic ladder {partial['status']}")

        result["synthetic"] = synthetic_ladder(work, args.synthetic_rows, 768, deadline, on_rung)
        status = result["synthetic"]["status"]
        write("complete" if status == "complete" else f"partial: synthetic ladder {status}")
    print(json.dumps({"recommended": result["recommended"], "target_21m_768": result["target_21m_768"], "targets": result["targets"],
                      "recommended_vs_flat_c32": side and {k: side[k] for k in ("qps_c32", "qps_ratio", "p99_ms", "p99_ratio")},
                      "router": {k: router[k] for k in ("exactness", "qps_c32", "p99_ms_c32", "p99_overhead_c32", "qps_ratio_c32",
                                                        "p50_overhead_c1", "router_queries_per_fanout_c32", "docs", "cpu_ms_per_query_c32")},
                      "status": result["status"], "wall_seconds": result["wall_seconds"]}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
