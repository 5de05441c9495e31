"""``emapg router``: one ``/retrieve`` in front of a sharded index (``emapg index shard`` + one ``emapg serve`` per shard).

The router speaks the retrieval server's API (Search-R1's ``POST /retrieve``, ``GET /health``,
``GET /metrics``), so training and evaluation take its URL like any retriever's. Per request it

1. checks the body exactly as ``emapg serve`` does (4xx with a message);
2. encodes the queries once (``--encode``, the default: the encoder the shards' ``/health`` fingerprint
   names, its weight files checked against it, micro-batched across requests as ``emapg serve`` does)
   and sends the vectors to one replica of every shard at once (``POST /search`` of ``emapg serve``;
   ``--no-encode`` forwards the text to their ``/retrieve`` instead, and every shard encodes every query) (``--shard`` once per shard, in shard
   order; replicas of a shard comma-separated, taken round-robin among the healthy ones), asking for
   ``topk`` hits with scores; a replica that fails (connection error, 5xx, 429) is marked down and the
   next healthy replica of that shard is tried, all within ``--deadline-ms``. The fan-outs of requests
   ready in the same event-loop iteration -- with ``--encode``, every request of one encoded
   micro-batch -- are **one request per shard** (up to ``--max-batch`` queries, each request's share
   cut out of the answer; its deadline the earliest of theirs): at 32 concurrent clients a shard
   answers a few batched searches instead of 32 single-query requests, each with its HTTP round trip
   (per request, the router's p99 overhead at c = 32 was +92% over one server on the same 2 cores;
   ``benchmarks/retriever_scale.py``). If the shards refuse a joined request (4xx, e.g. a shard's
   lower ``--max-queries-per-request``), its requests are re-sent one by one;
3. merges the shards' lists by score, best first, ties to the lower shard then the shard's own order
   (contiguous shards: the lower row, as FAISS orders ties), and keeps the top ``topk``. For Flat
   shards this is exactly the unsharded index's answer: ids, order and scores
   (``tests/retriever/test_router.py``).
4. ``--docs DIR`` (the index the shards were split from, its fingerprint checked against theirs): the
   shards answer row numbers and scores only (``/search`` with ``"documents": false``) and the router
   reads the merged top-k passages from ``DIR``'s memory-mapped document store, once per query, instead
   of every shard looking up, encoding and sending its top-k passages and the router decoding them all.

**Partial results** (a shard down, all its replicas failing, or slower than the deadline): the router
answers **200** with the merged hits of the shards that did answer and flags it, in the body
(``"partial": {"missing_shards": [1], "reasons": {"1": "deadline 2000 ms"}}``: Search-R1 clients ignore
the extra key; :class:`retriever.client.RetrieverClient` logs a warning and counts it) and in the header
``X-Emapg-Partial: missing=1``; ``router_partial_responses_total`` counts them. A shard failure never
makes the router answer 5xx. Only when **no** shard answers is there nothing to return: 503 ("no shard
answered", retryable, as a loading server's). A shard's 4xx (a request it refuses, e.g. a lower
``--max-topk``) is passed through when every shard refuses it, and otherwise counts as that shard missing.

**Health gating**: every ``--health-interval-s`` the router polls each replica's ``/health``; a replica
that fails it gets no requests until it passes again. Its own ``/health`` is 200 ``"ok"`` when every
shard has a healthy replica, 200 ``"degraded"`` (with the missing shards) when some have none, 503 when
none has; it carries the shards' fingerprints and, when all come from one ``emapg index shard`` run,
the unsharded index's fingerprint id (``source_fingerprint``).

``/metrics``: the server's request counters and latency histogram, plus per shard
``router_shard_latency_seconds{shard}``, ``router_shard_requests_total{shard,replica,outcome}``,
``router_replica_up{shard,replica}``, ``router_partial_responses_total``, and
``router_fanouts_total`` / ``router_fanout_queries_total`` (queries per fan-out: their ratio),
``router_fanout_round_trip_seconds`` and ``router_regroup_wait_seconds``.

**Batching follows the fan-out** (``--encode``): closed-loop clients (rollout workers) come back only after
their batch's fan-out to the shards, ~25 ms later than a server's clients; with the server's fixed 5 ms
regroup wait a batch worker went on without them, and 32 clients settled into three groups of ~10.5 queries
(smaller encoder batches cost more per query). The router therefore adds the fan-out's measured round trip
(moving average, at most 50 ms) to the regroup wait: ~15.7 queries per batch instead of ~11.5, 8-16% less CPU
per query on the sharded side, and a p99 over one unsharded server of +6.5%, +14.4% and +3.0% in three runs
instead of +22.9%, +19.7% and +18.1% with the fixed wait (side by side, ``benchmarks/retriever_scale.py --router-only``).
"""

