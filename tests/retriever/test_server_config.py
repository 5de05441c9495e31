"""Start-up checks, API keys, the loading phase, batch-failure isolation and the launcher's errors."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from app.cli import main as emapg_main
from emapg.paths import REPO_ROOT
from retriever.batcher import MicroBatcher
from retriever.client import RetrievalError, RetrieverClient
from retriever.launch import RetrieverServer, ServerStartError, emapg_command, free_port
from retriever.metrics import Metrics
from retriever.searcher import EncoderMismatchError, check_encoder, rrf_fuse, same_encoder



def _wait_loaded(client, seconds: float = 300.0) -> float:
    """Poll ``/health`` of a TestClient until the index has stopped loading (loaded or failed); fail with the last
    answer if it still loads after ``seconds`` (generous: a loaded 2-core machine can take minutes). Returns the
    deadline, for later waits of the same test."""
    deadline = time.monotonic() + seconds
    while (health := client.get("/health").json())["status"] == "loading":
        assert time.monotonic() < deadline, f"the index still loads after {seconds:.0f} s: {health}"
        time.sleep(0.05)
    return deadline

def test_encoder_mismatch_is_refused_with_a_clear_error(retriever_index, capsys):
    with pytest.raises(EncoderMismatchError, match="built with encoder 'minilm'"):
        check_encoder(retriever_index.index_dir, "intfloat/e5-base-v2")
    assert check_encoder(retriever_index.index_dir, "sentence-transformers/all-MiniLM-L6-v2")["rows"] == retriever_index.rows
    assert same_encoder("MiniLM", "minilm")
    code = emapg_main(["serve", "--index", str(retriever_index.index_dir), "--port", str(free_port()), "--encoder", "intfloat/e5-base-v2"])
    assert code == 2
    err = capsys.readouterr().err
    assert "built with encoder 'minilm'" in err and "--encoder 'intfloat/e5-base-v2'" in err


def test_serve_refuses_bad_setups_before_binding(retriever_index, tmp_path, capsys):
    port = str(free_port())
    cases = [
        (["--index", str(tmp_path)], "not an index directory"),
        (["--index", str(retriever_index.index_dir), "--hybrid-bm25"], "needs a BM25 index"),
        (["--index", str(retriever_index.index_dir), "--topk", "200"], "exceeds --max-topk"),
        (["--index", str(retriever_index.index_dir), "--max-batch", "0"], "--max-batch must be at least 1"),
        (["--index", str(retriever_index.index_dir), "--encode-threads", "-1"], "--encode-threads must be >= 0"),
        (["--index", str(retriever_index.index_dir), "--regroup-wait-ms", "-1"], "--regroup-wait-ms: expected a finite number >= 0, got -1.0"),
    ]
    for args, message in cases:
        assert emapg_main(["serve", *args, "--port", port]) == 2
        assert message in capsys.readouterr().err


def test_api_key_and_health_while_loading(retriever_index):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "EMAPG_RETRIEVER_API_KEY": "s3cret"}
    proc = subprocess.Popen(
        [*emapg_command(), "serve", "--index", str(retriever_index.index_dir), "--port", str(port), "--device", "cpu"],
        env=env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    seen = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                r = httpx.get(url + "/health", timeout=2)
            except httpx.TransportError:
                time.sleep(0.02)
                continue
            seen.append(r.status_code)
            if r.status_code == 503:
                assert r.json() == {"status": "loading"}
                early = httpx.post(url + "/retrieve", json={"queries": ["x"]}, headers={"X-API-Key": "s3cret"})
                assert early.status_code in (503, 200)  # 200 if loading finished in between
            if r.status_code == 200:
                break
            time.sleep(0.02)
        assert seen and seen[-1] == 200 and 503 in seen, seen
        body = {"queries": ["who got the first nobel prize in physics"]}
        assert httpx.post(url + "/retrieve", json=body).status_code == 401
        wrong = httpx.post(url + "/retrieve", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and "API key" in wrong.json()["detail"]
        assert httpx.post(url + "/retrieve", json=body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert httpx.post(url + "/retrieve", json=body, headers={"X-API-Key": "s3cret"}).status_code == 200
        assert httpx.get(url + "/metrics").status_code == 401
        assert httpx.get(url + "/metrics", headers={"X-API-Key": "s3cret"}).status_code == 200
        with RetrieverClient(url, api_key="s3cret") as client:
            assert len(client.retrieve(["x", "y"], topk=2)) == 2
        with RetrieverClient(url, retries=3) as client, pytest.raises(RetrievalError, match="HTTP 401"):
            client.retrieve(["x"])
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(30)


def test_launcher_reports_the_servers_error(tmp_path):
    with pytest.raises(ServerStartError, match=r"exited with code 2(.|\n)*not an index directory"):
        RetrieverServer(tmp_path, startup_timeout=60).start()


def test_launch_returns_before_the_server_is_healthy_and_wait_healthy_waits(retriever_index, tmp_path):
    """launch() gives the URL at once (clients can start meanwhile); wait_healthy() returns once /health
    answers, and reports a server that exits instead, with its log's tail."""
    server = RetrieverServer(retriever_index.index_dir, omp_num_threads=1, device="cpu", log_path=tmp_path / "ok.log")
    try:
        server.launch()
        url = server.url  # known before the server answers (its start-up takes seconds: imports, the index)
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=1)
        server.wait_healthy()
        assert httpx.get(url + "/health", timeout=10).status_code == 200
    finally:
        server.stop()
    failing = RetrieverServer(tmp_path, startup_timeout=60, log_path=tmp_path / "bad.log").launch()
    with pytest.raises(ServerStartError, match=r"exited with code 2(.|\n)*not an index directory"):
        failing.wait_healthy()


