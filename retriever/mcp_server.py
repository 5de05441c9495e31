"""The retriever as an MCP server: ``emapg serve --mcp`` answers the Model Context Protocol on ``/mcp``.

Two tools, over streamable HTTP (the official ``mcp`` SDK), next to ``/retrieve`` on the same index:

* ``search(query, topk)``: the top-k passages of one query;
* ``search_batch(queries, topk)``: the top-k passages of each query (what a rollout batch sends).

Both go through the server's own micro-batcher, so an MCP search and a ``/retrieve`` of the same query return the
same passages and scores, and they are checked by the same function with the same limits
(:func:`retriever.schema.check_retrieve`: ``--max-query-chars``, ``--max-topk``, ``--max-queries-per-request``;
``topk`` is an integer, never ``"5"``, ``true`` or ``5.0``).
A tool result carries the passages twice: as text in Search-R1's format (``Doc 1(Title: ...) ...``, what a
model reads) and as structured content ``{"hits": [{"id", "contents", "score"}], "fingerprint": ...}`` (the
batch form: ``{"results": [[hit, ...], ...], "fingerprint"}``), whose ``fingerprint`` is ``/health``'s.

The MCP endpoint is stateless and answers JSON (no sessions to hold, no event streams: ``GET`` and ``DELETE`` are
405), takes bodies up to
``--max-body-bytes``, and asks for the API key like every other route (``Authorization: Bearer KEY`` or
``X-API-Key: KEY``; 401 before the body is read). A refused tool call (a limit, the index still loading) is an
MCP tool error whose text says what to fix, never a 5xx.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Annotated, Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from mcp.types import CallToolResult, TextContent
from pydantic import WithJsonSchema

from emapg.server_input import UNAUTHORIZED, HTTPError, api_key_ok, error_response
from retriever.schema import check_retrieve

log = logging.getLogger("retriever.mcp")

__all__ = ["MCP_PATH", "build_mcp", "passages_text"]

MCP_PATH = "/mcp"


def passages_text(hits: list[dict]) -> str:
    """Search-R1's passage format (``agent.actions.format_passages``; the retriever sits below the agent layer)."""
    parts = []
    for i, hit in enumerate(hits, start=1):
        title, _, body = str(hit.get("contents", "")).partition("\n")
        parts.append(f"Doc {i}(Title: {title}) {body}\n")
    return "".join(parts)


#: ``topk`` as the tools declare it (an integer or null), checked by :func:`retriever.schema.check_retrieve` exactly as
#: ``/retrieve`` checks it: the SDK's own validation would take ``"5"``, ``true`` and ``5.0`` for 5.
TopK = Annotated[Any, WithJsonSchema({"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}], "default": None,
                                      "description": "passages per query (default: the server's --topk)"})]


def _hits(found: list[dict]) -> list[dict]:
    return [{"id": h["id"], "contents": h["contents"], "score": float(h["score"])} for h in found]


def build_mcp(state: Any, cfg: Any, count: Callable[[str, int, str | None, float], None]):
    """``(asgi_app, session_manager)``: the ``/mcp`` ASGI handler (API key first) and the SDK's session manager,
    whose ``run()`` the server's lifespan enters. ``state`` is the server's (``.status``, ``.error``, ``.batcher``,
    ``.searcher``), ``cfg`` its :class:`retriever.server.ServeConfig`, ``count`` its metrics' counter."""
    server = MCPServer(
        "ema-pg-retriever",
        instructions="Search a passage index (the same index and results as this server's POST /retrieve).",
        log_level="WARNING",
    )

    async def run(queries: list, topk: int | None) -> tuple[list[list[dict]], str]:
        t0 = time.perf_counter()
        data: dict[str, Any] = {"queries": queries}
        if topk is not None:
            data["topk"] = topk
        try:
            queries, topk_, _ = check_retrieve(data, cfg)
            if state.status != "ok":
                raise HTTPError(503, f"index is {state.status}{': ' + state.error if state.error else ''}; retry when GET /health returns 200")
            try:
                found = await state.batcher.submit(queries, topk_)
            except Exception as e:  # noqa: BLE001 - this call only
                raise HTTPError(500, f"retrieval failed: {type(e).__name__}: {e}", "retrieval") from None
        except HTTPError as e:
            count("mcp:tool", e.status, e.reason, time.perf_counter() - t0)
            raise ToolError(e.message) from None
        count("mcp:tool", 200, None, time.perf_counter() - t0)
        return [_hits(q) for q in found], state.searcher.fingerprint

    async def search(query: str, topk: TopK = None) -> CallToolResult:
        """Search the passage index: the top-k passages for one query (default topk: the server's --topk)."""
        (hits,), fingerprint = await run([query], topk)
        return CallToolResult(content=[TextContent(type="text", text=passages_text(hits))],
                              structured_content={"hits": hits, "fingerprint": fingerprint})  # fmt: skip

    async def search_batch(queries: list[str], topk: TopK = None) -> CallToolResult:
        """Search the passage index for several queries at once: the top-k passages of each, in order."""
        results, fingerprint = await run(queries, topk)
        structured = {"results": results, "fingerprint": fingerprint}
        return CallToolResult(content=[TextContent(type="text", text=json.dumps(structured))], structured_content=structured)

    server.add_tool(search, name="search")
    server.add_tool(search_batch, name="search_batch")

    security = None
    if cfg.host in ("127.0.0.1", "localhost", "::1"):  # what the SDK's own app does for a loopback bind
        security = TransportSecuritySettings(
            enable_dns_rebinding_protection=True,
            allowed_hosts=["127.0.0.1:*", "localhost:*", "[::1]:*"],
            allowed_origins=["http://127.0.0.1:*", "http://localhost:*", "http://[::1]:*"],
        )
    manager = StreamableHTTPSessionManager(
        app=server._lowlevel_server,  # MCPServer.streamable_http_app builds the same manager, inside an app of its own
        json_response=True,
        stateless=True,
        security_settings=security,
        max_request_body_size=cfg.max_body_bytes,
    )
    api_key = cfg.api_key_value()

    async def asgi(scope, receive, send) -> None:
        if not api_key_ok(_Headers(scope), api_key):
            count(MCP_PATH, 401, None, 0.0)
            await error_response(HTTPError(401, UNAUTHORIZED))(scope, receive, send)
            return
        if scope.get("method") != "POST":  # stateless: no event stream to open (GET) and no session to end (DELETE)
            count(MCP_PATH, 405, "method_not_allowed", 0.0)
            response = error_response(HTTPError(405, "the MCP endpoint is stateless and answers POST only (no event "
                                                     "stream, no sessions)"))
            response.headers["allow"] = "POST"
            await response(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = [0]

        async def counted_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        await manager.handle_request(scope, receive, counted_send)
        count(MCP_PATH, status[0], None if status[0] < 400 else "mcp", time.perf_counter() - t0)

    return asgi, manager


class _Headers:
    """What :func:`emapg.server_input.api_key_ok` reads of a request (``.headers.get``), from an ASGI scope."""

    def __init__(self, scope) -> None:
        self.headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