from __future__ import annotations

import asyncio
import base64
import gc
import heapq
import itertools
import json
import logging
import math
import os
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from emapg.config import ConfigError, option
from emapg.server_input import HTTPError, guarded, install_error_handlers, json_response, read_body, serve_directly
from emapg.servers import ServerOptions, help_of

from retriever.client import normalize_url
from retriever.metrics import LATENCY_BUCKETS, Histogram, Metrics
from retriever.schema import parse_retrieve_body

log = logging.getLogger("retriever.router")

FANOUT_RTT_WEIGHT = 0.2  # of the newest fan-out in the round-trip moving average
MAX_REGROUP_FANOUT_S = 0.05  # the fan-out's share of the regroup wait at most (a slow shard must not hold batches long)


@dataclass(kw_only=True)
class RouterConfig(ServerOptions):
    """Options of ``emapg router`` (the command-line flags are generated from these fields)."""

    port: int = option(8100, help=help_of(ServerOptions, "port"))
    api_key_env: str = option("EMAPG_RETRIEVER_API_KEY", help=help_of(ServerOptions, "api_key_env"))
    shard: list[str] = option(help="one per shard, in shard order: the shard's server URL, or its replicas' URLs separated by commas")
    shard_api_key_env: str = option("EMAPG_RETRIEVER_API_KEY", help="environment variable holding the API key the shard servers "
                                                                    "expect (unset or empty: none)")  # fmt: skip
    deadline_ms: float = option(2000.0, help="per-request deadline for every shard, retries to other replicas included; a shard "
                                             "not answered by then is missing from a partial answer")  # fmt: skip
    health_interval_s: float = option(1.0, help="seconds between health checks of every replica")
    topk: int = option(3, help="hits per query when a request gives no topk")
    max_topk: int = option(100, help="largest topk a request may ask for")
    max_queries_per_request: int = option(4096, help="reject requests with more queries")
    max_query_chars: int = option(2000, help="reject queries longer than this many characters")
    max_connections: int = option(64, help="open connections per replica")
    encode: bool = option(True, help="encode each query once, here, and send the vectors to the shards' /search (the encoder the "
                                     "shards' /health names, its weight files checked against their fingerprint); "
                                     "--no-encode forwards the text to every shard's /retrieve, so every shard encodes every query")  # fmt: skip
    encode_threads: int = option(0, help="--encode: CPU forward passes at once (0: CPU cores / OMP_NUM_THREADS), as `emapg serve`")
    batch_invariant: bool = option(False, help="--encode: each query in a forward pass of its own, as `emapg serve --batch-invariant` (the shards search "
                                               "each query alone with their own --batch-invariant)")
    max_batch: int = option(64, help="--encode: most queries encoded together across requests")
    max_wait_ms: float = option(5.0, ge=0, help="--encode: how long the first query of a batch may wait for company under concurrent traffic, in ms")
    regroup_wait_ms: float = option(5.0, ge=0, help="--encode: as `emapg serve --regroup-wait-ms`; the router adds the fan-out's "
                                              "measured round trip (see regroup_follows_fanout)")  # fmt: skip
    regroup_follows_fanout: bool = option(
        True, help="--encode: wait for the clients of a finished batch for regroup_wait_ms plus the moving average of the "
        "fan-out round trip (at most 50 ms more): those clients come back only after their batch's fan-out to the "
        "shards, later than a server's clients do. At 32 clients on 2 cores: batches of ~15.7 queries instead of ~11.5 "
        "with a fixed 5 ms, p99 over one unsharded server +6.5%, +14.4% and +3.0% in three runs instead of +22.9%, +19.7% "
        "and +18.1%")  # fmt: skip
    docs: str = option("", help="--encode: the index directory the shards were split from (`emapg index shard --index`; its "
                                "fingerprint checked against theirs), or a copy of it: the shards then answer row numbers and "
                                "scores only and the router reads the merged top-k passages from this directory's document "
                                "store (memory-mapped), once per query; empty: the shards send the passages")  # fmt: skip

    def validate(self) -> None:
        super().validate()
        if not self.shard:
            raise ConfigError("--shard is required: one per shard, e.g. --shard http://127.0.0.1:8001 --shard http://127.0.0.1:8002")
        for i, spec in enumerate(self.shard):
            urls = [u for u in spec.split(",") if u.strip()]
            if not urls:
                raise ConfigError(f"--shard #{i}: no URL")
            for u in urls:
                try:
                    normalize_url(u)
                except ValueError as e:
                    raise ConfigError(f"--shard #{i}: {e}") from None
        if not (math.isfinite(self.deadline_ms) and self.deadline_ms > 0):
            raise ConfigError("--deadline-ms must be > 0")
        if not (math.isfinite(self.health_interval_s) and self.health_interval_s > 0):
            raise ConfigError("--health-interval-s must be > 0")
        for name in ("topk", "max_topk", "max_queries_per_request", "max_query_chars", "max_connections"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if self.topk > self.max_topk:
            raise ConfigError(f"--topk {self.topk} exceeds --max-topk {self.max_topk}")
        if self.docs and not self.encode:
            raise ConfigError("--docs needs --encode: with --no-encode the shards' /retrieve sends the passages")


@dataclass
class Replica:
    url: str
    up: bool = False
    health: dict | None = None  # the last 200 /health body
    idle: list = field(default_factory=list)  # kept-alive connections (LeanHTTPClient) not in use

    async def post(self, body: bytes, headers: dict[str, str], path: str = "/retrieve") -> tuple[int, bytes]:
        """POST /retrieve on a kept-alive connection of this replica's pool. A bare asyncio HTTP/1.1 client:
        httpx's async client cost the router ~15x its throughput at 32 clients on 2 cores (measured:
        10 q/s against 155 for one shard alone), its per-request CPU competing with the shards'."""
        from retriever.loadgen import LeanHTTPClient

        reused = bool(self.idle)
        conn = self.idle.pop() if reused else LeanHTTPClient(self.url, headers)
        try:
            status, data = await conn.post(path, body)
        except (OSError, asyncio.IncompleteReadError):
            await conn.close()
            if reused:  # the server closed an idle kept-alive connection: not a failure of the replica
                return await self.post(body, headers, path)
            raise
        except BaseException:  # an error or a cancellation (deadline) mid-answer: the connection's state is unknown
            await conn.close()
            raise
        self.idle.append(conn)
        return status, data


@dataclass
class Shard:
    index: int
    replicas: list[Replica]
    turn: itertools.count = field(default_factory=itertools.count)
    latency: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))

    def order(self) -> list[Replica]:
        """Healthy replicas, starting at the next one in turn (round-robin)."""
        up = [r for r in self.replicas if r.up]
        if not up:
            return []
        start = next(self.turn) % len(up)
        return up[start:] + up[:start]