def test_a_failing_request_does_not_fail_its_batch_mates():
    """Real batcher and worker thread; the process function fails on one query, as a bad input would."""
    calls: list[list[str]] = []

    def process(queries: list[str], topk: int, encoder_share: float) -> list[list[dict]]:
        calls.append(list(queries))
        if "boom" in queries:
            raise RuntimeError("encoder blew up")
        return [[{"id": q, "contents": q, "score": float(i)} for i in range(topk)] for q in queries]

    async def scenario():
        executor = ThreadPoolExecutor(1)
        batcher = MicroBatcher(process, executor, max_batch=8, max_wait_s=0.05, metrics=Metrics())
        batcher.start()
        results = await asyncio.gather(
            batcher.submit(["a1", "a2"], 2), batcher.submit(["boom"], 1), batcher.submit(["b"], 3), return_exceptions=True
        )
        after = await batcher.submit(["c"], 1)  # the worker survived
        await batcher.stop()
        executor.shutdown()
        return results, after

    (a, boom, b), after = asyncio.run(scenario())
    assert calls[0] == ["a1", "a2", "boom", "b"]  # batched across requests first
    assert [[h["id"] for h in hh] for hh in a] == [["a1", "a1"], ["a2", "a2"]]
    assert isinstance(boom, RuntimeError) and "blew up" in str(boom)
    assert [len(hh) for hh in b] == [3]
    assert after[0][0]["id"] == "c"


def test_micro_batches_respect_max_batch_and_never_split_a_request():
    sizes: list[int] = []

    def process(queries, topk, encoder_share):
        sizes.append(len(queries))
        return [[{"id": q, "contents": q, "score": 0.0}] for q in queries]

    async def scenario():
        executor = ThreadPoolExecutor(1)
        batcher = MicroBatcher(process, executor, max_batch=4, max_wait_s=0.05, metrics=Metrics())
        batcher.start()
        reqs = [[f"r{i}q{j}" for j in range(n)] for i, n in enumerate([3, 2, 1, 6, 1])]
        out = await asyncio.gather(*(batcher.submit(r, 1) for r in reqs))
        await batcher.stop()
        executor.shutdown()
        return reqs, out

    reqs, out = asyncio.run(scenario())
    assert [[hh[0]["id"] for hh in o] for o in out] == reqs
    assert sizes == [3, 3, 6, 1]  # [3] [2,1] [6] alone (bigger than max_batch, not split) [1]


def test_rrf_fusion_exact():
    dense = np.array([3, 1, 2, -1])
    sparse = np.array([2, 3, 7])
    idx, scores = rrf_fuse([dense, sparse], k=3, rrf_k=60)
    expected = {3: 1 / 61 + 1 / 62, 2: 1 / 63 + 1 / 61, 1: 1 / 62, 7: 1 / 63}
    best = sorted(expected, key=lambda d: -expected[d])[:3]
    assert idx.tolist() == best
    np.testing.assert_allclose(scores, [expected[d] for d in best], rtol=1e-6)


