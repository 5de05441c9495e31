"""emapg.server_input: the hot route answered past the router (serve_directly) with the same answers; bodies
sent compressed or too large, and HTTP/1.1 requests without Host, refused with a closed connection."""

from __future__ import annotations

import asyncio
import gzip
import json

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from emapg.server_input import HTTPError, guarded, install_error_handlers, read_body, serve_directly


def _app(direct: bool) -> tuple[FastAPI, list[dict]]:
    app = FastAPI()
    seen: list[dict] = []
    counts: list[tuple] = []

    @app.post("/echo")
    @guarded("key", lambda *a: counts.append(a), __import__("logging").getLogger("test"))
    async def echo(request: Request):
        seen.append({"endpoint": "endpoint" in request.scope, "route": request.scope["route"].path})
        body = await request.json()
        if body.get("bad"):
            raise HTTPError(422, "bad is set")
        return {"echo": body}

    if direct:
        serve_directly(app, "POST", "/echo", echo)
    app.state.counts = counts
    return app, seen


@pytest.mark.parametrize("direct", [False, True])
def test_the_direct_route_answers_as_the_router_does(direct):
    app, seen = _app(direct)
    auth = {"x-api-key": "key"}
    with TestClient(app) as client:
        ok = client.post("/echo", json={"a": 1}, headers=auth)
        refused = client.post("/echo", json={"bad": True}, headers=auth)
        no_key = client.post("/echo", json={"a": 1})
        wrong_method = client.get("/echo")
    assert (ok.status_code, ok.json()) == (200, {"echo": {"a": 1}})
    assert (refused.status_code, refused.json()) == (422, {"detail": "bad is set"})
    assert no_key.status_code == 401 and wrong_method.status_code == 405  # other methods still reach the router
    assert [c[:3] for c in app.state.counts] == [("/echo", 200, None), ("/echo", 422, "invalid_field"), ("/echo", 401, "unauthorized")]
    # FastAPI's router marks the scope with the endpoint it dispatched to; the direct path never routes
    assert [s["endpoint"] for s in seen] == [not direct, not direct] and {s["route"] for s in seen} == {"/echo"}


def test_serving_a_route_the_app_does_not_declare_is_refused():
    app, _ = _app(direct=False)
    with pytest.raises(ValueError, match="no POST /missing route"):
        serve_directly(app, "POST", "/missing", lambda request: None)


def _body_app() -> tuple[FastAPI, list[tuple]]:
    """A guarded endpoint reading a body of at most 16 bytes, as both servers' handlers do."""
    app = FastAPI()
    counts: list[tuple] = []

    @app.post("/body")
    @guarded(None, lambda *a: counts.append(a), __import__("logging").getLogger("test"))
    async def body(request: Request):
        return {"bytes": len(await read_body(request, 16, timeout_s=5))}

    install_error_handlers(app, lambda *a: counts.append(a))
    return app, counts


def test_encoded_and_oversize_bodies_are_refused_and_close_the_connection():
    app, counts = _body_app()
    with TestClient(app) as client:
        ok = client.post("/body", content=b"0123456789", headers={"content-encoding": "identity"})
        gz = client.post("/body", content=gzip.compress(b"0123456789"), headers={"content-encoding": "gzip"})
        listed = client.post("/body", content=b"0123456789", headers={"content-encoding": "identity, br"})
        declared = client.post("/body", content=b"x" * 17)
        streamed = client.post("/body", content=iter([b"x" * 10, b"x" * 10]))  # chunked: no Content-Length
    assert ok.status_code == 200 and ok.json() == {"bytes": 10} and "connection" not in ok.headers
    for r, detail in ((gz, 'Content-Encoding "gzip" is not supported: send the body uncompressed (identity)'),
                      (listed, 'Content-Encoding "identity", "br" is not supported: send the body uncompressed (identity)'),
                      (declared, "body of 17 bytes exceeds the limit of 16 bytes"),
                      (streamed, "body exceeds the limit of 16 bytes")):
        assert r.json()["detail"] == detail and r.headers["connection"] == "close", r.text
    assert [c[1:3] for c in counts] == [(200, None), (415, "content_encoding"), (415, "content_encoding"), (413, "too_large"),
                                        (413, "too_large")]


def test_an_http11_request_without_host_is_400_on_every_route():
    app, counts = _body_app()

    async def call(path: str, headers: list[tuple[bytes, bytes]], http_version: str = "1.1") -> tuple[int, dict, bytes]:
        sent: list[dict] = []

        async def receive():
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": http_version, "method": "POST", "scheme": "http",
                 "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        await app(scope, receive, send)
        start = next(m for m in sent if m["type"] == "http.response.start")
        return start["status"], dict(start["headers"]), b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")

    async def run():
        return [await call("/body", []), await call("/nope", []), await call("/body", [], "1.0"),
                await call("/body", [(b"host", b"127.0.0.1")])]

    (no_host, unknown_route, http10, with_host) = asyncio.run(run())
    for status, headers, body in (no_host, unknown_route):
        assert status == 400 and headers[b"connection"] == b"close"
        assert json.loads(body) == {"detail": "an HTTP/1.1 request needs a Host header"}
    assert http10[0] == 200 and with_host[0] == 200  # HTTP/1.0 has no Host requirement
    assert ("/body", 400, "missing_host") in [c[:3] for c in counts] and ("(unmatched)", 400, "missing_host") in [c[:3] for c in counts]