class ShardFailure(Exception):
    def __init__(self, reason: str, status: int | None = None, message: str | None = None):
        super().__init__(reason)
        self.reason, self.status, self.message = reason, status, message


def merge_hits(per_shard: list[list[list[dict]] | None], topk: int) -> list[list[dict]]:
    """Per query, the best ``topk`` of every answering shard's hits (each shard's list best first):
    score descending, ties to the lower shard, then the shard's own order. ``None`` = a shard that did
    not answer. The hits are passed through as they are (``{"document": ..., "score": ...}``)."""
    answered = [hits for hits in per_shard if hits is not None]
    out = []
    for q in range(len(answered[0])):
        runs = [[(-h["score"], s, r, h) for r, h in enumerate(hits[q])] for s, hits in enumerate(answered)]
        out.append([h for *_, h in itertools.islice(heapq.merge(*runs, key=lambda t: t[:3]), topk)])
    return out


@dataclass
class _FanOutJob:
    """One request's part of a joined fan-out."""

    items: Any  # its queries: the rows of the query vectors (np.ndarray [n, dim]) or the texts
    topk: int
    deadline: float  # time.monotonic()
    future: asyncio.Future  # -> (per shard: its hits for these queries or None, reasons, refusals)

    def __len__(self) -> int:
        return len(self.items)


def _groups(jobs: list[_FanOutJob], most: int) -> list[list[_FanOutJob]]:
    """Consecutive groups of whole jobs, at most ``most`` queries each (one job at least)."""
    groups: list[list[_FanOutJob]] = []
    n = most
    for job in jobs:
        if n + len(job) > most:
            groups.append([])
            n = 0
        groups[-1].append(job)
        n += len(job)
    return groups


