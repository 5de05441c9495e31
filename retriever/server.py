"""FastAPI retrieval server, a drop-in replacement for Search-R1's ``retrieval_server.py``.

``POST /retrieve`` takes ``{"queries": [str], "topk": int, "return_scores": bool}`` and answers
``{"result": [[{"document": {"id", "contents"}, "score": float}, ...], ...]}`` with scores, or
``{"result": [[{"id", "contents"}, ...], ...]}`` without (Search-R1 crashes on that branch).

Design (where it departs from Search-R1, and why):

* Batch workers own encoder, FAISS index and document store. Search-R1 runs a sync endpoint
  in FastAPI's thread pool, so GPU FAISS is searched from several threads at once (unsafe) and
  every request is encoded alone.
* ``POST /retrieve`` is answered straight from the ASGI entry point (:func:`emapg.server_input.serve_directly`):
  Starlette's router and FastAPI's dependency solving were half of a request's time on the event loop.
* Requests go into a queue; worker threads form micro-batches **across requests** (at most
  ``max_batch`` queries, the first one waiting at most ``max_wait_ms`` when traffic is concurrent
  and the worker was idle), so 64 clients sending one query each are encoded together. Whole
  requests are never split. On CPU there is one batch worker per encoder thread (a core), each
  taking its fair share of the queries in flight: while one worker's batch is encoded the other's
  clients receive their answers and send their next requests, so no core waits for HTTP. Closed-loop
  clients that split into more alternating groups than there are workers are merged back
  (``regroup_wait_ms``). A batch alone in the server is split over every encoder thread
  (:mod:`retriever.encoder`). With a GPU there is one worker (GPU FAISS is not thread-safe).
* In a closed loop the mean latency is clients / throughput (Little's law), so the tail at 32
  clients is shortened by throughput: larger batches, both cores encoding, no garbage-collector
  pauses over the model's objects. ``/metrics`` says where a request's time went (queue wait, the
  worker's encode/search/lookup time, the wait for company, the event loop's delivery lag).
* If a batch fails, each of its requests is retried alone, so only the request that causes the
  failure gets a 500; the worker survives every error.
* Validation returns 4xx with a message that says what to fix.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from emapg.config import ConfigError, option
from emapg.server_input import HTTPError, as_bool, as_int, as_text, check_fields, guarded, install_error_handlers, json_response, parse_json, read_body, serve_directly
from emapg.servers import ServerOptions, help_of

log = logging.getLogger("retriever.server")


@dataclass(kw_only=True)
class ServeConfig(ServerOptions):
    """Options of ``emapg serve`` (the command-line flags are generated from these fields)."""

    port: int = option(8000, help=help_of(ServerOptions, "port"))
    api_key_env: str = option("EMAPG_RETRIEVER_API_KEY", help=help_of(ServerOptions, "api_key_env"))
    max_body_bytes: int = option(4 << 20, help=help_of(ServerOptions, "max_body_bytes"))
    index: str = option(help="index directory built by `emapg index build`")
    topk: int = option(3, help="hits per query when a request gives no topk")
    max_topk: int = option(100, help="largest topk a request may ask for")
    max_batch: int = option(64, help="most queries encoded together across requests; 1 disables micro-batching")
    max_wait_ms: float = option(5.0, ge=0, help="how long the first query of a batch may wait for company when traffic is "
                                          "concurrent, in ms; a lone client never waits")  # fmt: skip
    regroup_wait_ms: float = option(5.0, ge=0, help="how long a batch worker, back from a batch with fewer than its share of the "
                                              "queries queued, may wait for the clients it just answered, in ms, so that "
                                              "alternating groups of clients merge into full batches; 0 disables")  # fmt: skip
    max_queries_per_request: int = option(4096, help="reject requests with more queries (Search-R1 sends a whole rollout "
                                                     "batch, e.g. 512 x 5, in one request)")  # fmt: skip
    max_query_chars: int = option(2000, help="reject queries longer than this many characters")
    device: str = option("auto", help="encoder device: auto, cpu, cuda (all GPUs) or cuda:N")
    fp16: bool | None = option(None, help="fp16 encoder and GPU index (default: on with GPU, off on CPU)")
    bf16: bool = option(False, help="bf16 query encoder: opt-in for CPUs with bf16 instructions (about 1.8x faster batches; "
                                    "fp32 is the CPU default)")  # fmt: skip
    gpu_shards: int = option(-1, help="GPUs for the FAISS index when the encoder is on GPU: -1 all, 0 keep the index on CPU, "
                                      "N the first N")  # fmt: skip
    gpu_replicate: bool = option(False, help="replicate the index on each GPU instead of sharding it (more memory, more throughput)")
    hybrid_bm25: bool = option(False, help="fuse dense and BM25 rankings by reciprocal-rank fusion (index built with --bm25)")
    rrf_k: int = option(60, help="RRF constant k in 1/(k + rank)")
    nprobe: int | None = option(None, help="IVF lists probed per query (default: the value in meta.json)")
    encode_batch_size: int = option(64, help="queries per encoder forward pass inside a batch")
    encode_threads: int = option(0, help="CPU encoder: forward passes run at once, each micro-batch split between them "
                                         "(each on OMP_NUM_THREADS torch threads); 0: CPU cores / torch threads")  # fmt: skip
    batch_workers: int = option(0, help="micro-batches run at once: 0 one per CPU encoder thread (--encode-threads; 1 with a GPU), "
                                        "1 one at a time, each split over the encoder threads")  # fmt: skip
    query_cache_size: int = option(4096, help="LRU of query embeddings: repeated queries (GRPO groups) skip the encoder; 0 disables")
    encoder: str | None = option(None, help="assert the index was built with this encoder; refuse to start otherwise")
    mmap: bool = option(False, help="memory-map the index's codes instead of reading them into RAM (FAISS IO_FLAG_MMAP_IFC): "
                                    "server processes on one machine share one copy in the page cache; on-disk IVF "
                                    "indexes (built with --ondisk) are always mapped")  # fmt: skip

    def validate(self) -> None:
        super().validate()
        for name in ("topk", "max_topk", "max_batch", "max_queries_per_request", "max_query_chars", "encode_batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if self.topk > self.max_topk:
            raise ConfigError(f"--topk {self.topk} exceeds --max-topk {self.max_topk}")
        if self.bf16 and self.fp16:
            raise ConfigError("--fp16 and --bf16 exclude each other")
        if self.query_cache_size < 0:
            raise ConfigError("--query-cache-size must be >= 0")
        if self.batch_workers < 0:
            raise ConfigError("--batch-workers must be >= 0 (0: one per CPU encoder thread)")
        if self.encode_threads < 0:
            raise ConfigError("--encode-threads must be >= 0 (0: CPU cores / torch threads)")


# ----------------------------------------------------------------------------- API schema (OpenAPI)


class RetrieveRequest(BaseModel):
    """Search-R1's request body (documentation: the body is checked by :func:`parse_retrieve_body`, which is
    at least as strict; e.g. a query must also hold a non-whitespace character and valid Unicode)."""

    model_config = ConfigDict(extra="forbid")

    queries: list[Annotated[str, Field(min_length=1)]] = Field(..., description="one or more non-empty query strings", min_length=1)
    topk: int | None = Field(None, description="hits per query (default: the server's --topk)", ge=1)
    return_scores: bool = Field(False, description="true: [[{document, score}]]; false: [[document]] (Search-R1 default)")


class Document(BaseModel):
    id: str
    contents: str = Field(..., description='"Title"\\ntext (Search-R1 / wiki-18 form)')


class ScoredHit(BaseModel):
    document: Document
    score: float


class RetrieveResponse(BaseModel):
    result: list[list[ScoredHit]] | list[list[Document]]


# ----------------------------------------------------------------------------- metrics

# Seconds. Finer between 50 and 250 ms, where a loaded CPU server's batches and requests sit: a p99
# target of 150 ms needs a bucket edge there.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, v: float) -> None:
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
        self.total += 1
        self.sum += v

    def render(self, name: str) -> list[str]:
        lines = [f'{name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        lines += [f'{name}_bucket{{le="+Inf"}} {self.total}', f"{name}_sum {self.sum:.6f}", f"{name}_count {self.total}"]
        return lines


class Metrics:
    """Prometheus text exposition (format 0.0.4), no extra dependency."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: collections.Counter[tuple[str, int]] = collections.Counter()
        self.errors: collections.Counter[str] = collections.Counter()
        self.queries = 0
        self.batches = 0
        self.batch_size = Histogram(BATCH_BUCKETS)
        self.batch_seconds = Histogram(LATENCY_BUCKETS)
        self.latency = Histogram(LATENCY_BUCKETS)
        self.queue_depth = 0
        # Where a request's time goes besides its own batch (the benchmark reports these per level):
        self.queue_wait = Histogram(LATENCY_BUCKETS)  # per request: submitted -> its batch starts
        self.gather_seconds = 0.0  # the worker waiting for company (max_wait), summed
        self.gather_timeouts = 0  # batches that started because that wait reached its bound, not its share
        self.delivery_lag = Histogram(LATENCY_BUCKETS)  # per batch: results ready -> the event loop hands them out

    def count(self, route: str, status: int, reason: str | None, seconds: float) -> None:
        """One answered request (``emapg.server_input.Count``); ``reason`` labels every refusal or failure."""
        with self.lock:
            self.requests[(route, status)] += 1
            if reason is not None:
                self.errors[reason] += 1
            if route == "/retrieve":
                self.latency.observe(seconds)

    def batch(self, n_queries: int, seconds: float) -> None:
        with self.lock:
            self.batches += 1
            self.queries += n_queries
            self.batch_size.observe(n_queries)
            self.batch_seconds.observe(seconds)

    def taken(self, queue_waits: list[float], gather_seconds: float, timed_out: bool = False) -> None:
        """A batch left the queue: how long each of its requests waited, and how long the worker waited for them."""
        with self.lock:
            for w in queue_waits:
                self.queue_wait.observe(w)
            self.gather_seconds += gather_seconds
            self.gather_timeouts += timed_out

    def delivered(self, lag: float) -> None:
        with self.lock:
            self.delivery_lag.observe(lag)

    def render(self) -> str:
        with self.lock:
            out = ["# HELP retriever_requests_total HTTP requests by path and status.", "# TYPE retriever_requests_total counter"]
            out += [f'retriever_requests_total{{path="{p}",status="{s}"}} {n}' for (p, s), n in sorted(self.requests.items())]
            out += ["# HELP retriever_queries_total Queries answered.", "# TYPE retriever_queries_total counter", f"retriever_queries_total {self.queries}"]
            out += ["# HELP retriever_batches_total Micro-batches run by the worker.", "# TYPE retriever_batches_total counter", f"retriever_batches_total {self.batches}"]
            out += ["# HELP retriever_errors_total Refused or failed requests by reason.", "# TYPE retriever_errors_total counter"]
            out += [f'retriever_errors_total{{kind="{k}"}} {n}' for k, n in sorted(self.errors.items())]
            out += ["# HELP retriever_batch_size Queries per micro-batch.", "# TYPE retriever_batch_size histogram"]
            out += self.batch_size.render("retriever_batch_size")
            out += ["# HELP retriever_batch_seconds Worker time per micro-batch (encode + search + lookup).", "# TYPE retriever_batch_seconds histogram"]
            out += self.batch_seconds.render("retriever_batch_seconds")
            out += ["# HELP retriever_request_latency_seconds /retrieve latency.", "# TYPE retriever_request_latency_seconds histogram"]
            out += self.latency.render("retriever_request_latency_seconds")
            out += ["# HELP retriever_queue_depth Queries waiting for the worker.", "# TYPE retriever_queue_depth gauge", f"retriever_queue_depth {self.queue_depth}"]
            out += ["# HELP retriever_queue_wait_seconds Per request: time from arrival until its micro-batch starts.", "# TYPE retriever_queue_wait_seconds histogram"]
            out += self.queue_wait.render("retriever_queue_wait_seconds")
            out += ["# HELP retriever_gather_wait_seconds_total Time the idle worker waited for concurrent requests (--max-wait-ms).",
                    "# TYPE retriever_gather_wait_seconds_total counter", f"retriever_gather_wait_seconds_total {self.gather_seconds:.6f}"]  # fmt: skip
            out += ["# HELP retriever_gather_timeouts_total Batches started because the wait for company (--max-wait-ms, --regroup-wait-ms) reached its bound.",
                    "# TYPE retriever_gather_timeouts_total counter", f"retriever_gather_timeouts_total {self.gather_timeouts}"]  # fmt: skip
            out += ["# HELP retriever_delivery_lag_seconds Per batch: results ready until the event loop hands them to their requests.",
                    "# TYPE retriever_delivery_lag_seconds histogram"]  # fmt: skip
            out += self.delivery_lag.render("retriever_delivery_lag_seconds")
            return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------- micro-batching


