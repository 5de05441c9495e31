"""Micro-batching policy and batch invariance: the real batcher and worker thread, the real encoder and index.

The policy tests block the worker on events instead of timing it: a worker that waited when it
should not would hang until ``max_wait`` (a minute here), so they fail by timing out, not by a clock.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from retriever.server import Metrics, MicroBatcher

NEVER_S = 60.0  # a max_wait no test may sit through
DONE_S = 20.0  # generous bound for work that takes milliseconds


class Worker:
    """A ``process`` function that records its batches and can hold the worker inside a batch."""

    def __init__(self):
        self.batches: list[list[str]] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def __call__(self, queries: list[str], topk: int) -> list[list[dict]]:
        self.batches.append(list(queries))
        self.entered.set()
        self.release.wait(DONE_S)
        return [[{"id": q, "contents": q, "score": 0.0}] for q in queries]


async def _with_batcher(worker: Worker, max_wait_s: float, scenario, regroup_wait_s: float = 0.0):
    executor = ThreadPoolExecutor(1)
    batcher = MicroBatcher(worker, executor, max_batch=8, max_wait_s=max_wait_s, metrics=Metrics(), regroup_wait_s=regroup_wait_s)
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
        await asyncio.to_thread(batcher.worker.result, DONE_S)  # the thread returned
        executor.shutdown()
        return results

    running, queued = asyncio.run(scenario())
    assert running[0][0]["id"] == "a"  # the batch in progress still answers
    assert isinstance(queued, RuntimeError) and "shutting down" in str(queued)


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
