"""Micro-batching policy and batch invariance: the real batcher and worker thread, the real encoder and index.

The policy tests block the worker on events instead of timing it: a worker that waited when it
should not would hang until ``max_wait`` (a minute here), so they fail by timing out, not by a clock.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from retriever.batcher import MicroBatcher
from retriever.metrics import Metrics

NEVER_S = 60.0  # a max_wait no test may sit through
DONE_S = 20.0  # generous bound for work that takes milliseconds


class Worker:
    """A ``process`` function that records its batches and can hold the worker inside a batch."""

    def __init__(self):
        self.batches: list[list[str]] = []
        self.shares: list[float] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def __call__(self, queries: list[str], topk: int, encoder_share: float) -> list[list[dict]]:
        self.batches.append(list(queries))
        self.shares.append(encoder_share)
        self.entered.set()
        self.release.wait(DONE_S)
        return [[{"id": q, "contents": q, "score": 0.0}] for q in queries]


async def _with_batcher(process, max_wait_s: float, scenario, regroup_wait_s: float = 0.0, workers: int = 1):
    executor = ThreadPoolExecutor(workers)
    batcher = MicroBatcher(process, executor, max_batch=8, max_wait_s=max_wait_s, metrics=Metrics(), regroup_wait_s=regroup_wait_s, workers=workers)
    batcher.start()
    try:
        return await asyncio.wait_for(scenario(batcher), DONE_S)
    finally:
        await batcher.stop()
        executor.shutdown()


def test_a_busy_worker_takes_what_queued_meanwhile_without_waiting():
    """Regrouping off: after a batch of two requests, one request that arrived meanwhile goes at once
    (waiting for company, as an idle worker would, could only wait for clients just answered)."""
    worker = Worker()

    async def scenario(batcher):
        worker.release.clear()
        first = [asyncio.ensure_future(batcher.submit([q], 1)) for q in ("a1", "a2")]
        await asyncio.to_thread(worker.entered.wait, DONE_S)  # the worker is inside batch [a1, a2]
        later = asyncio.ensure_future(batcher.submit(["b"], 1))
        await asyncio.sleep(0.05)  # let the event loop queue it
        worker.release.set()
        return await asyncio.gather(*first, later)

    out = asyncio.run(_with_batcher(worker, NEVER_S, scenario))
    assert [o[0][0]["id"] for o in out] == ["a1", "a2", "b"]
    assert worker.batches == [["a1", "a2"], ["b"]]


def _hold_a_batch_while(worker: Worker, batcher: MicroBatcher, first: list[list[str]], meanwhile: list[list[str]]):
    """Submit ``first`` (one batch: the worker is held inside it), then ``meanwhile``, then release the worker."""

    async def run():
        worker.release.clear()
        held = [asyncio.ensure_future(batcher.submit(q, 1)) for q in first]
        await asyncio.to_thread(worker.entered.wait, DONE_S)
        queued = [asyncio.ensure_future(batcher.submit(q, 1)) for q in meanwhile]
        await asyncio.sleep(0.05)  # let the event loop queue them
        worker.release.set()
        return held, queued

    return run()


def test_regrouping_never_delays_a_full_batch():
    """max_batch (8) queries queued while the worker is busy: they go at once (nobody comes back here,
    so a wait would last the minute's bound and time the test out)."""
    worker = Worker()

    async def scenario(batcher):
        held, queued = await _hold_a_batch_while(worker, batcher, [["a1"], ["a2"]], [[f"b{i}"] for i in range(8)])
        return await asyncio.gather(*held, *queued)

    asyncio.run(_with_batcher(worker, NEVER_S, scenario, regroup_wait_s=NEVER_S))
    assert worker.batches == [["a1", "a2"], [f"b{i}" for i in range(8)]]


def test_regrouping_ends_at_its_bound_when_nobody_comes_back():
    """A short bound: b is answered although a1 and a2 never return (with no bound it would hang)."""
    worker = Worker()

    async def scenario(batcher):
        held, queued = await _hold_a_batch_while(worker, batcher, [["a1"], ["a2"]], [["b"]])
        return await asyncio.gather(*held, *queued)

    out = asyncio.run(_with_batcher(worker, NEVER_S, scenario, regroup_wait_s=0.05))
    assert out[2][0][0]["id"] == "b" and worker.batches == [["a1", "a2"], ["b"]]


def test_an_idle_worker_waits_for_as_many_as_last_time_under_concurrent_traffic():
    worker = Worker()

    async def scenario(batcher):
        await asyncio.gather(batcher.submit(["a1"], 1), batcher.submit(["a2"], 1))  # concurrent: one batch of two
        # let the worker go idle: on a loaded machine it may not have looked at the queue again yet, and a
        # worker that finds "b1" there on its way back from a batch is busy, not idle (the first test)
        await asyncio.sleep(0.2)
        first = asyncio.ensure_future(batcher.submit(["b1"], 1))
        await asyncio.sleep(0.2)  # the idle worker now waits for company (max_wait is a minute)
        second = asyncio.ensure_future(batcher.submit(["b2"], 1))
        return await asyncio.gather(first, second)

    asyncio.run(_with_batcher(worker, NEVER_S, scenario))
    assert worker.batches == [["a1", "a2"], ["b1", "b2"]]


def test_a_lone_client_never_waits():
    worker = Worker()

    async def scenario(batcher):
        return [await batcher.submit([q], 1) for q in ("a", "b", "c")]  # one request at a time

    out = asyncio.run(_with_batcher(worker, NEVER_S, scenario))
    assert [o[0][0]["id"] for o in out] == ["a", "b", "c"] and worker.batches == [["a"], ["b"], ["c"]]


def test_stop_fails_queued_requests_and_the_worker_thread_ends():
    worker = Worker()

    async def scenario():
        executor = ThreadPoolExecutor(1)
        batcher = MicroBatcher(worker, executor, max_batch=1, max_wait_s=0.0, metrics=Metrics())
        batcher.start()
        worker.release.clear()
        running = asyncio.ensure_future(batcher.submit(["a"], 1))
        await asyncio.to_thread(worker.entered.wait, DONE_S)
        queued = asyncio.ensure_future(batcher.submit(["b"], 1))  # max_batch 1: waits behind "a"
        await asyncio.sleep(0.05)
        await batcher.stop()
        worker.release.set()
        results = await asyncio.gather(running, queued, return_exceptions=True)
        await asyncio.to_thread(batcher.running[0].result, DONE_S)  # the thread returned
        executor.shutdown()
        return results

    running, queued = asyncio.run(scenario())
    assert running[0][0]["id"] == "a"  # the batch in progress still answers
    assert isinstance(queued, RuntimeError) and "shutting down" in str(queued)


class Workers:
    """A ``process`` function for several worker threads: each batch blocks until released by its first query."""

    def __init__(self):
        self.lock = threading.Lock()
        self.batches: list[tuple[list[str], float]] = []
        self.entered: dict[str, threading.Event] = collections.defaultdict(threading.Event)
        self.release: dict[str, threading.Event] = collections.defaultdict(threading.Event)

    def __call__(self, queries: list[str], topk: int, encoder_share: float) -> list[list[dict]]:
        with self.lock:
            self.batches.append((list(queries), encoder_share))
            entered, release = self.entered[queries[0]], self.release[queries[0]]
        entered.set()
        release.wait(DONE_S)
        return [[{"id": q, "contents": q, "score": 0.0}] for q in queries]

    def free(self, *firsts: str) -> None:
        for q in firsts:
            self.release[q].set()


def _submit_together(batcher: MicroBatcher, requests: list[list[str]]) -> list[asyncio.Future]:
    """Requests parsed in one event-loop iteration (published to the workers at once)."""
    return [asyncio.ensure_future(batcher.submit(r, 1)) for r in requests]


def test_two_workers_split_what_arrives_together_into_fair_shares():
    """4 single queries at once, 2 idle workers: each takes its share, 2 (one worker alone would take all 4)."""
    work = Workers()

    async def scenario(batcher):
        futures = _submit_together(batcher, [[f"q{i}"] for i in range(4)])
        await asyncio.to_thread(work.entered["q0"].wait, DONE_S)  # both batches in flight at once
        await asyncio.to_thread(work.entered["q2"].wait, DONE_S)
        work.free("q0", "q2")
        return await asyncio.gather(*futures)

    out = asyncio.run(_with_batcher(work, 0.0, scenario, workers=2))
    assert [o[0][0]["id"] for o in out] == ["q0", "q1", "q2", "q3"]
    assert sorted(b for b, _ in work.batches) == [["q0", "q1"], ["q2", "q3"]]
    assert all(share == 0.5 for _, share in work.batches)  # the other half was queued: one encoder thread each


def test_a_free_worker_takes_queued_requests_while_the_other_runs_a_batch():
    """Worker A is held inside [a]; b and c arrive: worker B answers them without waiting for A."""
    work = Workers()
    work.free("b")

    async def scenario(batcher):
        (held,) = _submit_together(batcher, [["a"]])
        await asyncio.to_thread(work.entered["a"].wait, DONE_S)
        later = _submit_together(batcher, [["b"], ["c"]])
        answered = await asyncio.gather(*later)  # A is still inside [a]
        work.free("a")
        return answered, await held

    answered, held = asyncio.run(_with_batcher(work, 0.0, scenario, workers=2))
    assert [o[0][0]["id"] for o in answered] == ["b", "c"] and held[0][0]["id"] == "a"
    # b and c: at most the share of the 3 queries in flight over 2 workers each (2), whole requests
    assert [b for b, _ in work.batches] == [["a"], ["b", "c"]]


def test_a_lone_big_request_gets_the_whole_encoder():
    """Nothing else queued and the other worker idle: the batch is split over every encoder thread."""
    work = Workers()
    work.free("r0")

    async def scenario(batcher):
        await asyncio.sleep(0.2)  # both workers idle
        return await batcher.submit([f"r{i}" for i in range(16)], 1)

    out = asyncio.run(_with_batcher(work, 0.0, scenario, workers=2))
    assert len(out) == 16 and work.batches == [([f"r{i}" for i in range(16)], 1.0)]


def test_regrouping_with_two_workers_fills_a_workers_share():
    """Three groups of one request take turns on two workers; a worker back from [a] that finds [c]
    queued waits (bounded by a minute) for the client it just answered, so [c, a2] go together."""
    work = Workers()
    work.free("c")

    async def scenario(batcher):
        first = _submit_together(batcher, [["a"], ["b"]])  # one each
        await asyncio.to_thread(work.entered["a"].wait, DONE_S)
        await asyncio.to_thread(work.entered["b"].wait, DONE_S)
        (third,) = _submit_together(batcher, [["c"]])
        await asyncio.sleep(0.05)
        work.free("a")
        a = await first[0]  # the worker back from [a] finds [c] and waits for its client
        (again,) = _submit_together(batcher, [["a2"]])
        out = await asyncio.gather(third, again)
        work.free("b")
        return a, out, await first[1]

    a, (c, a2), b = asyncio.run(_with_batcher(work, 0.0, scenario, regroup_wait_s=NEVER_S, workers=2))
    assert (a[0][0]["id"], c[0][0]["id"], a2[0][0]["id"], b[0][0]["id"]) == ("a", "c", "a2", "b")
    assert sorted(bb for bb, _ in work.batches) == [["a"], ["b"], ["c", "a2"]]


def test_searcher_answers_concurrent_batches_as_sequential_ones(retriever_index):
    """Two worker threads on one Searcher (query cache on, with repeats): the same hits as one at a time."""
    from retriever.searcher import Searcher

    questions = [q["question"] for q in retriever_index.questions[:40]]
    batches = [questions[i : i + 10] + questions[:3] for i in range(0, 40, 10)]  # repeats across batches hit the cache
    reference = [Searcher(retriever_index.index_dir, device="cpu", query_cache_size=0).retrieve(b, 3) for b in batches]
    searcher = Searcher(retriever_index.index_dir, device="cpu", encode_threads=2, query_cache_size=16)
    assert searcher.concurrent_batches == 2
    with ThreadPoolExecutor(2) as pool:
        for _ in range(3):
            together = list(pool.map(lambda b: searcher.retrieve(b, 3, 0.5), batches))
            assert [[[h["id"] for h in hh] for hh in r] for r in together] == [[[h["id"] for h in hh] for hh in r] for r in reference]
    assert searcher.cache_hits > 0


@pytest.mark.parametrize("encode_threads", [1, 3])
def test_batched_retrieval_equals_one_query_at_a_time(retriever_index, encode_threads):
    """Packed batches of mixed lengths: every query's hits and scores as when it is encoded alone; with
    several encode threads each batch is split into parts encoded at once (3: parts of unequal size)."""
    from retriever.searcher import Searcher

    questions = [q["question"] for q in retriever_index.questions[:48]] + ["a", "what " * 40]
    searcher = Searcher(retriever_index.index_dir, device="cpu", encode_threads=encode_threads)
    assert searcher.encoder.packed and searcher.encoder.parallel == encode_threads
    together = searcher.retrieve(questions, 5)
    alone = [searcher.retrieve([q], 5)[0] for q in questions]
    assert [[h["id"] for h in hh] for hh in together] == [[h["id"] for h in hh] for hh in alone]
    np.testing.assert_allclose([[h["score"] for h in hh] for hh in together], [[h["score"] for h in hh] for hh in alone], atol=1e-5)


@pytest.mark.parametrize(
    "workers, idle, me, others, running, pending, share",
    [
        (1, True, 16, [], 0, 3, 16),  # one worker back from idle: as many as its last batch
        (1, False, 10, [], 0, 5, 15),  # back from a batch with 5 queued: those and its own 10
        (1, True, 80, [], 0, 1, 64),  # never more than max_batch
        (2, True, 16, [("running", 16)], 16, 4, 16),  # staggered: half of the 32 in flight
        (2, True, 16, [("recent", 16)], 0, 8, 16),  # both just answered 16: half of the 32 coming back
        (2, True, 32, [("stale", 32)], 0, 8, 16),  # an idle-for-long worker's old clients are not awaited
        (2, False, 11, [("running", 11)], 11, 11, 17),  # three groups of 11 on two workers: regroup to 17
        (2, True, 0, [("stale", 0)], 0, 1, 1),  # first request ever: at least one
    ],
)
def test_a_workers_share_of_the_queries_in_flight(workers, idle, me, others, running, pending, share):
    """The rule by which a worker waits for and takes its part (MicroBatcher._share), case by case."""
    import time

    from retriever.batcher import _WorkerState

    batcher = MicroBatcher(Worker(), ThreadPoolExecutor(1), max_batch=64, max_wait_s=0.005, metrics=Metrics(), workers=workers)
    now = time.monotonic()
    mine = _WorkerState(requests=me, queries=me, ended=now, took_s=0.09)
    batcher.states = [mine] + [
        _WorkerState(requests=q, queries=q, running=kind == "running", ended=now - (10.0 if kind == "stale" else 0.01), took_s=0.09)
        for kind, q in others
    ]
    batcher.running_queries, batcher.pending_queries = running, pending
    with batcher.cond:
        assert batcher._share(mine, idle) == share