def test_index_info_cli(retriever_index, capsys):
    assert emapg_main(["index", "info", str(retriever_index.index_dir)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["rows"] == retriever_index.rows and info["encoder"]["name"] == "minilm"


def test_a_broken_index_fails_health_and_stops_the_server(retriever_index, tmp_path):
    """The index loads after the port is bound: a failure must show in /health and end the process."""
    import shutil

    from fastapi.testclient import TestClient

    from retriever.server import ServeConfig, create_app

    broken = tmp_path / "broken"
    shutil.copytree(retriever_index.index_dir, broken)
    (broken / "index.faiss").write_bytes(b"not a faiss index")
    fatal: list[str] = []
    app = create_app(ServeConfig(index=str(broken), device="cpu"), on_fatal=fatal.append)
    with TestClient(app) as client:
        _wait_loaded(client)
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert "is not a readable FAISS index" in health.json()["error"]
        r = client.post("/retrieve", json={"queries": ["x"]})
        assert r.status_code == 503 and "failed" in r.json()["detail"]
    assert len(fatal) == 1 and fatal[0] == health.json()["error"]


def test_query_cache_skips_the_encoder_and_changes_nothing(retriever_index):
    from retriever.searcher import Searcher

    questions = [q["question"] for q in retriever_index.questions[:8]]
    plain = Searcher(retriever_index.index_dir, device="cpu")
    cached = Searcher(retriever_index.index_dir, device="cpu", query_cache_size=5)
    batch = questions[:3] + questions[:2]  # duplicates inside one batch are encoded once
    first = cached.retrieve(batch, 3)
    assert cached.cache_hits == 2 and len(cached._query_cache) == 3
    again = cached.retrieve(questions[:3], 3)
    assert cached.cache_hits == 5
    cached.retrieve(questions[3:8], 3)  # five new queries evict the three oldest
    assert list(cached._query_cache) == questions[3:8]
    for got, want in ((first, plain.retrieve(batch, 3)), (again, plain.retrieve(questions[:3], 3))):
        assert [[h["id"] for h in hh] for hh in got] == [[h["id"] for h in hh] for hh in want]
        np.testing.assert_allclose([[h["score"] for h in hh] for hh in got], [[h["score"] for h in hh] for hh in want], atol=1e-5)


def test_every_batch_worker_runs_with_more_encoder_threads_than_cores(retriever_index):
    """--encode-threads above the core count: one batch worker per encoder thread, every one running
    (a pool sized by cores alone would leave some queued forever while the share rule counts them)."""
    import os

    from fastapi.testclient import TestClient

    from retriever.server import ServeConfig, create_app

    threads = (os.cpu_count() or 1) + 1
    app = create_app(ServeConfig(index=str(retriever_index.index_dir), device="cpu", encode_threads=threads, query_cache_size=0))
    with TestClient(app) as client:
        deadline = _wait_loaded(client)
        assert client.get("/health").json()["index"]["batch_workers"] == threads
        batcher = app.state.retriever.batcher
        while len(batcher.states) < threads and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(batcher.states) == threads and not any(f.done() for f in batcher.running)
        questions = [q["question"] for q in retriever_index.questions[:4]]
        r = client.post("/retrieve", json={"queries": questions, "topk": 2})
        assert r.status_code == 200 and [len(hits) for hits in r.json()["result"]] == [2] * 4


def test_health_and_the_startup_line_say_which_encoder_dtype_runs_and_why(retriever_index, caplog):
    """bf16 by default where the CPU has native bf16 (the suite's AVX2 cap says it has not), --no-bf16 forces fp32."""
    import logging

    from fastapi.testclient import TestClient

    from retriever.encoder import resolve_precision
    from retriever.server import ServeConfig, create_app

    cases = (({}, resolve_precision(False), "automatic"), ({"bf16": False}, "float32", "as given"), ({"bf16": True}, "bfloat16", "as given"))
    for flags, dtype, reason in cases:
        caplog.clear()
        app = create_app(ServeConfig(index=str(retriever_index.index_dir), device="cpu", encode_threads=1, **flags))
        with caplog.at_level(logging.INFO, logger="retriever.server"), TestClient(app) as client:
            _wait_loaded(client)
            index = client.get("/health").json()["index"]
            assert index["dtype"] == dtype and reason in index["dtype_reason"], (flags, index)
        assert any(f"in {dtype} (" in r.getMessage() and reason in r.getMessage() for r in caplog.records), (flags, caplog.text)


def test_batch_invariant_server_answers_a_query_alone_as_in_any_batch(retriever_index):
    """--batch-invariant: a query's passages and scores are bit-identical asked alone or among others (the encoder
    runs it alone and FAISS searches it alone: a batch would take the BLAS path and round scores otherwise)."""
    from fastapi.testclient import TestClient

    from retriever.server import ServeConfig, create_app

    questions = [q["question"] for q in retriever_index.questions[:12]]
    app = create_app(ServeConfig(index=str(retriever_index.index_dir), device="cpu", encode_threads=2, bf16=True,
                                 query_cache_size=0, batch_invariant=True))  # fmt: skip
    with TestClient(app) as client:
        _wait_loaded(client)
        index = client.get("/health").json()["index"]
        assert index["batch_invariant"] is True and index["dtype"] == "bfloat16"
        ask = lambda qs: client.post("/retrieve", json={"queries": qs, "topk": 3, "return_scores": True}).json()["result"]  # noqa: E731
        alone = [ask([q])[0] for q in questions]
        together = ask(questions[::-1])[::-1]
        pairs = lambda result: [[(h["document"]["id"], h["score"]) for h in hits] for hits in result]  # noqa: E731
        assert pairs(together) == pairs(alone)
