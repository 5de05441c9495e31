"""``emapg serve --mcp``: the official MCP client against a real server over a small real index.

Proves: the tools are listed with their schemas; ``search`` and ``search_batch`` return exactly ``/retrieve``'s
passages and scores, with ``/health``'s fingerprint; the limits are ``/retrieve``'s (an over-long query, a topk
past ``--max-topk`` are tool errors naming the limit); the API key is required (401 without it).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from retriever.launch import RetrieverServer

KEY = "mcp-test-key"


@pytest.fixture(scope="module")
def mcp_server(retriever_index):
    with RetrieverServer(retriever_index.index_dir, omp_num_threads=1, api_key=KEY,
                         extra_args=["--mcp", "--max-topk", "8", "--max-query-chars", "300"]) as server:  # fmt: skip
        yield server


def call(url: str, fn, key: str | None = KEY):
    """Run ``fn(client)`` on an MCP client of ``url`` (streamable HTTP, the API key as a bearer header)."""
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    async def main():
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        async with create_mcp_http_client(headers=headers) as http:
            async with Client(streamable_http_client(url + "/mcp", http_client=http)) as client:
                return await fn(client)

    return asyncio.run(main())


def retrieve(server, queries, topk):
    r = httpx.post(server.url + "/retrieve", json={"queries": queries, "topk": topk, "return_scores": True},
                   headers={"X-API-Key": KEY}, timeout=30)  # fmt: skip
    r.raise_for_status()
    return [[{"id": h["document"]["id"], "contents": h["document"]["contents"], "score": h["score"]} for h in q] for q in r.json()["result"]]


def test_tools_are_listed_with_schemas(mcp_server):
    async def fn(client):
        return (await client.list_tools()).tools

    tools = {t.name: t for t in call(mcp_server.url, fn)}
    assert set(tools) == {"search", "search_batch"}
    assert tools["search"].input_schema["required"] == ["query"]
    assert set(tools["search"].input_schema["properties"]) == {"query", "topk"}
    assert tools["search_batch"].input_schema["required"] == ["queries"]


def test_search_equals_retrieve(mcp_server, retriever_index):
    questions = [q["question"] for q in retriever_index.questions[:6]]

    async def fn(client):
        singles = [await client.call_tool("search", {"query": q, "topk": 4}) for q in questions]
        batch = await client.call_tool("search_batch", {"queries": questions, "topk": 4})
        default = await client.call_tool("search", {"query": questions[0]})
        return singles, batch, default

    singles, batch, default = call(mcp_server.url, fn)
    # like for like: one query per /retrieve against `search`, the batch against `search_batch` (an encoder batch's
    # composition moves scores in the last float bits; sequential calls are never batched together)
    native = retrieve(mcp_server, questions, 4)
    fingerprint = httpx.get(mcp_server.url + "/health").json()["fingerprint"]
    for result, q in zip(singles, questions):
        expected = retrieve(mcp_server, [q], 4)[0]
        assert not result.is_error
        assert result.structured_content["hits"] == expected
        assert result.structured_content["fingerprint"] == fingerprint
        text = result.content[0].text
        assert text.startswith("Doc 1(Title: ") and expected[0]["contents"].partition("\n")[2] in text
    assert not batch.is_error and batch.structured_content["results"] == native
    assert default.structured_content["hits"] == retrieve(mcp_server, questions[:1], 3)[0]  # the server's --topk


def test_limits_are_retrieves(mcp_server):
    async def fn(client):
        return (await client.call_tool("search", {"query": "x" * 301}),
                await client.call_tool("search", {"query": "who", "topk": 9}),
                await client.call_tool("search", {"query": "   "}))  # fmt: skip

    long, topk, empty = call(mcp_server.url, fn)
    assert long.is_error and "more than the limit of 300" in long.content[0].text
    assert topk.is_error and "between 1 and 8" in topk.content[0].text
    assert empty.is_error and "empty" in empty.content[0].text


def test_api_key_is_required(mcp_server):
    init = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
    r = httpx.post(mcp_server.url + "/mcp", json=init, headers={"Accept": "application/json, text/event-stream"})
    assert r.status_code == 401 and "API key" in r.text
    with pytest.raises(Exception):  # noqa: B017 - the SDK's own error for a 401, whatever its class
        call(mcp_server.url, lambda client: client.list_tools(), key="wrong")
    metrics = httpx.get(mcp_server.url + "/metrics", headers={"X-API-Key": KEY}).text
    assert 'path="/mcp",status="401"' in metrics and 'path="/mcp",status="200"' in metrics and 'path="mcp:tool",status="200"' in metrics


def test_serve_help_mentions_mcp():
    from retriever.cli import serve_parser

    text = serve_parser().format_help()
    assert "--mcp" in text and "MCP" in text
