"""The router over real shard servers on real ports: exactly one Flat index's answers; a missing shard
gives a flagged partial answer, never a 5xx."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from retriever.client import RetrieverClient
from retriever.launch import RetrieverServer, RouterServer
from retriever.sharding import ShardConfig, shard_index

pytestmark = pytest.mark.slow  # three real servers and a router per test (~20-30 s each on 2 cores)


@pytest.fixture(scope="module")
def shard_dirs(retriever_index, tmp_path_factory):
    return shard_index(ShardConfig(index=str(retriever_index.index_dir), out=str(tmp_path_factory.mktemp("shards")), shards=2, align=1),
                       log=lambda m: None)  # fmt: skip


@pytest.fixture(scope="module")
def shard_servers(shard_dirs):
    servers = [RetrieverServer(d, omp_num_threads=1, device="cpu", extra_args=["--query-cache-size", "0"]) for d in shard_dirs]
    try:
        for s in servers:
            s.start()
        yield servers
    finally:
        for s in servers:
            s.stop()


def _post(url: str, queries: list[str], topk: int) -> httpx.Response:
    return httpx.post(url + "/retrieve", json={"queries": queries, "topk": topk, "return_scores": True}, timeout=60)


@pytest.mark.parametrize("mode", ["encode", "encode-docs", "no-encode"], ids=["router-encodes", "router-reads-passages", "shards-encode"])
def test_sharded_flat_equals_one_flat_index(retriever_index, retriever_server, shard_servers, mode):
    questions = [q["question"] for q in retriever_index.questions[:40]]
    args = {"encode": [], "encode-docs": ["--docs", str(retriever_index.index_dir)], "no-encode": ["--no-encode"]}[mode]
    with RouterServer([[s.url] for s in shard_servers], extra_args=args) as router:
        health = httpx.get(router.url + "/health").json()
        assert health["status"] == "ok" and [s["shard"]["index"] for s in health["shards"]] == [0, 1]
        assert health["passages"] == ("router" if mode == "encode-docs" else "shards")
        assert health["source_fingerprint"] is not None
        for topk in (1, 5):
            for i in range(0, len(questions), 8):  # same requests, one at a time: same query batches everywhere
                one = _post(retriever_server.url, questions[i : i + 8], topk).json()
                sharded = _post(router.url, questions[i : i + 8], topk).json()
                assert "partial" not in sharded
                # ids, order and contents exactly; scores within float32 rounding: this 399-row index is smaller than
                # FAISS's 1024-row BLAS block, so its shards cannot be aligned to it (the benchmark checks bit-identity
                # on 43k rows with aligned shards)
                for a, b in zip(sharded["result"], one["result"]):
                    assert [h["document"] for h in a] == [h["document"] for h in b]
                    assert [h["score"] for h in a] == pytest.approx([h["score"] for h in b], rel=1e-6, abs=1e-6)
        metrics = httpx.get(router.url + "/metrics").text
        assert 'router_shard_latency_seconds_count{shard="0"}' in metrics and 'router_shard_latency_seconds_count{shard="1"}' in metrics
        assert "router_fanout_round_trip_seconds" in metrics
        if mode != "no-encode":  # the batch workers wait for the clients they answered: 5 ms plus the fan-out's round trip
            wait = float(metrics.split("\nrouter_regroup_wait_seconds ")[1].split()[0])
            rtt = float(metrics.split("\nrouter_fanout_round_trip_seconds ")[1].split()[0])
            assert wait == pytest.approx(0.005 + min(rtt, 0.05), abs=2e-6)
        with RetrieverClient(router.url) as client:  # what training and evaluation use
            hits = client.retrieve(questions[:8], topk=3)
        assert [[h["id"] for h in q] for q in hits] == [[h["document"]["id"] for h in q[:3]] for q in _post(retriever_server.url, questions[:8], 3).json()["result"]]


def test_requests_ready_together_are_one_request_per_shard_and_each_gets_its_own_answer(retriever_index, retriever_server, shard_servers):
    import asyncio

    from retriever.router import Router, RouterConfig
    from retriever.metrics import Metrics

    questions = [q["question"] for q in retriever_index.questions[:12]]
    topks = [1 + i % 4 for i in range(len(questions))]
    # the reference: one request of all of them at the largest topk, cut per question (the same query batch as the joined fan-out)
    whole = _post(retriever_server.url, questions, max(topks)).json()["result"]

    async def main():
        router = Router(RouterConfig(shard=[s.url for s in shard_servers], encode=False), Metrics())
        await router.start()
        try:
            await router.check_health()
            answers = await asyncio.gather(*(router.retrieve([q], k) for q, k in zip(questions, topks)))
        finally:
            await router.close()
        return router, answers

    router, answers = asyncio.run(main())
    assert (router.fanouts, router.fanout_queries) == (1, len(questions))  # ready in one loop iteration: joined
    for (hits, partial), ref, k in zip(answers, whole, topks):
        assert partial is None and len(hits[0]) == k
        assert [h["document"] for h in hits[0]] == [h["document"] for h in ref[:k]]
        assert [h["score"] for h in hits[0]] == pytest.approx([h["score"] for h in ref[:k]], rel=1e-6, abs=1e-6)


def test_a_shard_down_or_slow_gives_a_flagged_partial_answer_never_a_5xx(retriever_index, shard_servers):
    q = [retriever_index.questions[0]["question"]]
    with RouterServer([[s.url] for s in shard_servers], deadline_ms=1500, health_interval_s=0.3) as router:
        full = _post(router.url, q, 5).json()["result"][0]
        slow = shard_servers[1].proc.pid
        os.kill(slow, signal.SIGSTOP)  # slow: alive but not answering
        try:
            t0 = time.monotonic()
            r = _post(router.url, q, 5)
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["partial"]["missing_shards"] == [1] and r.headers["x-emapg-partial"] == "missing=1"
            assert time.monotonic() - t0 < 5
            shard0 = [h for h in full if h["document"]["id"] in {x["document"]["id"] for x in body["result"][0]}]
            assert body["result"][0] == [h for h in full if h in shard0] + body["result"][0][len(shard0):]
            deadline = time.monotonic() + 30
            while httpx.get(router.url + "/health").json()["status"] != "degraded":  # the health check marks it down
                assert time.monotonic() < deadline
                time.sleep(0.2)
            r = _post(router.url, q, 5)  # then the shard is skipped, not waited for until the deadline: still flagged
            assert r.status_code == 200 and r.json()["partial"] == {"missing_shards": [1], "reasons": {"1": "no healthy replica"}}
        finally:
            os.kill(slow, signal.SIGCONT)
        deadline, partials = time.monotonic() + 20, 2
        while "partial" in _post(router.url, q, 5).json():  # back in rotation after a passing health check
            partials += 1
            assert time.monotonic() < deadline
            time.sleep(0.3)
        assert _post(router.url, q, 5).json()["result"][0] == full
        metrics = httpx.get(router.url + "/metrics").text
        assert f"router_partial_responses_total {partials}\n" in metrics


def test_docs_of_another_index_are_refused_with_both_fingerprints(retriever_index, shard_servers, shard_dirs):
    import asyncio

    from retriever.router import Router, RouterConfig
    from retriever.server import Metrics

    async def opened(docs: str) -> Router:
        router = Router(RouterConfig(shard=[s.url for s in shard_servers], docs=docs), Metrics())
        await router.start()
        try:
            await router.check_health()
            router.open_docs()  # what the router does once its encoder is loaded (a failure: /health 503 "failed")
        finally:
            await router.close()
        return router

    assert len(asyncio.run(opened(str(retriever_index.index_dir))).docs) == retriever_index.rows
    with pytest.raises(ValueError, match="is not the index shard 0 was split from"):
        asyncio.run(opened(str(shard_dirs[0])))  # a shard is not its source


def test_every_shard_down_is_a_retryable_503_with_the_reason(retriever_index):
    from emapg.servers import free_port

    dead = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    router = RouterServer([[u] for u in dead])
    router.startup_timeout = 5
    with pytest.raises(Exception):  # /health is 503 while no shard is up: the launcher refuses
        router.start()
    router.stop()


def test_shard_search_endpoint_checks_its_vectors(shard_servers):
    import base64

    import numpy as np

    url = shard_servers[0].url + "/search"
    good = base64.b64encode(np.ones((2, 384), dtype="<f4").tobytes()).decode()
    r = httpx.post(url, json={"vectors_b64": good, "dim": 384, "topk": 2}, timeout=30)
    assert r.status_code == 200 and [len(q) for q in r.json()["result"]] == [2, 2]
    bare = httpx.post(url, json={"vectors_b64": good, "dim": 384, "topk": 2, "documents": False}, timeout=30).json()
    assert set(bare) == {"rows", "scores"} and bare["scores"] == [[h["score"] for h in q] for q in r.json()["result"]]
    assert all(isinstance(i, int) and i >= 0 for q in bare["rows"] for i in q) and [len(q) for q in bare["rows"]] == [2, 2]
    for body, needle in (({"vectors_b64": good, "dim": 768}, "384-d"), ({"vectors_b64": "!!", "dim": 384}, "base64"),
                         ({"vectors_b64": good[:-8], "dim": 384}, "whole number"), ({"dim": 384}, "missing"),
                         ({"vectors_b64": good, "dim": 384, "documents": "no"}, "'documents'"),
                         ({"vectors_b64": base64.b64encode(np.full(384, np.nan, "<f4").tobytes()).decode(), "dim": 384}, "NaN")):  # fmt: skip
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 422 and needle in r.text, (body.keys(), r.text)


def test_the_regroup_wait_follows_the_fanout_round_trip_within_its_bound():
    """--encode: a batch worker waits for the clients it just answered for regroup_wait_ms plus the moving average
    of the fan-out round trip (weight 0.2 for the newest), the fan-out's part at most 50 ms; off: regroup_wait_ms."""
    from concurrent.futures import ThreadPoolExecutor

    from retriever.batcher import MicroBatcher
    from retriever.metrics import Metrics
    from retriever.router import Router, RouterConfig

    def router(follows: bool) -> Router:
        r = Router(RouterConfig(shard=["http://127.0.0.1:9"], regroup_wait_ms=5.0, regroup_follows_fanout=follows), Metrics())
        r.batcher = MicroBatcher(lambda q, k, s: [], ThreadPoolExecutor(1), 64, 0.005, Metrics(), 0.005, workers=2)
        return r

    r = router(True)
    r._fanout_answered(0.020)
    assert (r.fanout_rtt_s, r.batcher.regroup_wait_s) == pytest.approx((0.020, 0.025))
    r._fanout_answered(0.040)  # 0.020 + 0.2 * (0.040 - 0.020)
    assert (r.fanout_rtt_s, r.batcher.regroup_wait_s) == pytest.approx((0.024, 0.029))
    for _ in range(40):
        r._fanout_answered(2.0)  # a slow shard: the wait is bounded
    assert r.fanout_rtt_s > 1.9 and r.batcher.regroup_wait_s == pytest.approx(0.055)
    assert "router_regroup_wait_seconds 0.055000" in r.render_metrics()
    fixed = router(False)
    fixed._fanout_answered(0.030)
    assert (fixed.fanout_rtt_s, fixed.batcher.regroup_wait_s) == pytest.approx((0.030, 0.005))


def test_router_batch_invariant_encodes_each_query_alone(retriever_index, shard_servers):
    """--batch-invariant on the router: its encoder runs each query alone (/health says so), and a question's
    passages are the same asked alone or among others."""
    questions = [q["question"] for q in retriever_index.questions[:12]]
    with RouterServer([[s.url] for s in shard_servers], extra_args=["--batch-invariant"]) as router:
        health = httpx.get(router.url + "/health").json()
        assert health["encoder"] == "router" and health["encoder_batch_invariant"] is True
        alone = [_post(router.url, [q], 3).json()["result"][0] for q in questions]
        together = _post(router.url, questions[::-1], 3).json()["result"][::-1]
        assert [[h["document"] for h in hits] for hits in together] == [[h["document"] for h in hits] for hits in alone]
    with RouterServer([[s.url] for s in shard_servers]) as router:  # the default batches
        assert httpx.get(router.url + "/health").json()["encoder_batch_invariant"] is False
