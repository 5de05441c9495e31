"""emapg.server_input.serve_directly: the hot route answered past the router, with the same answers."""

from __future__ import annotations

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from emapg.server_input import HTTPError, guarded, serve_directly


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