class Router:
    def __init__(self, cfg: RouterConfig, metrics: Metrics):
        self.cfg = cfg
        self.metrics = metrics
        self.shards = [Shard(i, [Replica(normalize_url(u)) for u in spec.split(",") if u.strip()]) for i, spec in enumerate(cfg.shard)]
        self.partial_responses = 0
        self.fanouts = 0  # requests to every shard (one per joined group)
        self.fanout_queries = 0  # queries they carried
        self.fanout_rtt_s: float | None = None  # moving average of a fan-out's round trip (every shard answered)
        self.waiting: list[_FanOutJob] = []  # fan-outs asked for in this event-loop iteration
        self.groups_running: set[asyncio.Task] = set()
        self.outcomes: dict[tuple[int, str, str], int] = {}
        self.checked = asyncio.Event()  # the first health round finished
        key = os.environ.get(cfg.shard_api_key_env) or None
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http: httpx.AsyncClient | None = None
        self.batcher = None  # --encode: a MicroBatcher over the query encoder, once loaded
        self.docs = None  # --docs: the source index's DocStore, once opened
        self.docs_fingerprint: str | None = None
        self.encoder = None
        self.ready = asyncio.Event()  # shards checked (and, with --encode, the encoder loaded)
        self.error: str | None = None

    async def load_encoder(self, executor) -> None:
        """--encode: wait for a healthy shard, load the encoder its fingerprint names, check its weights, start batching."""
        from retriever.batcher import MicroBatcher
        from retriever.encoder import Encoder, EncoderSpec, default_encode_threads
        from retriever.fingerprint import model_files_sha256

        while True:
            await self.checked.wait()
            fp = next((r.health.get("fingerprint") for s in self.shards for r in s.replicas if r.up and r.health), None)
            if fp:
                break
            await asyncio.sleep(self.cfg.health_interval_s)
        spec = EncoderSpec.from_dict({**fp, "name": fp["encoder"], "normalize": fp["normalize"]})

        def load():
            from emapg.models import resolve_model

            mine = model_files_sha256(resolve_model(spec.name))
            if mine != fp["encoder_sha256"]:
                raise ValueError(f"the encoder {spec.name!r} here has other weight files ({mine}) than the shards' ({fp['encoder_sha256']})")
            return Encoder(spec, device="cpu", threads=self.cfg.encode_threads or default_encode_threads(),
                           batch_invariant=self.cfg.batch_invariant)

        try:
            self.encoder = await asyncio.get_running_loop().run_in_executor(executor, load)
            if self.cfg.docs:
                self.open_docs()
        except Exception as e:  # noqa: BLE001 - reported through /health
            self.error = f"{type(e).__name__}: {e}"
            log.error("loading the query encoder failed: %s", self.error)
            return

        def encode(queries: list[str], topk: int, share: float) -> list[list]:
            parts = max(1, round(share * self.encoder.parallel))
            return [[v] for v in self.encoder.encode_queries(queries, batch_size=64, parts=parts)]  # [v]: one "hit" per query

        # as `emapg serve` does: the model, tokenizer and libraries, alive as long as the router, leave the collector's
        # generations, so that no full collection traverses them while requests wait (the GIL held for ~0.5 s)
        gc.freeze()
        self.batcher = MicroBatcher(encode, executor, self.cfg.max_batch, self.cfg.max_wait_ms / 1000, self.metrics,
                                    self.cfg.regroup_wait_ms / 1000, workers=self.encoder.parallel)  # fmt: skip
        self.batcher.start()
        self.ready.set()

    def open_docs(self) -> None:
        """--docs: open the source index's document store; ValueError unless it is the index the healthy shards were split from."""
        from retriever.corpus import DocStore
        from retriever.index_files import read_meta

        meta = read_meta(self.cfg.docs)
        self.docs_fingerprint = (meta.get("fingerprint") or {}).get("id")
        for s in self.shards:
            shard = self._shard_meta(s)
            if shard and (shard.get("source_fingerprint") != self.docs_fingerprint or shard.get("rows_total") != meta["rows"]):
                raise ValueError(f"--docs {self.cfg.docs} (fingerprint {self.docs_fingerprint}, {meta['rows']} rows) is not the index shard "
                                 f"{s.index} was split from (fingerprint {shard.get('source_fingerprint')}, {shard.get('rows_total')} rows)")  # fmt: skip
        self.docs = DocStore(self.cfg.docs)

    async def start(self) -> None:
        limits = httpx.Limits(max_connections=self.cfg.max_connections * sum(len(s.replicas) for s in self.shards),
                              max_keepalive_connections=self.cfg.max_connections * sum(len(s.replicas) for s in self.shards))  # fmt: skip
        self.http = httpx.AsyncClient(limits=limits, headers=self.headers, timeout=httpx.Timeout(self.cfg.deadline_ms / 1000))

    async def close(self) -> None:
        if self.http is not None:
            await self.http.aclose()
        for s in self.shards:
            for r in s.replicas:
                for conn in r.idle:
                    await conn.close()

    # -- health

    async def check_health(self) -> None:
        async def one(r: Replica) -> None:
            try:
                resp = await self.http.get(r.url + "/health", timeout=max(1.0, self.cfg.health_interval_s))
                r.up = resp.status_code == 200
                r.health = resp.json() if r.up else r.health
            except (httpx.HTTPError, ValueError):
                r.up = False

        await asyncio.gather(*(one(r) for s in self.shards for r in s.replicas))
        self.checked.set()
        if not self.cfg.encode:
            self.ready.set()

    async def health_loop(self) -> None:
        while True:
            try:
                await self.check_health()
            except Exception:  # noqa: BLE001 - the loop must survive anything
                log.exception("health check failed")
            await asyncio.sleep(self.cfg.health_interval_s)

    def status(self) -> tuple[int, dict]:
        down = [s.index for s in self.shards if not any(r.up for r in s.replicas)]
        fps = [next((r.health.get("fingerprint") for r in s.replicas if r.up and r.health), None) for s in self.shards]
        source_ids = {self._shard_meta(s).get("source_fingerprint") for s in self.shards}
        body = {
            "status": "ok" if not down else ("degraded" if len(down) < len(self.shards) else "down"),
            "shards": [{"index": s.index, "replicas": [{"url": r.url, "up": r.up} for r in s.replicas],
                        "fingerprint": (fps[s.index] or {}).get("id"), "shard": self._shard_meta(s) or None} for s in self.shards],
            "source_fingerprint": source_ids.pop() if len(source_ids) == 1 else None,
        }  # fmt: skip
        if down:
            body["missing_shards"] = down
        if self.error:
            return 503, {"status": "failed", "error": self.error}
        if not self.ready.is_set():
            return 503, {"status": "loading"}
        body["encoder"] = "router" if self.batcher is not None else "shards"
        if self.encoder is not None:  # --encode: whether a query's vector depends on its batch (--batch-invariant)
            body["encoder_batch_invariant"] = self.encoder.batch_invariant
        body["passages"] = "router" if self.docs is not None else "shards"  # --docs: read here
        return (503 if len(down) == len(self.shards) else 200), body

    @staticmethod
    def _shard_meta(s: Shard) -> dict:
        for r in s.replicas:
            if r.health:
                return (r.health.get("index") or {}).get("shard") or {}
        return {}

    # -- retrieval

    async def _ask_shard(self, shard: Shard, body: bytes, n_queries: int, deadline: float, path: str) -> list[list[dict]]:
        order = shard.order()
        if not order:
            raise ShardFailure("no healthy replica")
        last = ShardFailure("no healthy replica")
        for r in order:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ShardFailure(f"deadline {self.cfg.deadline_ms:g} ms")
            t0 = time.perf_counter()
            outcome = "ok"
            try:
                status, data = await asyncio.wait_for(r.post(body, self.headers, path), timeout=left)
                if status == 200:
                    hits = _shard_hits(data, n_queries) if self.docs is None else self._shard_rows(shard, data, n_queries)
                    shard.latency.observe(time.perf_counter() - t0)
                    return hits
                outcome = f"http_{status}"
                if 400 <= status < 500 and status != 429:  # the request, not the replica
                    raise ShardFailure(outcome, status, _message(data))
                r.up = False
                last = ShardFailure(f"replica {r.url}: HTTP {status}")
            except asyncio.TimeoutError:
                outcome = "deadline"
                last = ShardFailure(f"deadline {self.cfg.deadline_ms:g} ms")
            except (OSError, asyncio.IncompleteReadError, KeyError, ValueError, TypeError) as e:
                outcome = "error"
                r.up = False  # until the next health check says otherwise
                last = ShardFailure(f"replica {r.url}: {type(e).__name__}")
            finally:
                key = (shard.index, r.url, outcome)
                self.outcomes[key] = self.outcomes.get(key, 0) + 1
        raise last

    async def retrieve(self, queries: list[str], topk: int) -> tuple[list[list[dict]], dict | None]:
        deadline = time.monotonic() + self.cfg.deadline_ms / 1000
        if self.batcher is not None:  # encode once here; the shards search the vectors
            items = np.stack([v[0] for v in await self.batcher.submit(queries, topk)]).astype("<f4")
        else:
            items = queries
        job = _FanOutJob(items, topk, deadline, asyncio.get_running_loop().create_future())
        self.waiting.append(job)
        if len(self.waiting) == 1:  # after the other requests resumed in this iteration (one encoded batch) joined
            asyncio.get_running_loop().call_soon(self._start_fan_outs)
        per_shard, reasons, refusals = await job.future
        if all(h is None for h in per_shard):
            if refusals and len(refusals) == len(self.shards):
                raise HTTPError(refusals[0].status, f"the shards refused the request: {refusals[0].message}", "shard_refused")
            raise HTTPError(503, f"no shard answered ({'; '.join(f'shard {k}: {v}' for k, v in reasons.items())}); retry", "no_shard")
        partial = None
        if reasons:
            self.partial_responses += 1
            partial = {"missing_shards": [int(k) for k in reasons], "reasons": reasons}
        merged = merge_hits(per_shard, topk)
        if self.docs is not None:  # the passages of the merged top-k, read here once
            docs = iter(self.docs.lookup(np.array([h["row"] for q in merged for h in q], dtype=np.int64)))
            merged = [[{"document": next(docs), "score": h["score"]} for h in q] for q in merged]
        return merged, partial

    def _start_fan_outs(self) -> None:
        jobs, self.waiting = self.waiting, []
        for group in _groups([j for j in jobs if not j.future.done()], self.cfg.max_batch):
            task = asyncio.get_running_loop().create_task(self._fan_out_group(group))
            self.groups_running.add(task)  # a reference until it ends
            task.add_done_callback(self.groups_running.discard)

    async def _fan_out_group(self, group: list[_FanOutJob]) -> None:
        """One request per shard for the whole group; each job gets its queries' hits (cut to its topk)."""
        try:
            topk = max(j.topk for j in group)
            if self.batcher is not None:
                q = group[0].items if len(group) == 1 else np.concatenate([j.items for j in group])
                ask = {"vectors_b64": base64.b64encode(q.tobytes()).decode(), "dim": q.shape[1], "topk": topk}
                body = json.dumps(ask if self.docs is None else {**ask, "documents": False}).encode()
                path = "/search"
            else:
                body = json.dumps({"queries": [t for j in group for t in j.items], "topk": topk, "return_scores": True}).encode()
                path = "/retrieve"
            n = sum(len(j) for j in group)
            self.fanouts += 1
            self.fanout_queries += n
            t_sent = time.monotonic()
            per_shard, reasons, refusals = await self._fan_out(body, n, min(j.deadline for j in group), path)
            if not reasons:
                self._fanout_answered(time.monotonic() - t_sent)
            if refusals and len(group) > 1:  # the shards refused the joined request (its size?): each request alone
                await asyncio.gather(*(self._fan_out_group([j]) for j in group))
                return
            pos = 0
            for j in group:
                mine = [None if hits is None else [q[: j.topk] for q in hits[pos : pos + len(j)]] for hits in per_shard]
                pos += len(j)
                if not j.future.done():  # its client may have gone
                    j.future.set_result((mine, reasons, refusals))
        except asyncio.CancelledError:  # shutting down
            for j in group:
                j.future.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - a bug here must fail these requests, not hang them
            log.exception("a fan-out failed")
            for j in group:
                if not j.future.done():
                    j.future.set_exception(e)

    def _fanout_answered(self, seconds: float) -> None:
        """A fan-out every shard answered took ``seconds``: update the moving average, and with it (--encode,
        regroup_follows_fanout) how long a batch worker waits for the clients it just answered."""
        rtt = seconds if self.fanout_rtt_s is None else self.fanout_rtt_s + FANOUT_RTT_WEIGHT * (seconds - self.fanout_rtt_s)
        self.fanout_rtt_s = rtt
        if self.batcher is not None and self.cfg.regroup_follows_fanout:
            self.batcher.regroup_wait_s = self.cfg.regroup_wait_ms / 1000 + min(rtt, MAX_REGROUP_FANOUT_S)

    async def _fan_out(self, body: bytes, n_queries: int, deadline: float, path: str) -> tuple[list, dict[str, str], list[ShardFailure]]:
        """``body`` to one replica of every shard at once: (per shard its hits or None, reasons for the Nones, 4xx refusals)."""
        answers = await asyncio.gather(*(self._ask_shard(s, body, n_queries, deadline, path) for s in self.shards), return_exceptions=True)
        per_shard, reasons, refusals = [], {}, []
        for s, a in zip(self.shards, answers):
            if isinstance(a, BaseException):
                per_shard.append(None)
                reasons[str(s.index)] = a.reason if isinstance(a, ShardFailure) else f"{type(a).__name__}: {a}"
                if isinstance(a, ShardFailure) and a.status is not None:
                    refusals.append(a)
                if not isinstance(a, ShardFailure):
                    log.error("shard %d failed unexpectedly", s.index, exc_info=a)
            else:
                per_shard.append(a)
        return per_shard, reasons, refusals

    def _shard_rows(self, shard: Shard, data: bytes, n_queries: int) -> list[list[dict]]:
        """--docs: a shard's ``{"rows", "scores"}`` answer as hits ``{"row": row in the source index, "score"}``
        (``ValueError`` / ``KeyError`` / ``TypeError`` when it is not one, or the shard is not of the --docs index)."""
        meta = self._shard_meta(shard)
        if meta.get("source_fingerprint") != self.docs_fingerprint:
            raise ValueError(f"shard {shard.index} was not split from --docs {self.cfg.docs}")
        offset, rows_total = meta["row_offset"], len(self.docs)
        answer = json.loads(data)
        rows, scores = answer["rows"], answer["scores"]
        if not (isinstance(rows, list) and isinstance(scores, list) and len(rows) == len(scores) == n_queries):
            raise ValueError(f"the shard answered no rows/scores lists for {n_queries} queries")
        hits = []
        for r, sc in zip(rows, scores):
            if len(r) != len(sc) or not all(type(i) is int and 0 <= offset + i < rows_total for i in r):
                raise ValueError("a shard's rows are not row numbers of the --docs index")
            if not all(isinstance(x, (int, float)) for x in sc):
                raise TypeError("a shard's score is not a number")
            hits.append([{"row": offset + i, "score": x} for i, x in zip(r, sc)])
        return hits

    def render_metrics(self) -> str:
        out = ["# HELP router_shard_latency_seconds Per shard: latency of its answered requests.",
               "# TYPE router_shard_latency_seconds histogram"]  # fmt: skip
        for s in self.shards:
            out += _labelled(s.latency.render("router_shard_latency_seconds"), f'shard="{s.index}"')
        out += ["# HELP router_shard_requests_total Requests to shard replicas by outcome (ok, deadline, error, http_<status>).",
                "# TYPE router_shard_requests_total counter"]  # fmt: skip
        out += [f'router_shard_requests_total{{shard="{s}",replica="{u}",outcome="{o}"}} {n}' for (s, u, o), n in sorted(self.outcomes.items())]
        out += ["# HELP router_replica_up Whether the replica passed its last health check.", "# TYPE router_replica_up gauge"]
        out += [f'router_replica_up{{shard="{s.index}",replica="{r.url}"}} {int(r.up)}' for s in self.shards for r in s.replicas]
        out += ["# HELP router_partial_responses_total Answers missing at least one shard.", "# TYPE router_partial_responses_total counter",
                f"router_partial_responses_total {self.partial_responses}"]  # fmt: skip
        if self.batcher is not None:
            out += ["# HELP router_regroup_wait_seconds How long a batch worker waits for the clients it just answered.",
                    "# TYPE router_regroup_wait_seconds gauge", f"router_regroup_wait_seconds {self.batcher.regroup_wait_s:.6f}"]  # fmt: skip
        if self.fanout_rtt_s is not None:
            out += ["# HELP router_fanout_round_trip_seconds Moving average of a fan-out's round trip (every shard answered).",
                    "# TYPE router_fanout_round_trip_seconds gauge", f"router_fanout_round_trip_seconds {self.fanout_rtt_s:.6f}"]  # fmt: skip
        out += ["# HELP router_fanouts_total Requests sent to every shard (requests ready together share one).",
                "# TYPE router_fanouts_total counter", f"router_fanouts_total {self.fanouts}",
                "# HELP router_fanout_queries_total Queries those requests carried.", "# TYPE router_fanout_queries_total counter",
                f"router_fanout_queries_total {self.fanout_queries}"]  # fmt: skip
        return "\n".join(out) + "\n"


