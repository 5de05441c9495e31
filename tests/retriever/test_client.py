"""Clients: retries, failover and batching against a real (tiny, scripted) HTTP server, and the real one."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from retriever.client import RetrievalError, RetrieverClient, normalize_url
from retriever.launch import free_port


class ScriptedServer:
    """A real HTTP server on 127.0.0.1 whose first answers follow a script (status codes), then 200.

    A 200 answer echoes each query back as a Search-R1 hit, so tests can check ordering.
    """

    def __init__(self, script: list[int] | None = None, always: int | None = None):
        self.script = list(script or [])
        self.always = always
        self.requests: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def _send(self, status: int, payload: dict) -> None:
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._send(200, {"status": "ok", "port": outer.port})

            def do_POST(self):
                data = json.loads(self.rfile.read(int(self.headers["content-length"])))
                outer.requests.append({"path": self.path, "body": data, "auth": self.headers.get("authorization")})
                status = outer.always if outer.always is not None else (outer.script.pop(0) if outer.script else 200)
                if status != 200:
                    self._send(status, {"detail": f"scripted {status}"})
                    return
                hits = [[{"document": {"id": q, "contents": f'"T"\n{q}'}, "score": 1.0 / (1 + i)} for i in range(data.get("topk", 3))] for q in data["queries"]]
                self._send(200, {"result": hits})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


FAST = {"backoff": 0.01, "max_backoff": 0.05, "timeout": 5.0}


def test_retries_5xx_then_succeeds():
    with ScriptedServer(script=[503, 500]) as srv, RetrieverClient(srv.url, retries=3, **FAST) as client:
        hits = client.retrieve(["a", "b"], topk=2)
    assert len(srv.requests) == 3
    assert [[h["id"] for h in hh] for hh in hits] == [["a", "a"], ["b", "b"]]
    assert hits[0][0] == {"id": "a", "contents": '"T"\na', "score": 1.0}
    assert srv.requests[0]["body"] == {"queries": ["a", "b"], "return_scores": True, "topk": 2}


def test_4xx_is_not_retried():
    with ScriptedServer(always=422) as srv, RetrieverClient(srv.url, retries=5, **FAST) as client:
        with pytest.raises(RetrievalError, match="HTTP 422.*scripted 422") as e:
            client.retrieve(["a"])
    assert e.value.status == 422 and len(srv.requests) == 1


def test_persistent_5xx_gives_up_after_bounded_retries():
    with ScriptedServer(always=500) as srv, RetrieverClient(srv.url, retries=2, **FAST) as client:
        with pytest.raises(RetrievalError, match="after 3 attempts.*HTTP 500"):
            client.retrieve(["a"])
    assert len(srv.requests) == 3


def test_down_server_raises_after_retries():
    with RetrieverClient(f"http://127.0.0.1:{free_port()}", retries=2, **FAST) as client:
        with pytest.raises(RetrievalError, match="after 3 attempts.*ConnectError"):
            client.retrieve(["a"])


def test_failover_and_round_robin_over_replicas():
    dead = f"http://127.0.0.1:{free_port()}/retrieve"
    with ScriptedServer() as a, ScriptedServer() as b:
        with RetrieverClient([dead, a.url], retries=2, **FAST) as client:
            for _ in range(4):
                assert client.retrieve(["q"], topk=1)[0][0]["id"] == "q"
        assert len(a.requests) == 4
        with RetrieverClient([a.url, b.url + "/"], **FAST) as client:
            for _ in range(6):
                client.retrieve(["q"], topk=1)
        assert (len(a.requests) - 4, len(b.requests)) == (3, 3)


def test_long_query_lists_are_split_in_order():
    queries = [f"q{i}" for i in range(10)]
    with ScriptedServer() as srv, RetrieverClient(srv.url, batch_size=4, api_key="k", **FAST) as client:
        hits = client.retrieve(queries, topk=1)
        assert client.health()["status"] == "ok"
    assert [len(r["body"]["queries"]) for r in srv.requests] == [4, 4, 2]
    assert [hh[0]["id"] for hh in hits] == queries
    assert all(r["auth"] == "Bearer k" for r in srv.requests)


def test_url_forms_and_argument_errors():
    assert normalize_url("http://h:8000/retrieve") == normalize_url("http://h:8000/") == "http://h:8000"
    with pytest.raises(ValueError, match="http://"):
        RetrieverClient("localhost:8000")
    with pytest.raises(ValueError, match="at least one"):
        RetrieverClient([])
    with RetrieverClient("http://127.0.0.1:1") as client:
        with pytest.raises(TypeError, match="list of strings"):
            client.retrieve("one string")


def test_client_against_the_real_server(retriever_server, retriever_index):
    q = retriever_index.questions[0]
    with RetrieverClient(retriever_server.url + "/retrieve", retries=1) as client:
        hits = client.retrieve([q["question"]] * 3, topk=4)
        assert len(hits) == 3 and all(len(h) == 4 for h in hits)
        assert hits[0][0]["id"] == q["gold_id"] and set(hits[0][0]) == {"id", "contents", "score"}
        assert client.health()["index"]["rows"] == retriever_index.rows
        with pytest.raises(RetrievalError, match="HTTP 422.*between 1 and 100"):
            client.retrieve(["x"], topk=1000)
