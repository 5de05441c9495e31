"""A closed-loop HTTP load generator for ``/retrieve``: N clients, one keep-alive connection each.

Each client sends one query per request and sends the next as soon as it has the answer (the way
rollout workers call a retriever). The window opens once every client has had one answer; q/s is
answered queries over the window, latency is per request. The client is a bare asyncio HTTP/1.1
POST (not httpx): the generator shares the cores with the servers it measures, and httpx spends
about a millisecond of CPU per request (``benchmarks/retriever_load.py`` explains).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import numpy as np


class LeanHTTPClient:
    """One keep-alive HTTP/1.1 connection that POSTs JSON and reads a ``Content-Length`` answer."""

    def __init__(self, url: str, headers: dict[str, str] | None = None):
        self.extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        host_port = url.split("://", 1)[1].rstrip("/")
        self.host, port = host_port.rsplit(":", 1)
        self.port = int(port)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, payload: dict | bytes) -> tuple[int, bytes]:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        head = f"POST {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n{self.extra}\r\n"
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(head.encode() + body)
        try:
            status_line, *headers = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            fields = dict(h.lower().split(": ", 1) for h in headers if ": " in h)
            data = await self.reader.readexactly(int(fields["content-length"]))
        except (asyncio.IncompleteReadError, ConnectionError, KeyError):
            await self.close()
            raise
        if fields.get("connection") == "close":
            await self.close()
        return int(status_line.split(" ", 2)[1]), data

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.reader = self.writer = None


def retrieve_request(query: str, topk: int) -> tuple[str, dict]:
    """One ``/retrieve`` request of one query: (path, JSON body)."""
    return "/retrieve", {"queries": [query], "topk": topk, "return_scores": True}


async def closed_loop_async(url: str, queries: list[str], concurrency: int, seconds: float, topk: int, *,
                            request: Callable[[str, int], tuple[str, dict]] = retrieve_request,
                            headers: dict[str, str] | None = None) -> dict:
    """``concurrency`` closed-loop clients, each a keep-alive connection sending ``request(query, topk)`` (path, JSON
    body; default ``/retrieve``) one after another; after every client's first answer (warm-up), the answers of a
    ``seconds``-long window are timed."""
    warm = 0
    all_warm = asyncio.Event()
    window = {"start": float("inf"), "end": float("inf")}
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    answered = 0

    async def client(c: int) -> None:
        nonlocal warm, answered
        http = LeanHTTPClient(url, headers)
        first = True
        i = c
        try:
            while True:
                t0 = time.perf_counter()
                if t0 >= window["end"]:
                    return
                status, _ = await http.post(*request(queries[i % len(queries)], topk))
                t1 = time.perf_counter()
                i += concurrency
                if first:
                    first = False
                    warm += 1
                    if warm == concurrency:
                        all_warm.set()
                    continue
                if window["start"] <= t0 and t1 <= window["end"]:
                    latencies.append(t1 - t0)
                    statuses[status] = statuses.get(status, 0) + 1
                    answered += status == 200
        finally:
            await http.close()

    tasks = [asyncio.create_task(client(c)) for c in range(concurrency)]
    await asyncio.wait_for(all_warm.wait(), timeout=120)
    window["start"] = time.perf_counter()
    window["end"] = window["start"] + seconds
    await asyncio.gather(*tasks)
    lat = np.array(latencies) * 1000 if latencies else np.array([float("nan")])
    return {"concurrency": concurrency, "seconds": seconds, "qps": round(answered / seconds, 1), "requests": len(latencies),
            "p50_ms": round(float(np.percentile(lat, 50)), 1), "p99_ms": round(float(np.percentile(lat, 99)), 1),
            "statuses": {str(k): v for k, v in sorted(statuses.items())}}  # fmt: skip


def closed_loop(url: str, queries: list[str], *, concurrency: int = 32, seconds: float = 5.0, topk: int = 3) -> dict:
    """Run ``concurrency`` closed-loop clients against ``url`` for ``seconds`` (after warm-up):
    ``{"qps", "p50_ms", "p99_ms", "requests", "statuses", ...}``."""
    return asyncio.run(closed_loop_async(url, queries, concurrency, seconds, topk))
