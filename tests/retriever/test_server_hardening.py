"""Hostile input against the real retrieval server: every kind is a 4xx with a message, counted in /metrics
by reason, and the kept-alive connection it came on keeps serving; bodies that stall or stop are bounded;
API keys come from a file; a non-loopback bind without a key refuses to start.

Real ``emapg serve`` processes over the real MiniLM + FAISS test index, real sockets.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import threading
import time

import httpx
import pytest

from app.cli import main as emapg_main
from emapg.config import config_from_args
from retriever.launch import RetrieverServer, free_port
from tests.fixtures.http_checks import hold_many_open, local_port, metric, raw_exchange, strict_json

GOOD = {"queries": ["who got the first nobel prize in physics"], "topk": 2}

# (raw body, status, message regex, /metrics reason). The first five answered 500 before (issue 18).
HOSTILE = [
    (b'{"queries": ["\\ud800"], "topk": 3}', 422, r"queries\[0\] is not valid Unicode: a lone surrogate", "invalid_field"),
    (b'{"queries": ["ok \\udc00 x"]}', 422, r"lone surrogate .* at character 3", "invalid_field"),
    (b'{"queries": ["a \\ud83d b"]}', 422, "lone surrogate", "invalid_field"),
    (b'{"queries": ["x"], "topk": 1' + b"0" * 5000 + b"}", 422, "5001 digits is out of range", "invalid_number"),
    (b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply", "too_deep"),
    (b'{"a": ' * 50_000 + b"1" + b"}" * 50_000, 400, "nested too deeply", "too_deep"),
    (b'{"queries": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "nested too deeply", "too_deep"),
    (b'{"queries": ["x"], "topk": 1e400}', 422, "overflows a 64-bit float", "invalid_number"),
    (b'{"queries": ["x"], "topk": NaN}', 400, "NaN is not a JSON number", "invalid_json"),
    (b'{"queries": ["x"], "topk": -Infinity}', 400, "-Infinity is not a JSON number", "invalid_json"),
    (b'{"queries": ["x"], "queries": ["y"]}', 400, "appears twice", "duplicate_key"),
    (b'{"queries": ["x"], "topk": 18446744073709551616}', 422, "between 1 and 100", "invalid_field"),
    (b'{"queries": ["x"], "topk": 3.0}', 422, "'topk' must be an integer", "invalid_field"),
    (b'{"queries": ["x"], "return_scores": 1}', 422, "'return_scores' must be true or false", "invalid_field"),
    (b'{"\\ud800": 1, "queries": ["x"]}', 422, "unknown field", "invalid_field"),
    ('\ufeff{"queries": ["x"]}'.encode(), 400, "not valid JSON", "invalid_json"),
    ('{"queries": ["x"]}'.encode("utf-16"), 400, "not UTF-8", "invalid_json"),
    (b'{"queries": ["\xc0\xaf"]}', 400, "not UTF-8", "invalid_json"),
    (b'{"queries": ["x"]} trailing', 400, "not valid JSON", "invalid_json"),
    (b"3", 422, "JSON object", "invalid_field"),
    (b"null", 422, "JSON object", "invalid_field"),
    (b'{"queries": 7}', 422, "list of strings", "invalid_field"),
]


def _retrieve(http: httpx.Client, body: bytes) -> httpx.Response:
    return http.post("/retrieve", content=body, headers={"content-type": "application/json"})


def test_contract_a_lone_surrogate_query_is_a_4xx(retriever_server):
    r = httpx.post(retriever_server.url + "/retrieve", content=b'{"queries": ["\\ud800"], "topk": 3}',
                   headers={"content-type": "application/json"}, timeout=60)  # fmt: skip
    assert 400 <= r.status_code < 500, r.text


@pytest.mark.parametrize("body,status,message,reason", HOSTILE, ids=[f"{i}-{h[3]}" for i, h in enumerate(HOSTILE)])
def test_hostile_body_is_a_counted_4xx_and_the_connection_keeps_serving(retriever_server, body, status, message, reason):
    before = httpx.get(retriever_server.url + "/metrics").text
    with httpx.Client(base_url=retriever_server.url, timeout=60, limits=httpx.Limits(max_connections=1)) as http:
        bad = _retrieve(http, body)
        bad_port = local_port(bad)
        good = http.post("/retrieve", json=GOOD)
        good_port = local_port(good)
    assert bad.status_code == status, bad.text
    assert re.search(message, strict_json(bad.text)["detail"]), bad.text
    assert bad.headers.get("connection", "").lower() != "close"
    assert good.status_code == 200 and len(good.json()["result"][0]) == 2
    assert bad_port == good_port  # the same kept-alive connection served both
    after = httpx.get(retriever_server.url + "/metrics").text
    assert metric(after, "retriever_errors_total", kind=reason) == metric(before, "retriever_errors_total", kind=reason) + 1
    counted = {"path": "/retrieve", "status": str(status)}
    assert metric(after, "retriever_requests_total", **counted) == metric(before, "retriever_requests_total", **counted) + 1


def test_answers_are_strict_json_with_unicode_intact(retriever_server):
    r = httpx.post(retriever_server.url + "/retrieve", json={"queries": ["Émile Zola 北京 😀"], "return_scores": True}, timeout=60)
    assert r.status_code == 200
    hits = strict_json(r.text)["result"][0]
    assert len(hits) == 3 and all(isinstance(h["score"], float) for h in hits)


@pytest.fixture(scope="module")
def keyed_server(retriever_index, tmp_path_factory):
    """A server whose key comes from a file, with a 2 s body timeout and a 2 s header timeout."""
    folder = tmp_path_factory.mktemp("keyed")
    key_file = folder / "key"
    key_file.write_text("file-key-42\n")
    key_file.chmod(0o600)
    server = RetrieverServer(retriever_index.index_dir, extra_args=["--api-key-file", str(key_file), "--body-timeout", "2",
                                                                    "--header-timeout", "2"],
                             log_path=folder / "server.log", env={k: v for k, v in os.environ.items() if k != "EMAPG_RETRIEVER_API_KEY"})
    with server:
        yield server


KEY_HEADERS = {"X-API-Key": "file-key-42"}


def test_api_key_from_a_file_guards_everything_but_health_and_schema(keyed_server):
    url = keyed_server.url
    assert httpx.post(url + "/retrieve", json=GOOD, timeout=60).status_code == 401
    assert httpx.post(url + "/retrieve", json=GOOD, headers={"Authorization": "Bearer file-key-42"}, timeout=60).status_code == 200
    assert httpx.get(url + "/metrics").status_code == 401
    metrics = httpx.get(url + "/metrics", headers=KEY_HEADERS).text
    assert metric(metrics, "retriever_errors_total", kind="unauthorized") == 2
    assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/openapi.json").status_code == 200


def test_a_body_shorter_than_its_content_length_gets_408_and_the_connection_closes(keyed_server):
    """Before: such a request held its connection open with no timeout (1,000 of them for 90 s)."""
    answers: list = [None] * 20

    def stall(i: int) -> None:
        answers[i] = raw_exchange(keyed_server.url, "/retrieve", b'{"queries": ["x"', declared_length=500, headers=KEY_HEADERS, wait_s=30)

    threads = [threading.Thread(target=stall, args=(i,)) for i in range(len(answers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for a in answers:
        assert a.status == 408 and a.closed, a
        assert "did not arrive within 2 s" in strict_json(a.body)["detail"]
    metrics = httpx.get(keyed_server.url + "/metrics", headers=KEY_HEADERS).text
    assert metric(metrics, "retriever_errors_total", kind="body_timeout") == 20
    assert httpx.post(keyed_server.url + "/retrieve", json=GOOD, headers=KEY_HEADERS, timeout=60).status_code == 200


def test_headers_that_never_finish_get_408_and_the_connection_closes(keyed_server):
    """Before: a connection that sent half its headers was still open after 230 s; 32 of them were held for 80 s.
    Now each is closed 2 s (--header-timeout) after it opened, however slowly its bytes trickle in."""
    head = b"POST /retrieve HTTP/1.1\r\nHost: 127.0.0.1\r\nX-API-Key: file-key-42\r\n"
    answers = hold_many_open(keyed_server.url, head, 20)  # odd: headers trickled byte by byte; even: never a byte
    for i, a in enumerate(answers):
        assert a.closed and 1.8 <= a.seconds < 20, (i, a)
        if i % 2:
            assert a.status == 408 and "did not arrive within 2 s" in strict_json(a.body)["detail"], a
        else:
            assert a.status is None and a.head == b"", a
    assert httpx.post(keyed_server.url + "/retrieve", json=GOOD, headers=KEY_HEADERS, timeout=60).status_code == 200


# (extra headers, body, status, message, /metrics reason, whether Host is sent)
PROTOCOL = [
    ({"Content-Encoding": "gzip"}, gzip.compress(json.dumps(GOOD).encode()), 415,
     'Content-Encoding "gzip" is not supported: send the body uncompressed', "content_encoding", True),
    ({"Content-Encoding": "br"}, json.dumps(GOOD).encode(), 415, 'Content-Encoding "br" is not supported', "content_encoding", True),
    ({"Content-Encoding": "identity, gzip"}, json.dumps(GOOD).encode(), 415, '"gzip" is not supported', "content_encoding", True),
    ({}, json.dumps(GOOD).encode(), 400, "an HTTP/1.1 request needs a Host header", "missing_host", False),
]


@pytest.mark.parametrize("headers,body,status,message,reason,host", PROTOCOL, ids=[p[4] + str(i) for i, p in enumerate(PROTOCOL)])
def test_protocol_refusals_are_counted_and_close_the_connection(retriever_server, headers, body, status, message, reason, host):
    """Before: a gzip body was answered "not UTF-8", a br label was ignored, a request without Host was served."""
    before = httpx.get(retriever_server.url + "/metrics").text
    a = raw_exchange(retriever_server.url, "/retrieve", body, headers=headers, host=host, wait_s=30)
    assert a.status == status and message in strict_json(a.body)["detail"], a
    assert b"connection: close" in a.head.lower() and a.closed, a
    after = httpx.get(retriever_server.url + "/metrics").text
    assert metric(after, "retriever_errors_total", kind=reason) == metric(before, "retriever_errors_total", kind=reason) + 1
    ok = raw_exchange(retriever_server.url, "/retrieve", json.dumps(GOOD).encode(), headers={"Content-Encoding": "identity"})
    assert ok.status == 200 and not ok.closed


def test_a_declared_oversize_body_gets_413_and_the_connection_closes_at_once(retriever_server):
    """Before: the 413 left the connection open until the body timeout (60 s), waiting for a body nobody reads."""
    a = raw_exchange(retriever_server.url, "/retrieve", b'{"queries": ["x"', declared_length=10**9, wait_s=30)
    assert a.status == 413 and "exceeds the limit of 4194304 bytes" in strict_json(a.body)["detail"], a
    assert b"connection: close" in a.head.lower() and a.closed and a.seconds < 20, a


def test_a_client_that_disconnects_mid_body_is_one_log_line(keyed_server):
    """Before: a 53-line traceback per disconnect."""
    for _ in range(3):
        raw_exchange(keyed_server.url, "/retrieve", b'{"queries": ["x', declared_length=1000, headers=KEY_HEADERS, hang_up=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        log = keyed_server.log_path.read_text(errors="replace")
        if log.count("client disconnected") >= 3:
            break
        time.sleep(0.1)
    lines = [line for line in log.splitlines() if "client disconnected" in line]
    assert len(lines) == 3, log[-3000:]
    assert "Traceback" not in log and "Exception in ASGI application" not in log
    assert httpx.post(keyed_server.url + "/retrieve", json=GOOD, headers=KEY_HEADERS, timeout=60).status_code == 200


def test_key_sources_and_refusals_before_binding(retriever_index, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("EMAPG_RETRIEVER_API_KEY", raising=False)
    (tmp_path / "empty").write_text("\n")
    index, port = str(retriever_index.index_dir), str(free_port())
    cases = [
        (["--host", "0.0.0.0"], "refusing to serve 0.0.0.0 without an API key"),
        (["--host", "10.1.2.3"], "pass --insecure if that is intended"),
        (["--api-key-file", str(tmp_path / "missing")], "cannot read it"),
        (["--api-key-file", str(tmp_path / "empty")], "must hold the key on one line"),
        (["--api-key-file", str(tmp_path / "missing"), "--api-key", "k"], "give the API key once"),
        (["--body-timeout", "0"], "--body-timeout: expected a finite number > 0, got 0.0"),
    ]
    for args, message in cases:
        assert emapg_main(["serve", "--index", index, "--port", port, *args]) == 2, args
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (args, err)
    with pytest.raises(SystemExit):
        emapg_main(["serve", "--index", index, "--topk", "true"])
    assert "invalid int value" in capsys.readouterr().err


def test_every_documented_flag_keeps_its_name(tmp_path):
    """README, docker/, docker-compose.yml and the launchers use these spellings."""
    from retriever.cli import index_parser, serve_parser
    from retriever.index_builder import BuildConfig
    from retriever.server import ServeConfig

    argv = ["--index", "i", "--host", "0.0.0.0", "--port", "9", "--topk", "2", "--max-topk", "7", "--max-batch", "256",
            "--max-wait-ms", "2", "--regroup-wait-ms", "3", "--api-key", "k", "--max-queries-per-request", "5", "--max-query-chars", "6",
            "--max-body-bytes", "99", "--device", "cuda", "--fp16", "--gpu-shards", "0", "--gpu-replicate", "--hybrid-bm25",
            "--rrf-k", "10", "--nprobe", "4", "--encode-batch-size", "8", "--encode-threads", "2", "--query-cache-size", "0", "--encoder", "minilm",
            "--log-level", "debug", "--insecure", "--body-timeout", "3.5", "--header-timeout", "4.5", "--max-idle-connections", "7"]  # fmt: skip
    got = config_from_args(ServeConfig, serve_parser().parse_args(argv))
    assert got == ServeConfig(index="i", host="0.0.0.0", port=9, topk=2, max_topk=7, max_batch=256, max_wait_ms=2.0, regroup_wait_ms=3.0, api_key="k",
                              max_queries_per_request=5, max_query_chars=6, max_body_bytes=99, device="cuda", fp16=True,
                              gpu_shards=0, gpu_replicate=True, hybrid_bm25=True, rrf_k=10, nprobe=4, encode_batch_size=8,
                              encode_threads=2, query_cache_size=0, encoder="minilm", log_level="debug", insecure=True, body_timeout=3.5,
                              header_timeout=4.5, max_idle_connections=7)  # fmt: skip
    assert config_from_args(ServeConfig, serve_parser().parse_args(["--index", "i", "--bf16", "--no-fp16"])).fp16 is False
    assert config_from_args(ServeConfig, serve_parser().parse_args(["--index", "i"])).bf16 is None  # automatic
    assert config_from_args(ServeConfig, serve_parser().parse_args(["--index", "i", "--no-bf16"])).bf16 is False  # fp32
    build = ["build", "--corpus", "c.jsonl", "--out", "o", "--encoder", "e5", "--pooling", "cls", "--query-prefix", "query: ",
             "--passage-prefix", "passage: ", "--max-length", "32", "--index-type", "IVF4,Flat", "--metric", "l2", "--bm25",
             "--chunk-size", "5", "--batch-size", "6", "--device", "cpu", "--no-fp16", "--bf16", "--train-sample", "7",
             "--nprobe", "2", "--seed", "3", "--limit", "9", "--overwrite", "--no-progress"]  # fmt: skip
    got = config_from_args(BuildConfig, index_parser().parse_args(build))
    assert got == BuildConfig(corpus="c.jsonl", out="o", encoder="e5", pooling="cls", query_prefix="query: ", passage_prefix="passage: ",
                              max_length=32, index_type="IVF4,Flat", metric="l2", bm25=True, chunk_size=5, batch_size=6, device="cpu",
                              fp16=False, bf16=True, train_sample=7, nprobe=2, seed=3, limit=9, overwrite=True, progress=False)  # fmt: skip
    assert "discouraged" in serve_parser().format_help()


def test_unknown_routes_and_methods_are_json_and_counted(retriever_server):
    before = httpx.get(retriever_server.url + "/metrics").text
    with httpx.Client(base_url=retriever_server.url, timeout=60, limits=httpx.Limits(max_connections=1)) as http:
        missing, wrong = http.get("/nope"), http.get("/retrieve")
        ports = {local_port(missing), local_port(wrong)}
        good = http.post("/retrieve", json=GOOD)
        ports.add(local_port(good))
    assert (missing.status_code, wrong.status_code, good.status_code) == (404, 405, 200)
    assert json.loads(missing.text)["detail"] and len(ports) == 1
    after = httpx.get(retriever_server.url + "/metrics").text
    for reason in ("not_found", "method_not_allowed"):
        assert metric(after, "retriever_errors_total", kind=reason) == metric(before, "retriever_errors_total", kind=reason) + 1