def _labelled(lines: list[str], label: str) -> list[str]:
    """Add ``label`` to the Prometheus sample lines of one histogram."""
    out = []
    for line in lines:
        name, _, value = line.rpartition(" ")
        if "{" in name:
            name = name.replace("{", "{" + label + ",", 1)
        else:
            name = f"{name}{{{label}}}"
        out.append(f"{name} {value}")
    return out


def _shard_hits(data: bytes, n_queries: int) -> list[list[dict]]:
    """A shard's scored answer (``{"result": [[{"document": {"id", "contents"}, "score"}]]}``) for ``n_queries``
    queries; ``ValueError`` / ``KeyError`` / ``TypeError`` when it is not one."""
    hits = json.loads(data)["result"]
    if not isinstance(hits, list) or len(hits) != n_queries:
        raise ValueError(f"the shard answered {len(hits) if isinstance(hits, list) else 'no list'} for {n_queries} queries")
    for q in hits:
        for h in q:
            h["document"]["id"], h["document"]["contents"]  # noqa: B018 - present, or KeyError/TypeError
            if not isinstance(h["score"], (int, float)):
                raise TypeError(f"a shard's score is {type(h['score']).__name__}")
    return hits


def _message(data: bytes) -> str:
    try:
        return str(json.loads(data).get("detail") or data.decode(errors="replace"))[:300]
    except (ValueError, AttributeError):
        return data.decode(errors="replace")[:300]