@dataclass
class _Job:
    queries: list[str]
    topk: int
    future: asyncio.Future
    submitted: float  # time.perf_counter() when the request joined the queue


@dataclass
class _WorkerState:
    """One batch worker: what its previous batch held, and whether it is running one now."""

    requests: int = 0
    queries: int = 0
    running: bool = False
    ended: float = 0.0  # time.monotonic() when it finished its last batch
    took_s: float = 0.0  # how long that batch took

    def answered_recently(self, now: float, max_wait_s: float) -> bool:
        """Whether the clients of its last batch may still be on their way back (closed loop): it
        ended within twice its duration plus the wait bound. Older answers are not awaited."""
        return not self.running and now - self.ended <= 2 * self.took_s + max_wait_s


class MicroBatcher:
    """Collects jobs from many requests into batches run by ``workers`` worker threads.

    ``process(queries, topk, encoder_share) -> list[list[dict]]`` runs in a worker thread, which forms its
    batches itself (a long-running task in ``executor``): when a batch is done it takes the next one
    from the queue at once and hands the finished results to the event loop in one callback. Handing
    each batch through the event loop instead cost ~6 ms per batch at 32 concurrent clients (the loop
    is busy answering the batch just finished, and the worker then waits for the GIL), 6% of the
    worker's time.

    With several workers (one per CPU core, each forward on one core) a worker waits for and takes
    at most its fair share of the queries in flight (:meth:`_share`), whole requests, at least one. Closed-loop clients then settle into staggered groups: one group's answers travel and its
    next requests are parsed while the other group's batch is encoded, so no core waits for HTTP.
    With one worker whose batches are split over both cores instead, every core idled while all the
    clients' round trips ran (10-13% of the worker's time at 32 clients, measured). A batch that
    leaves the queue empty while other workers are idle may use their share of the encoder too
    (``encoder_share``, a fraction of its threads), so one client's big request still gets every core.
    """

    def __init__(self, process, executor: ThreadPoolExecutor, max_batch: int, max_wait_s: float, metrics: Metrics,
                 regroup_wait_s: float = 0.0, workers: int = 1):  # fmt: skip
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.process = process
        self.executor = executor
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.regroup_wait_s = regroup_wait_s
        self.metrics = metrics
        self.workers = workers
        self.incoming: list[_Job] = []  # event loop only: submitted in this loop iteration
        self.pending: collections.deque[_Job] = collections.deque()  # published to the workers
        self.pending_queries = 0
        self.running_queries = 0  # in batches the workers are running
        self.idle_workers = 0  # workers waiting for work with nothing queued
        self.states: list[_WorkerState] = []  # one per worker thread
        self.cond = threading.Condition()  # guards pending, pending_queries, running_queries, idle_workers, states, stopping
        self.stopping = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.running: list[Future] = []

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.running = [self.executor.submit(self._work) for _ in range(self.workers)]
        for worker in self.running:
            worker.add_done_callback(self._worker_ended)

    def _worker_ended(self, worker: Future) -> None:
        if not worker.cancelled() and worker.exception() is not None:
            log.error("a retrieval worker stopped", exc_info=worker.exception())

    async def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
            jobs = [*self.pending, *self.incoming]
            self.pending.clear()
            self.incoming.clear()
            self.pending_queries = 0
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(RuntimeError("server is shutting down"))

    async def submit(self, queries: list[str], topk: int) -> list[list[dict]]:
        if all(worker.done() for worker in self.running):
            raise RuntimeError("the retrieval workers have stopped; see the server log")
        fut = self.loop.create_future()
        self.incoming.append(_Job(queries, topk, fut, time.perf_counter()))
        if len(self.incoming) == 1:
            self.loop.call_soon(self._publish)
        return await fut

    def _publish(self) -> None:
        """Hand what this event-loop iteration received to the workers at once (one lock, one wake-up),
        so requests parsed together can be batched together."""
        jobs, self.incoming = self.incoming, []
        with self.cond:
            self.pending.extend(jobs)
            self.pending_queries += sum(len(job.queries) for job in jobs)
            self.metrics.queue_depth = self.pending_queries
            self.cond.notify_all()

    # -- worker threads

    def _work(self) -> None:
        """Worker thread: take a batch, run it, deliver it, until :meth:`stop`."""
        me = _WorkerState()
        with self.cond:
            self.states.append(me)
        idle = True
        while True:
            with self.cond:
                while not self.pending and not self.stopping:
                    idle = True
                    self.idle_workers += 1
                    self.cond.wait()
                    self.idle_workers -= 1
                if self.stopping:
                    return
                t_wait = time.perf_counter()
                share = self._share(me, idle)
                timed_out = self._wait_for_company(me, share) if idle else self._wait_for_answered(share)
                t_take = time.perf_counter()
                jobs = self._take_batch(share if self.workers > 1 else self.max_batch)
                n_queries = sum(len(job.queries) for job in jobs)
                self.running_queries += n_queries
                me.running = bool(jobs)
                # the encoder's share this batch may use: its own, plus that of idle workers when nothing else is queued
                encoder_share = (1 if self.pending else 1 + self.idle_workers) / self.workers
                if self.pending:
                    self.cond.notify()  # more than this worker's share is queued: wake another
            if not jobs:
                continue
            t_run = time.monotonic()
            self.metrics.taken([t_take - job.submitted for job in jobs], t_take - t_wait, timed_out)
            idle = False
            me.requests, me.queries = len(jobs), n_queries
            try:
                results = self._run_batch(jobs, encoder_share)
            except Exception as e:  # noqa: BLE001 - a bug outside process(): fail these jobs, keep serving
                log.exception("micro-batch failed")
                results = [e] * len(jobs)
            finally:
                with self.cond:
                    self.running_queries -= n_queries
                    me.running = False
                    me.ended = time.monotonic()
                    me.took_s = me.ended - t_run
            try:
                self.loop.call_soon_threadsafe(self._deliver, jobs, results, time.perf_counter())
            except RuntimeError:  # the event loop is closed: the server is shutting down
                return

    def _share(self, me: _WorkerState, idle: bool) -> int:
        """Called holding ``cond``: the queries this worker waits for and takes at most (whole requests, one at least).

        Its fair part of the queries expected in flight (closed-loop clients come back when answered):
        those running in other workers' batches, plus, for a worker that was idle, the larger of those
        queued and those it answered last plus those other idle workers answered recently (a worker
        idle for long would otherwise keep counting clients another worker now serves), or, for a worker back from
        a batch that finds requests queued, those queued and those it just answered. With one worker:
        as many as its last batch held, or the queued ones plus those.
        """
        if idle:
            now = time.monotonic()
            returning = me.queries + sum(w.queries for w in self.states if w is not me and w.answered_recently(now, self.max_wait_s))
            expected = self.running_queries + max(self.pending_queries, returning)
        else:
            expected = self.pending_queries + self.running_queries + me.queries
        return min(self.max_batch, max(1, -(-expected // self.workers)))

    def _wait_for_company(self, me: _WorkerState, share: int) -> bool:
        """Called holding ``cond`` when work arrives at an idle worker: wait for more under concurrent traffic.

        A lone client (the last batch held one request) would pay max_wait on every request for nothing.
        Otherwise wait at most max_wait, and only until this worker's share is queued: with one
        worker, as many queries as its last batch held (closed-loop clients, e.g. rollout workers,
        have all come back). A worker back from a batch that finds requests queued does not wait for
        company: those have waited for a whole batch already; it only waits, briefly, for the clients
        it just answered (:meth:`_wait_for_answered`). True if the bound ended the wait.
        """
        if me.requests <= 1 or self.max_wait_s <= 0:
            return False
        return self._wait_until(share, self.max_wait_s)

    def _wait_for_answered(self, share: int) -> bool:
        """Called holding ``cond`` when a worker back from a batch finds requests queued: regroup alternating clients.

        Closed-loop clients settle into more groups than there are workers, taking turns: one group's
        next requests arrive while the other groups' batches run, so every request waits for another
        group's batch and then its own, and each batch is smaller than it could be (32 clients on one
        worker: two groups of 16; on two workers: three groups of ~11, measured). Smaller forwards
        cost more per query (batches of 11 on one core: 6.5 ms per query against 5.5 ms for 16,
        measured). Waiting briefly for the clients just answered merges the groups until each
        worker's batch holds its share, and :meth:`_wait_for_company` keeps them so. Bounded: at most
        ``regroup_wait``, only while fewer than that share are queued (a full batch goes at once).
        True if the bound ended the wait.
        """
        if self.regroup_wait_s <= 0:
            return False
        return self._wait_until(share, self.regroup_wait_s)

    def _wait_until(self, enough: int, max_wait_s: float) -> bool:
        """Called holding ``cond``: wait until ``enough`` queries are queued, at most ``max_wait_s``; True if the bound ended it."""
        deadline = time.monotonic() + max_wait_s
        while self.pending_queries < enough and not self.stopping:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return True
            self.cond.wait(remaining)
        return False

    def _take_batch(self, most: int) -> list[_Job]:
        """Called holding ``cond``: whole requests, oldest first, up to ``most`` queries (one request at least)."""
        jobs, n = [], 0
        while self.pending:
            job = self.pending[0]
            if jobs and n + len(job.queries) > most:
                break  # whole requests only; the rest waits for the next batch
            self.pending.popleft()
            self.pending_queries -= len(job.queries)
            if job.future.done():  # the client went away (a stale read is re-checked on delivery)
                continue
            jobs.append(job)
            n += len(job.queries)
        self.metrics.queue_depth = self.pending_queries
        return jobs

    def _run_batch(self, jobs: list[_Job], encoder_share: float = 1.0) -> list[Any]:
        """Worker thread: one encoder/FAISS call for all jobs, on ``encoder_share`` of the encoder's threads; on failure, each job alone."""
        queries = [q for job in jobs for q in job.queries]
        k = max(job.topk for job in jobs)
        t0 = time.perf_counter()
        try:
            hits = self.process(queries, k, encoder_share)
            self.metrics.batch(len(queries), time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - isolate below
            if len(jobs) == 1:
                log.exception("retrieval failed")
                return [e]
            log.warning("batch of %d requests failed (%s); retrying them one by one", len(jobs), e)
            return [self._run_batch([job], encoder_share)[0] for job in jobs]
        out, pos = [], 0
        for job in jobs:
            out.append([h[: job.topk] for h in hits[pos : pos + len(job.queries)]])
            pos += len(job.queries)
        return out

    # -- event loop

    def _deliver(self, jobs: list[_Job], results: list[Any], ready: float) -> None:
        self.metrics.delivered(time.perf_counter() - ready)
        for job, res in zip(jobs, results):
            if job.future.done():
                continue
            if isinstance(res, BaseException):
                job.future.set_exception(res)
            else:
                job.future.set_result(res)


def default_encode_threads() -> int:
    """``--encode-threads 0``: as many concurrent CPU forwards as fit the cores at torch's intra-op thread count."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, torch.get_num_threads()))


# ----------------------------------------------------------------------------- validation


ALLOWED_FIELDS = ("queries", "topk", "return_scores")
EXAMPLE = '{"queries": ["who wrote hamlet"], "topk": 3}'


def parse_retrieve_body(body: bytes, cfg: ServeConfig) -> tuple[list[str], int, bool]:
    """Check a /retrieve body (strict JSON, strict types); raise :class:`HTTPError` with a fix-it message."""
    data = parse_json(body, EXAMPLE)
    if not isinstance(data, dict):
        raise HTTPError(422, f"body must be a JSON object with a 'queries' list, got a JSON {type(data).__name__}")
    check_fields(data, "body", ALLOWED_FIELDS)
    if "queries" not in data:
        raise HTTPError(422, "missing field 'queries': a list of query strings")
    queries = data["queries"]
    if isinstance(queries, str):
        raise HTTPError(422, "'queries' must be a list of strings, got a single string; wrap it in a list")
    if not isinstance(queries, list):
        raise HTTPError(422, f"'queries' must be a list of strings, got {type(queries).__name__}")
    if not queries:
        raise HTTPError(422, "'queries' is empty: send at least one query")
    if len(queries) > cfg.max_queries_per_request:
        raise HTTPError(
            413, f"too many queries: {len(queries)} > {cfg.max_queries_per_request} per request; split them over several requests"
        )
    for i, q in enumerate(queries):
        as_text(q, f"queries[{i}]", max_chars=cfg.max_query_chars)
    topk = data.get("topk")
    topk = cfg.topk if topk is None else as_int(topk, "'topk'", 1, cfg.max_topk)
    return_scores = as_bool(data.get("return_scores", False), "'return_scores'")
    return queries, topk, return_scores


def parse_search_body(body: bytes, cfg: ServeConfig, dim: int):
    """Check a /search body; the query vectors as float32 ``[B, dim]``, topk and ``documents`` (default true;
    false: answer row numbers and scores only) (HTTPError with a message otherwise)."""
    import base64
    import binascii

    import numpy as np

    data = parse_json(body, '{"vectors_b64": "...", "dim": 384, "topk": 3}')
    if not isinstance(data, dict):
        raise HTTPError(422, "body must be a JSON object with 'vectors_b64', 'dim' and 'topk'")
    check_fields(data, "body", ("vectors_b64", "dim", "topk", "documents"), required=("vectors_b64", "dim"))
    if as_int(data["dim"], "'dim'", 1, 1 << 16) != dim:
        raise HTTPError(422, f"'dim' is {data['dim']}, this index holds {dim}-d vectors")
    try:
        raw = base64.b64decode(as_text(data["vectors_b64"], "'vectors_b64'", max_chars=cfg.max_body_bytes), validate=True)
    except (binascii.Error, ValueError):
        raise HTTPError(422, "'vectors_b64' is not valid base64") from None
    if not raw or len(raw) % (4 * dim):
        raise HTTPError(422, f"'vectors_b64' must hold a whole number of {dim}-d float32 vectors ({len(raw)} bytes)")
    q = np.frombuffer(raw, dtype="<f4").reshape(-1, dim)
    if len(q) > cfg.max_queries_per_request:
        raise HTTPError(413, f"too many vectors: {len(q)} > {cfg.max_queries_per_request} per request")
    if not np.isfinite(q).all():
        raise HTTPError(422, "'vectors_b64' holds a NaN or an infinity")
    topk = data.get("topk")
    documents = as_bool(data.get("documents", True), "'documents'")
    return q, cfg.topk if topk is None else as_int(topk, "'topk'", 1, cfg.max_topk), documents


def format_result(hits: list[list[dict]], return_scores: bool) -> dict:
    """Search-R1 response shapes: [[{document, score}]] or [[document]]."""
    if return_scores:
        return {"result": [[{"document": {"id": h["id"], "contents": h["contents"]}, "score": h["score"]} for h in q] for q in hits]}
    return {"result": [[{"id": h["id"], "contents": h["contents"]} for h in q] for q in hits]}


# ----------------------------------------------------------------------------- app


class _State:
    def __init__(self) -> None:
        self.status = "loading"
        self.error: str | None = None
        self.searcher = None
        self.batcher: MicroBatcher | None = None
        self.executor: ThreadPoolExecutor | None = None


def create_app(cfg: ServeConfig, on_fatal=None) -> FastAPI:
    """Build the app. The index loads in the worker thread after startup; /health says when it is ready."""
    cfg.validate()
    metrics = Metrics()
    state = _State()

    def load():
        from retriever.searcher import Searcher

        return Searcher(
            cfg.index,
            device=cfg.device,
            fp16=cfg.fp16,
            bf16=cfg.bf16,
            gpu_shards=cfg.gpu_shards,
            gpu_replicate=cfg.gpu_replicate,
            hybrid_bm25=cfg.hybrid_bm25,
            rrf_k=cfg.rrf_k,
            nprobe=cfg.nprobe,
            encode_batch_size=cfg.encode_batch_size,
            query_cache_size=cfg.query_cache_size,
            encode_threads=cfg.encode_threads or default_encode_threads(),
            mmap=cfg.mmap,
        )

    async def load_in_worker():
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            state.searcher = await loop.run_in_executor(state.executor, load)
        except Exception as e:  # noqa: BLE001 - reported through /health and the exit code
            state.status, state.error = "failed", f"{type(e).__name__}: {e}"
            log.error("loading the index failed: %s", state.error)
            if on_fatal is not None:
                on_fatal(state.error)
            return
        # The model, tokenizer and libraries are ~485k tracked objects: a full collection would traverse
        # them all (0.5-0.9 s measured on the loaded 2-core box, holding the GIL: a latency spike for every
        # request in flight). They live as long as the server, so they move to the permanent generation
        # (no collection first: after a load it finds ~20 unreachable objects and would block the loop).
        gc.freeze()
        workers = min(cfg.batch_workers or state.searcher.concurrent_batches, state.searcher.concurrent_batches)
        if cfg.batch_workers > workers:
            log.warning("--batch-workers %d: %d batch workers (one per encoder thread%s)", cfg.batch_workers, workers,
                        "" if state.searcher.encoder.devices[0] == "cpu" else "; one with a GPU")  # fmt: skip
        state.batcher = MicroBatcher(state.searcher.retrieve, state.executor, cfg.max_batch, cfg.max_wait_ms / 1000, metrics,
                                     cfg.regroup_wait_ms / 1000, workers=workers)  # fmt: skip
        state.batcher.start()
        state.status = "ok"
        log.info("index loaded in %.1f s: %s", time.perf_counter() - t0, state.searcher.info())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # the loader, then the batch workers, at most one per encoder thread (threads start as needed)
        state.executor = ThreadPoolExecutor(max_workers=max(os.cpu_count() or 1, cfg.encode_threads), thread_name_prefix="retriever-worker")
        loader = asyncio.get_running_loop().create_task(load_in_worker())
        try:
            yield
        finally:
            loader.cancel()
            if state.batcher is not None:
                await state.batcher.stop()
            state.executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(
        title="ema-pg retriever",
        version="1",
        description="Search-R1 compatible dense/BM25 retrieval with cross-request micro-batching.",
        lifespan=lifespan,
    )
    app.state.retriever = state
    app.state.metrics = metrics
    api_key = cfg.api_key_value()
    install_error_handlers(app, metrics.count)
    endpoint = guarded(api_key, metrics.count, log)

    @app.post(
        "/retrieve",
        response_model=RetrieveResponse,
        openapi_extra={"requestBody": {"required": True, "content": {"application/json": {"schema": RetrieveRequest.model_json_schema()}}}},
        responses={400: {"description": "not JSON"}, 401: {"description": "API key"}, 408: {"description": "body too slow"},
                   413: {"description": "too large"}, 422: {"description": "invalid field"}, 503: {"description": "still loading"}},
    )  # fmt: skip
    @endpoint
    async def retrieve(request: Request):
        """Top-k passages for each query (Search-R1 request/response format)."""
        body = await read_body(request, cfg.max_body_bytes, timeout_s=cfg.body_timeout, hint="; send fewer or shorter queries")
        queries, topk, return_scores = parse_retrieve_body(body, cfg)
        if state.status != "ok":
            raise HTTPError(503, f"index is {state.status}{': ' + state.error if state.error else ''}; retry when GET /health returns 200")
        try:
            hits = await state.batcher.submit(queries, topk)
        except Exception as e:  # noqa: BLE001 - this request only (its batch mates were re-run without it)
            raise HTTPError(500, f"retrieval failed: {type(e).__name__}: {e}", "retrieval") from None
        return json_response(format_result(hits, return_scores))

    serve_directly(app, "POST", "/retrieve", retrieve)

    @app.post("/search", responses={401: {"description": "API key"}, 413: {"description": "too large"},
                                    422: {"description": "invalid field"}, 503: {"description": "still loading"}})  # fmt: skip
    @endpoint
    async def search(request: Request):
        """Top-k passages for query vectors the caller encoded with this index's encoder (the router does:
        ``retriever.router``): ``{"vectors_b64": base64 of float32 [B, dim] little-endian, "dim", "topk"}``;
        the answer has /retrieve's scored shape; with ``"documents": false``, ``{"rows": [[row, ...]], "scores":
        [[score, ...]]}`` instead: this index's row numbers, best first, no passages (the router's ``--docs``)."""
        body = await read_body(request, cfg.max_body_bytes, timeout_s=cfg.body_timeout, hint="; send fewer vectors")
        if state.status != "ok":
            raise HTTPError(503, f"index is {state.status}{': ' + state.error if state.error else ''}; retry when GET /health returns 200")
        q, topk, documents = parse_search_body(body, cfg, state.searcher.meta["dim"])
        # the loop's default thread pool: the server's own executor is taken by the long-running batch workers
        if not documents:
            rows, scores = await asyncio.to_thread(state.searcher.search_rows, q, topk)
            found = rows >= 0
            return json_response({"rows": [r[f].tolist() for r, f in zip(rows, found)], "scores": [s[f].tolist() for s, f in zip(scores, found)]})
        hits = await asyncio.to_thread(state.searcher.search_vectors, q, topk)
        return json_response(format_result(hits, True))

    serve_directly(app, "POST", "/search", search)

    @app.get("/health")
    @guarded(api_key, metrics.count, log, open_=True)
    async def health(request: Request):
        """200 with index info once the index is loaded; 503 while loading or after a failed load."""
        if state.status == "ok":
            info = state.searcher.info()
            info.update(batch_workers=state.batcher.workers, max_batch=cfg.max_batch, max_wait_ms=cfg.max_wait_ms, regroup_wait_ms=cfg.regroup_wait_ms, topk=cfg.topk, max_topk=cfg.max_topk)
            return {"status": "ok", "index": info, "fingerprint": state.searcher.fingerprint}
        body = {"status": state.status}
        if state.error:
            body["error"] = state.error
        return JSONResponse(body, status_code=503)

    @app.get("/metrics", response_class=PlainTextResponse)
    @endpoint
    async def metrics_endpoint(request: Request):
        """Prometheus text format: requests by route and status, errors by reason, queries, batch sizes, latency."""
        text = metrics.render()
        if state.searcher is not None:
            text += (
                "# HELP retriever_query_cache_hits_total Queries answered without encoding (LRU of query embeddings).\n"
                "# TYPE retriever_query_cache_hits_total counter\n"
                f"retriever_query_cache_hits_total {state.searcher.cache_hits}\n"
                "# HELP retriever_stage_seconds_total Worker time by stage of a micro-batch (encode, search, lookup).\n"
                "# TYPE retriever_stage_seconds_total counter\n"
            )
            text += "".join(f'retriever_stage_seconds_total{{stage="{k}"}} {v:.6f}\n' for k, v in sorted(state.searcher.stage_seconds.items()))
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app


def serve(cfg: ServeConfig) -> int:
    """Run the server until interrupted. Returns the process exit code."""
    from emapg.servers import run_uvicorn
    from retriever.searcher import check_encoder

    cfg.validate()
    meta = check_encoder(cfg.index, cfg.encoder)  # refuse before binding the port
    if cfg.hybrid_bm25 and not meta.get("bm25"):
        raise ValueError(f"--hybrid-bm25 needs a BM25 index: rebuild {cfg.index} with `emapg index build --bm25`")
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)  # its CPU-feature probing is noise
    banner = f"serving {cfg.index} on http://{cfg.host}:{cfg.port} (max batch {cfg.max_batch}, max wait {cfg.max_wait_ms:.1f} ms)"
    return run_uvicorn(create_app, cfg, log=log, exposes="query the index", banner=banner)
