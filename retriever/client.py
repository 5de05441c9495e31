"""HTTP client for the retrieval server (ours or Search-R1's: the wire format is the same).

``RetrieverClient`` is synchronous and thread-safe (the async rollout driver calls it from a thread
pool while the engine keeps generating, so no ``asyncio`` twin is needed). Its policy:

* one pooled ``httpx`` client, keep-alive, connect/read timeouts;
* bounded retries with exponential backoff (+ jitter) on connection errors, timeouts and
  5xx/429 answers, never on other 4xx (those are our bugs: retrying cannot fix them);
* several replica URLs: each attempt goes to the next replica (round-robin), so a dead
  replica costs one failed attempt, not the request;
* ``retrieve`` splits long query lists into requests of ``batch_size`` queries;
* :meth:`RetrieverClient.wait_ready` waits (bounded) for *every* replica's ``/health`` and
  checks the API key with a one-query search, naming the replica that is down or refuses.

Raises :class:`RetrievalError` when every attempt failed, with the last server message.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
import threading
import time
from collections.abc import Sequence

import httpx

from emapg.servers import response_error

_log = logging.getLogger("retriever.client")
RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})


class RetrievalError(RuntimeError):
    """Retrieval failed after all retries, or the server rejected the request (4xx)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def normalize_url(url: str) -> str:
    """Base URL of a server from ``http://h:p``, ``http://h:p/`` or ``http://h:p/retrieve``."""
    url = url.strip().rstrip("/")
    if url.endswith("/retrieve"):
        url = url[: -len("/retrieve")]
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"retriever URL must start with http:// or https://, got {url!r}")
    return url


def _parse_hits(payload: dict, n_queries: int) -> list[list[dict]]:
    result = payload.get("result") if isinstance(payload, dict) else None
    if isinstance(payload, dict) and payload.get("partial"):  # a router missing a shard (retriever.router)
        _log.warning("partial retrieval result: %s", payload["partial"])
    if not isinstance(result, list) or len(result) != n_queries:
        raise RetrievalError(f"malformed response: expected 'result' with {n_queries} lists")
    out = []
    for hits in result:
        row = []
        for h in hits:
            if "document" in h:  # return_scores=true shape
                doc = h["document"]
                row.append({"id": doc.get("id"), "contents": doc["contents"], "score": float(h.get("score", 0.0))})
            else:
                row.append({"id": h.get("id"), "contents": h["contents"], "score": None})
        out.append(row)
    return out


def _error_message(resp: httpx.Response) -> str:
    return response_error(resp, limit=500)


class _Policy:
    def __init__(self, urls: str | list[str], timeout: float, retries: int, backoff: float, max_backoff: float, api_key: str | None, batch_size: int):
        url_list = [urls] if isinstance(urls, str) else list(urls)
        if not url_list:
            raise ValueError("at least one retriever URL is needed")
        if retries < 0 or batch_size < 1:
            raise ValueError("retries must be >= 0 and batch_size >= 1")
        self.urls = [normalize_url(u) for u in url_list]
        self.timeout = httpx.Timeout(timeout, connect=min(timeout, 10.0))
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.batch_size = batch_size
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._rr = itertools.count(random.randrange(len(self.urls)))
        self._lock = threading.Lock()

    def next_url(self) -> str:
        with self._lock:
            return self.urls[next(self._rr) % len(self.urls)]

    def delay(self, attempt: int) -> float:
        d = min(self.max_backoff, self.backoff * (2**attempt))
        return d * (0.5 + random.random() / 2)  # jitter: replicas are not hit in lockstep

    def chunks(self, queries: list[str]) -> list[list[str]]:
        if isinstance(queries, str) or not all(isinstance(q, str) for q in queries):
            raise TypeError("queries must be a list of strings")
        return [queries[i : i + self.batch_size] for i in range(0, len(queries), self.batch_size)]

    @staticmethod
    def body(queries: list[str], topk: int | None) -> dict:
        body: dict = {"queries": queries, "return_scores": True}
        if topk is not None:
            body["topk"] = topk
        return body


def read_healths(urls: Sequence[str], http: httpx.Client | None = None, timeout: float = 5.0) -> dict[str, dict | None]:
    """Each URL's ``/health`` body, asked once without retries (through ``http`` where given); None where it does not
    answer 200 with a JSON object."""
    out: dict[str, dict | None] = {}
    with contextlib.nullcontext(http) if http is not None else httpx.Client(timeout=timeout) as client:
        for url in urls:
            try:
                resp = client.get(url.rstrip("/") + "/health")
                body = resp.json() if resp.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                body = None
            out[url] = body if isinstance(body, dict) else None
    return out


