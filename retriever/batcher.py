"""Cross-request micro-batching: many requests' queries encoded and searched together.

Used by the retriever server (:mod:`retriever.server`, over the searcher) and the router
(:mod:`retriever.router`, over the query encoder). Design:

* Requests go into a queue; worker threads form micro-batches **across requests** (at most
  ``max_batch`` queries, the first one waiting at most ``max_wait_ms`` when traffic is concurrent
  and the worker was idle), so 64 clients sending one query each are encoded together. Whole
  requests are never split. On CPU there is one batch worker per encoder thread (a core), each
  taking its fair share of the queries in flight: while one worker's batch is encoded the other's
  clients receive their answers and send their next requests, so no core waits for HTTP. Closed-loop
  clients that split into more alternating groups than there are workers are merged back
  (``regroup_wait_ms``). A batch alone in the server is split over every encoder thread
  (:mod:`retriever.encoder`). With a GPU there is one worker (GPU FAISS is not thread-safe).
* If a batch fails, each of its requests is retried alone, so only the request that causes the
  failure gets a 500; the worker survives every error.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from retriever.metrics import Metrics

__all__ = ["MicroBatcher"]

log = logging.getLogger("retriever.batcher")


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

