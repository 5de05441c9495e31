"""The connection guard of both servers (emapg.connection_guard) on a real uvicorn, over both of its HTTP/1.1
parsers (httptools, as the servers run, and h11), with real sockets: headers that never finish, idle
connections past the cap, oversized headers. The servers' own suites repeat the slow-header case end to end
(tests/retriever/test_server_hardening.py, tests/agent/test_engine_server_hardening.py)."""

from __future__ import annotations

import logging
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from emapg.connection_guard import MAX_HEAD_BYTES, CloseCounter, guarded_protocol
from emapg.servers import free_port
from tests.fixtures.http_checks import hold_open, strict_json

BASES = [HttpToolsProtocol, H11Protocol]


async def _app(scope, receive, send):
    body = b'{"ok": true}'
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class _Server:
    """uvicorn in a thread of this process, serving ``_app`` through the guarded ``base`` protocol."""

    def __init__(self, base: type, header_timeout: float, max_idle: int):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.closes = CloseCounter()  # this server's own, so tests in one process do not share counts
        config = uvicorn.Config(_app, host="127.0.0.1", port=self.port, lifespan="off", log_level="warning",
                                http=guarded_protocol(header_timeout, max_idle, base, closes=self.closes), timeout_keep_alive=60,
                                h11_max_incomplete_event_size=MAX_HEAD_BYTES)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> _Server:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


HEAD = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n"


@pytest.mark.parametrize("base", BASES, ids=lambda b: b.__name__)
def test_headers_that_never_finish_are_closed_after_the_header_timeout(base):
    """Before: a connection that sent half its headers was still open after 230 s (uvicorn has no header timeout)."""
    with _Server(base, header_timeout=1.0, max_idle=64) as s:
        results: dict[str, object] = {}
        cases = {
            "trickling": dict(sent=HEAD, trickle=b"X-Slow: " + b"a" * 100, every_s=0.1),  # bytes do not extend the deadline
            "silent": dict(sent=b""),  # connects, sends nothing
            "kept_alive_then_trickling": dict(sent=HEAD + b"\r\n", trickle=HEAD, every_s=0.1),  # answered, then a slow one
            "pipelined_half": dict(sent=HEAD + b"\r\n" + HEAD),  # the unfinished head came with the first request
            "kept_alive_idle": dict(sent=HEAD + b"\r\n"),
        }
        threads = [threading.Thread(target=lambda k=k, c=c: results.__setitem__(k, hold_open(s.url, wait_s=15, **c)))
                   for k, c in cases.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for name, a in results.items():
            assert a.closed and 0.9 <= a.seconds < 10, (name, a)
        for name in ("trickling", "kept_alive_then_trickling"):
            assert results[name].status == 408, (name, results[name])
            assert "did not arrive within 1 s" in strict_json(results[name].body)["detail"]
        assert results["silent"].status is None and results["silent"].head == b""
        for name in ("pipelined_half", "kept_alive_idle"):
            assert results[name].status == 200, (name, results[name])  # the first answer, then the close
        assert httpx.get(s.url).json() == {"ok": True}  # real clients are served
        counts = s.closes.counts()  # 408: the two trickling; closed without a word: silent, kept alive, pipelined half
        assert counts["header_timeout"] == 2 and counts["idle_timeout"] == 3 and counts["idle_cap"] == 0, counts


@pytest.mark.parametrize("base", BASES, ids=lambda b: b.__name__)
def test_idle_connections_past_the_cap_close_the_longest_idle(base):
    """Before: 32 connections that never sent a request were all held for 80 s; any number could be."""
    with _Server(base, header_timeout=60.0, max_idle=3) as s:
        socks = []
        for _ in range(3):
            socks.append(socket.create_connection(("127.0.0.1", s.port)))
            time.sleep(0.1)  # the server sees them in this order
        with httpx.Client(base_url=s.url) as http:  # a real request on a 4th connection: the oldest idle one goes
            assert http.get("/").json() == {"ok": True}
        socks[0].settimeout(10)
        assert socks[0].recv(1) == b""  # closed by the server
        assert s.closes.counts()["idle_cap"] == 1
        for sock in socks[1:]:
            sock.settimeout(0.3)
            with pytest.raises(socket.timeout):
                sock.recv(1)
            sock.close()
        socks[0].close()


@pytest.mark.parametrize("base", BASES, ids=lambda b: b.__name__)
def test_headers_larger_than_the_bound_are_refused(base):
    with _Server(base, header_timeout=30.0, max_idle=64) as s:
        a = hold_open(s.url, HEAD + b"X-Big: " + b"a" * (MAX_HEAD_BYTES + 10), wait_s=15)
        assert a.closed and a.status == (431 if base is HttpToolsProtocol else 400), a  # h11 bounds it itself
        assert a.seconds < 10
        assert s.closes.counts()["oversized_headers"] == 1  # counted by the guard under both parsers


def test_closes_are_logged_at_info_once_per_cause_per_minute(caplog):
    """A flood of stalled clients is one INFO line per cause per minute, saying how many closes it stands for."""
    now = [0.0]
    closes = CloseCounter(log_every_s=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.DEBUG, logger="emapg.connection_guard"):
        for t in (0.0, 1.0, 2.0, 30.0):
            now[0] = t
            closes.note("header_timeout", f"at {t}")
        closes.note("idle_cap", "one")
        closes.note("idle_timeout", "routine")
        now[0] = 61.0
        closes.note("header_timeout", "at 61")
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert lines == [
        (logging.INFO, "closed 1 connection(s) (header_timeout); latest: at 0.0"),
        (logging.INFO, "closed 1 connection(s) (idle_cap); latest: one"),
        (logging.DEBUG, "closed 1 connection(s) (idle_timeout); latest: routine"),
        (logging.INFO, "closed 4 connection(s) (header_timeout) in the last 61 s; latest: at 61"),
    ]
    assert closes.counts() == {"header_timeout": 5, "idle_timeout": 1, "idle_cap": 1, "oversized_headers": 0, "body_timeout": 0}