class RetrieverClient:
    """Synchronous client: ``RetrieverClient("http://127.0.0.1:8000").retrieve(["q"], topk=3)``."""

    def __init__(
        self,
        urls: str | list[str],
        *,
        timeout: float = 30.0,
        retries: int = 5,
        backoff: float = 0.2,
        max_backoff: float = 5.0,
        api_key: str | None = None,
        batch_size: int = 256,
        max_connections: int = 64,
    ):
        self._p = _Policy(urls, timeout, retries, backoff, max_backoff, api_key, batch_size)
        self._http = httpx.Client(
            timeout=self._p.timeout, headers=self._p.headers, limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        )

    @property
    def urls(self) -> list[str]:
        return list(self._p.urls)

    def _request(self, method: str, path: str, json_body: dict | None = None) -> httpx.Response:
        last = "no attempt made"
        for attempt in range(self._p.retries + 1):
            url = self._p.next_url() + path
            try:
                resp = self._http.request(method, url, json=json_body)
            except httpx.TransportError as e:  # connection refused/reset, timeouts
                last = f"{type(e).__name__} talking to {url}: {e}"
            else:
                if resp.status_code < 400:
                    return resp
                if resp.status_code not in RETRYABLE_STATUS:
                    raise RetrievalError(_error_message(resp), resp.status_code)
                last = _error_message(resp)
            if attempt < self._p.retries:
                time.sleep(self._p.delay(attempt))
        raise RetrievalError(f"retrieval failed after {self._p.retries + 1} attempts; last error: {last}")

    def retrieve(self, queries: list[str], topk: int | None = None) -> list[list[dict]]:
        """queries (N,) -> per query a list of ``{"id", "contents", "score"}``, best first."""
        out: list[list[dict]] = []
        for chunk in self._p.chunks(queries):
            resp = self._request("POST", "/retrieve", self._p.body(chunk, topk))
            out.extend(_parse_hits(resp.json(), len(chunk)))
        return out

    def health(self) -> dict:
        """``/health`` of the next replica that answers 200 (retried like ``retrieve``)."""
        return self._request("GET", "/health").json()

    def healths(self) -> dict[str, dict | None]:
        """Each replica's ``/health`` body (:func:`read_healths`): what every replica says of itself, where
        :meth:`health` asks whichever answers."""
        return read_healths(self._p.urls, self._http)

    def fingerprints(self) -> dict[str, dict | None]:
        """Each replica's index fingerprint (its ``/health`` ``fingerprint``; None where it gives none or
        does not answer): replicas of one retriever must agree, and run records name each."""
        return {url: (health or {}).get("fingerprint") for url, health in self.healths().items()}

    def wait_ready(self, wait_s: float, *, poll_s: float = 0.5, probe: str = "health check") -> None:
        """Wait up to ``wait_s`` seconds (in all) until every replica answers ``/health`` with 200, then
        send each one search of ``probe`` (1 passage): that checks the API key and that retrieval works.

        A server without ``/health`` (404: Search-R1's) goes straight to the search probe. Raises
        :class:`RetrievalError` naming the first replica that did not become ready, with its last answer;
        ``status`` is 401/403 when the key was refused (that is not waited on).
        """
        deadline = time.monotonic() + max(0.0, wait_s)
        for url in self._p.urls:
            last = "no answer"
            while True:
                remaining = deadline - time.monotonic()
                try:
                    last, status = self._probe(url, timeout=max(0.5, min(remaining, 10.0)), probe=probe)
                except httpx.TransportError as e:  # nothing listening yet, or not answering
                    last, status = f"{type(e).__name__}: {e}", None
                if status == 200:
                    break
                if status in (401, 403):
                    raise RetrievalError(f"retriever {url} refused the API key: {last}", status)
                if remaining <= 0:
                    raise RetrievalError(f"retriever {url} was not ready within {wait_s:g} s; last answer: {last}", status)
                time.sleep(min(poll_s, max(remaining, 0.0)))

    def _probe(self, url: str, *, timeout: float, probe: str) -> tuple[str, int]:
        """(message, status) of one readiness probe of ``url``: ``/health``, then a one-passage search."""
        resp = self._http.get(url + "/health", timeout=timeout)
        if resp.status_code not in (200, 404):
            return _error_message(resp), resp.status_code
        resp = self._http.post(url + "/retrieve", json=self._p.body([probe], 1), timeout=timeout)
        if resp.status_code != 200:
            return _error_message(resp), resp.status_code
        try:
            _parse_hits(resp.json(), 1)
        except (ValueError, RetrievalError) as e:  # a server that answers garbage is not ready either
            return f"malformed answer from {url}/retrieve: {e}", None
        return "ok", 200

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "RetrieverClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