def create_app(cfg: RouterConfig, on_fatal=None) -> FastAPI:
    cfg.validate()
    metrics = Metrics()
    router = Router(cfg, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        from concurrent.futures import ThreadPoolExecutor

        await router.start()
        executor = ThreadPoolExecutor(max_workers=max(os.cpu_count() or 1, cfg.encode_threads), thread_name_prefix="router-encoder")
        tasks = [asyncio.get_running_loop().create_task(router.health_loop())]
        if cfg.encode:
            tasks.append(asyncio.get_running_loop().create_task(router.load_encoder(executor)))
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            if router.batcher is not None:
                await router.batcher.stop()
            if router.encoder is not None:
                router.encoder.close()
            executor.shutdown(wait=False, cancel_futures=True)
            await router.close()

    app = FastAPI(title="ema-pg retriever router", version="1", lifespan=lifespan,
                  description="One /retrieve over a sharded index: fan-out, exact top-k merge, deadlines, health gating.")  # fmt: skip
    app.state.router = router
    api_key = cfg.api_key_value()
    install_error_handlers(app, metrics.count)
    endpoint = guarded(api_key, metrics.count, log)

    @app.post("/retrieve")
    @endpoint
    async def retrieve(request: Request):
        """Top-k passages for each query, merged over the shards (Search-R1 request/response format)."""
        body = await read_body(request, cfg.max_body_bytes, timeout_s=cfg.body_timeout, hint="; send fewer or shorter queries")
        queries, topk, return_scores = parse_retrieve_body(body, cfg)
        if router.error:
            raise HTTPError(503, f"the router failed to start: {router.error}")
        if not router.ready.is_set():
            raise HTTPError(503, "the router is checking its shards (and loading the query encoder); retry when GET /health returns 200")
        hits, partial = await router.retrieve(queries, topk)
        payload = {"result": hits if return_scores else [[h["document"] for h in q] for q in hits]}  # the shards' scored shape
        headers = None
        if partial is not None:
            payload["partial"] = partial
            headers = {"X-Emapg-Partial": "missing=" + ",".join(map(str, partial["missing_shards"]))}
        if router.batcher is None:
            metrics.batch(len(queries), 0.0)
        return json_response(payload, headers=headers)

    serve_directly(app, "POST", "/retrieve", retrieve)

    @app.get("/health")
    @guarded(api_key, metrics.count, log, open_=True)
    async def health(request: Request):
        """200 ``ok`` (every shard has a healthy replica) or ``degraded`` (some have none); 503 when none has."""
        status, body = router.status()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics", response_class=PlainTextResponse)
    @endpoint
    async def metrics_endpoint(request: Request):
        """Prometheus text: requests, latency, and per shard latency, outcomes, replica health, partial answers."""
        return PlainTextResponse(metrics.render() + router.render_metrics(), media_type="text/plain; version=0.0.4")

    return app


def serve(cfg: RouterConfig) -> int:
    from emapg.servers import run_uvicorn

    cfg.validate()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per health check is noise
    banner = f"routing http://{cfg.host}:{cfg.port}/retrieve over {len(cfg.shard)} shards (deadline {cfg.deadline_ms:g} ms)"
    return run_uvicorn(create_app, cfg, log=log, exposes="query the index", banner=banner)
