"""``RemoteEngine``: the :class:`~agent.engines.base.Engine` interface over HTTP to generation servers.

Servers are started with ``emapg engine serve`` (agent/engines/server.py). Several URLs are
data-parallel replicas: a ``generate`` batch is split over them, ``submit`` sends each request
to the replica with the fewest in flight, and a weight sync goes to every replica.

* ``submit`` puts one HTTP request on a thread pool; ``step`` waits (briefly) for requests to
  come back and returns the finished ones, so the async rollout driver keeps many small
  requests in flight and the server batches them (``continuous_batching`` is True).
* Retries with backoff on connection errors and 5xx; a 4xx is the caller's mistake and
  becomes a ``ValueError`` carrying the server's message (never retried). A replica that still
  cannot be reached is *retired* (logged): its generation requests go to the other replicas and
  http weight syncs skip it; it is not taken back (it would serve stale weights). The last replica
  is never retired: its failure is the caller's error.
* The tokenizer is loaded locally from the same model the trainer names (it must be the one
  the server was started with; ``vocab_size`` and ``max_model_len`` come from ``/health``).
* Weight sync (:meth:`load_weights`), ``weight_sync=``:
  ``"http"``: the state dict goes out as safetensors buckets of at most ``bucket_bytes``
  under one sync id, then a commit loads them (all or nothing);
  ``"collective"``: a private process group (agent/engines/collective.py) with this process
  as rank 0 and every server worker as another rank; buckets are broadcast.
  :meth:`load_lora` sends LoRA adapters over either transport: only the adapter tensors travel, their
  config (``lora``) rides along on the commit (http) or the receive request (collective).
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import logging
import random
import threading
import time
import uuid
from dataclasses import dataclass
from collections.abc import Iterator
from typing import Any

import httpx
import torch

from agent.engines.base import EngineInfo, GenerationOutput, SamplingParams, check_prompts, lora_adapter_config, per_prompt_params
from agent.engines.wire import floats_from_json, output_from_json, params_to_json, plan_buckets
from emapg.servers import response_error

RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
log = logging.getLogger(__name__)


#: Request bodies larger than this go out in slices of this size (see :meth:`RemoteEngine._request`).
BODY_CHUNK_BYTES = 1 << 20


def _slices(body: bytes) -> Iterator[memoryview]:
    view = memoryview(body)
    for start in range(0, len(view), BODY_CHUNK_BYTES):
        yield view[start:start + BODY_CHUNK_BYTES]


class RemoteEngineError(RuntimeError):
    """A server could not be reached or kept failing (after retries)."""


def _message(resp: httpx.Response) -> str:
    return response_error(resp, limit=1000)


def _normalize(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"engine URL must start with http:// or https://, got {url!r}")
    return url


def _raise_if_done(futs: list[cf.Future], what: str) -> None:
    """A server answers these requests only after the collective part: an early answer is a refusal."""
    for f in futs:
        if f.done():
            f.result()  # a 4xx/5xx raises here
            raise RemoteEngineError(f"a generation server answered before the collective step and {what}")


@dataclass(frozen=True)
class StagedWeights:
    """Weights uploaded to the servers and not yet loaded (:meth:`RemoteEngine.stage_weights`)."""

    sync_id: str
    buckets: int
    tensors: int
    tag: str | None = None


class RemoteEngine:
    """Generation on ``emapg engine serve`` servers.

    Args:
        urls: one base URL or several (replicas of the same model).
        model_path: model (folder or alias) whose tokenizer to load; default: the path the
            first server reports (only works when that path exists here too).
        api_key: sent as ``Authorization: Bearer``.
        timeout: seconds per HTTP request (generation of a whole batch included).
        retries: extra attempts on connection errors and 5xx.
        wait_s: how long to wait for the servers' ``/health`` at start-up (they may still be loading).
        weight_sync: ``"http"`` or ``"collective"``; bucket_bytes: bucket size for both.
        collective_host/port/backend/timeout_s: where the servers reach this process's TCPStore,
            gloo (CPU, any network) or nccl (GPUs), and the collective timeout.
        max_in_flight: concurrent HTTP requests (``submit``/``generate`` chunks).
        prompts_per_request: ``generate`` sends at most this many prompts per request.
    """

    def __init__(
        self,
        urls: str | list[str],
        *,
        model_path: str | None = None,
        api_key: str | None = None,
        timeout: float = 600.0,
        retries: int = 3,
        backoff: float = 0.5,
        wait_s: float = 0.0,
        weight_sync: str = "http",
        bucket_bytes: int = 256 << 20,
        collective_host: str = "127.0.0.1",
        collective_port: int = 0,
        collective_backend: str = "gloo",
        collective_timeout_s: float = 600.0,
        max_in_flight: int = 64,
        prompts_per_request: int = 256,
    ) -> None:
        url_list = [urls] if isinstance(urls, str) else list(urls)
        if not url_list:
            raise ValueError("RemoteEngine needs at least one server URL")
        if weight_sync not in ("http", "collective"):
            raise ValueError(f"weight_sync must be 'http' or 'collective', got {weight_sync!r}")
        self.urls = [_normalize(u) for u in url_list]
        self.api_key = api_key  # the servers' OpenAI endpoint is reached with it too (agent/external.py)
        self.retries, self.backoff = retries, backoff
        self.weight_sync, self.bucket_bytes = weight_sync, bucket_bytes
        self.prompts_per_request = prompts_per_request
        self._collective_args = (collective_host, collective_port, collective_backend, collective_timeout_s)
        self._sender = None
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)), headers=headers,
            limits=httpx.Limits(max_connections=max_in_flight + 8, max_keepalive_connections=max_in_flight + 8),
        )  # fmt: skip
        self._pool = cf.ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="emapg-remote")
        self._inflight: dict[str, tuple[cf.Future, str]] = {}
        self._load: dict[str, int] = dict.fromkeys(self.urls, 0)
        self._lock = threading.Lock()
        self._rr = itertools.count()
        try:
            self._connect(model_path, wait_s)
        except BaseException:
            self.close()
            raise

    def _connect(self, model_path: str | None, wait_s: float) -> None:
        self.healths = [self._wait_healthy(u, wait_s) for u in self.urls]
        h = self.healths[0]
        for u, other in zip(self.urls[1:], self.healths[1:]):
            if (other["vocab_size"], other["max_model_len"]) != (h["vocab_size"], h["max_model_len"]):
                raise ValueError(f"replica {u} serves a different model shape than {self.urls[0]} (vocab/max_model_len)")
        self.vocab_size = int(h["vocab_size"])
        self.max_model_len = int(h["max_model_len"])
        from transformers import AutoTokenizer

        from emapg.models import resolve_model

        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model(str(model_path or h["model"])))
        if len(self.tokenizer) > self.vocab_size:
            raise ValueError(f"the local tokenizer ({len(self.tokenizer)} tokens) does not fit the served model (vocab {self.vocab_size})")
        self.info = EngineInfo(
            "remote", str(model_path or h["model"]), self.max_model_len, supports_sleep=any(x["supports_sleep"] for x in self.healths),
            continuous_batching=True, extra={"urls": self.urls, "server_engines": [x["engine"] for x in self.healths], "weight_sync": self.weight_sync},
            serves_lora=all(x.get("serves_lora", False) for x in self.healths),
            max_lora_rank=min((x["max_lora_rank"] for x in self.healths if x.get("max_lora_rank") is not None), default=None),
        )  # fmt: skip

    # ------------------------------------------------------------------ HTTP
    def _request(self, method: str, url: str, *, json: Any = None, content: bytes | None = None, retry_5xx: bool = True) -> httpx.Response:
        last = "no attempt made"
        for attempt in range(self.retries + 1):
            try:
                if content is not None and len(content) > BODY_CHUNK_BYTES:
                    # In slices: httpcore sends one bytes object by re-slicing what is left after each
                    # socket send (a copy each time), quadratic in the body's size: pushing SmolLM2-135M's
                    # weights (621 MiB) in 256 MiB buckets took 11.8 s whole, 2.9 s sliced, on loopback
                    # (benchmarks/weight_sync.py, 2026-12-03).
                    resp = self._http.request(method, url, content=_slices(content), headers={"Content-Length": str(len(content))})
                else:
                    resp = self._http.request(method, url, json=json, content=content)
            except httpx.TransportError as e:  # refused/reset/timeouts
                last = f"{type(e).__name__} talking to {url}: {e}"
            else:
                if resp.status_code < 400:
                    return resp
                if resp.status_code not in RETRYABLE_STATUS:
                    raise ValueError(_message(resp))
                last = _message(resp)
                if not retry_5xx:
                    break
            if attempt < self.retries:
                time.sleep(min(10.0, self.backoff * 2**attempt) * (0.5 + random.random() / 2))
        raise RemoteEngineError(f"{method} {url} failed after {attempt + 1} attempt(s); last error: {last}")

    def _wait_healthy(self, url: str, wait_s: float) -> dict:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                resp = self._http.get(url + "/health")
                if resp.status_code == 200:
                    return resp.json()
                last = _message(resp)
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() >= deadline:
                raise RemoteEngineError(f"generation server {url} is not healthy: {last}")
            time.sleep(0.5)

    def health(self) -> list[dict]:
        """``/health`` of every replica (``weights_version`` etc.)."""
        return [self._request("GET", u + "/health").json() for u in self.urls]

    def _all(self, fn, *, tolerate_loss: bool = False) -> list[Any]:
        """Run ``fn(url)`` for every replica concurrently; re-raise the first failure. ``tolerate_loss``: a
        replica that cannot be reached (:class:`RemoteEngineError`) is retired instead while another remains."""
        urls = list(self.urls)
        futs = [self._pool.submit(fn, u) for u in urls]
        out, lost = [], None
        for u, f in zip(urls, futs):
            try:
                out.append(f.result())
            except RemoteEngineError as e:
                if not tolerate_loss:
                    raise
                lost = lost or e
                self._retire(u, e)
        if lost is not None and not out:
            raise lost
        return out

    def _retire(self, url: str, error: BaseException) -> None:
        """Take a replica that stopped answering out of the rotation for good (it would come back on stale weights)."""
        with self._lock:
            if url in self.urls and len(self.urls) > 1:
                self.urls.remove(url)
                log.warning("generation server %s retired after: %s; %d replica(s) left", url, error, len(self.urls))

    # ------------------------------------------------------------------ generation
    def _post_generate(self, url: str, prompts: list[list[int]], params: list[SamplingParams]) -> list[GenerationOutput]:
        """``/generate`` on ``url``; a replica that cannot be reached is retired and the request goes to another."""
        tried: list[str] = []
        while True:
            try:
                return self._post_generate_once(url, prompts, params)
            except RemoteEngineError as e:
                tried.append(url)
                self._retire(url, e)
                with self._lock:
                    live = [u for u in self.urls if u not in tried]
                if not live:
                    raise
                url = min(live, key=lambda u: self._load[u])

    def _post_generate_once(self, url: str, prompts: list[list[int]], params: list[SamplingParams]) -> list[GenerationOutput]:
        body = {"prompts": [list(map(int, p)) for p in prompts], "params": [params_to_json(p) for p in params]}
        data = self._request("POST", url + "/generate", json=body).json()
        outs = data.get("outputs")
        if not isinstance(outs, list) or len(outs) != len(prompts):
            raise RemoteEngineError(f"malformed /generate answer from {url}: expected {len(prompts)} outputs")
        return [output_from_json(o) for o in outs]

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[GenerationOutput]:
        plist = per_prompt_params(params, len(prompt_ids))
        check_prompts(prompt_ids, self.vocab_size, self.max_model_len, [p.max_tokens for p in plist])
        if not prompt_ids:
            return []
        # Contiguous chunks: at most prompts_per_request each, and at least one per replica when possible.
        n = len(prompt_ids)
        size = max(1, min(self.prompts_per_request, -(-n // len(self.urls))))
        start = next(self._rr)
        futs = [
            self._pool.submit(self._post_generate, self.urls[(start + j) % len(self.urls)], prompt_ids[i : i + size], plist[i : i + size])
            for j, i in enumerate(range(0, n, size))
        ]
        return [o for f in futs for o in f.result()]

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        check_prompts([prompt_ids], self.vocab_size, self.max_model_len, params.max_tokens)
        with self._lock:
            if request_id in self._inflight:
                raise ValueError(f"request id {request_id!r} is already in flight")
            url = min(self.urls, key=lambda u: self._load[u])
            self._load[url] += 1
            fut = self._pool.submit(self._post_generate, url, [list(prompt_ids)], [params])
            self._inflight[request_id] = (fut, url)

    def step(self, timeout: float = 0.05) -> list[tuple[str, GenerationOutput]]:
        """Requests that came back; waits up to ``timeout`` s for the first (the driver polls retrieval in between)."""
        with self._lock:
            futs = {f: rid for rid, (f, _) in self._inflight.items()}
        if not futs:
            return []
        done, _ = cf.wait(list(futs), timeout=timeout, return_when=cf.FIRST_COMPLETED)
        finished, error = [], None
        with self._lock:
            for f in done:
                rid = futs[f]
                _, url = self._inflight.pop(rid)
                self._load[url] -= 1
                if f.exception() is not None:
                    error = error or f.exception()
                else:
                    finished.append((rid, f.result()[0]))
            if error is not None:
                # Like a local engine whose step fails: everything in flight is lost (the driver fails them).
                for f, url in self._inflight.values():
                    f.cancel()
                    self._load[url] -= 1
                self._inflight.clear()
        if error is not None:
            raise error
        return finished

    def has_unfinished(self) -> bool:
        return bool(self._inflight)

    def score(self, token_ids: list[list[int]], start: list[int]) -> list[list[float]]:
        if len(token_ids) != len(start):
            raise ValueError("token_ids and start must have the same length")
        body = {"token_ids": [list(map(int, t)) for t in token_ids], "start": list(start)}
        rows = self._request("POST", self.urls[next(self._rr) % len(self.urls)] + "/score", json=body).json()["logprobs"]
        return [floats_from_json(r) for r in rows]  # null: not a finite number

    def score_topk(self, token_ids: list[list[int]], start: list[int], *, topk: int, temperature: float = 1.0,
                   should_stop=None) -> list:
        """:meth:`score` with each position's ``topk`` most likely tokens (``POST /score`` with ``topk``/``temperature``);
        ``should_stop`` is checked before the request is sent."""
        from agent.engines.base import ScoredTokens, ScoreStopped

        if should_stop is not None and should_stop():
            raise ScoreStopped("scoring stopped: its requester went away")
        if len(token_ids) != len(start):
            raise ValueError("token_ids and start must have the same length")
        body = {"token_ids": [list(map(int, t)) for t in token_ids], "start": list(start), "topk": int(topk),
                "temperature": float(temperature)}
        d = self._request("POST", self.urls[next(self._rr) % len(self.urls)] + "/score", json=body).json()
        return [ScoredTokens(floats_from_json(lp), [list(map(int, r)) for r in ids], [floats_from_json(r) for r in vals])
                for lp, ids, vals in zip(d["logprobs"], d["topk_ids"], d["topk_logprobs"])]

    # ------------------------------------------------------------------ weights
    def load_weights(self, state_dict: dict[str, torch.Tensor], tag: str | None = None) -> list[int]:
        """Push HF-named weights to every replica; returns their new ``weights_version``."""
        if self._inflight:
            raise RuntimeError("load_weights while requests are in flight; let the rollout finish first")
        if self.weight_sync == "collective":
            return self._load_collective(state_dict, tag)
        return self._load_http(state_dict, tag)

    def load_lora(self, adapters: dict[str, torch.Tensor], config: dict, tag: str | None = None) -> list[int]:
        """Push LoRA adapters (peft saved names; ``config`` as :func:`agent.engines.base.lora_adapter_config`) to
        every replica, which serves its base with them: the sync is the adapters' bytes only, over ``weight_sync``."""
        if self._inflight:
            raise RuntimeError("load_lora while requests are in flight; let the rollout finish first")
        lora = lora_adapter_config(config)
        if self.weight_sync == "collective":
            return self._load_collective(adapters, tag, lora=lora)
        return self._load_http(adapters, tag, lora=lora)

    def _load_http(self, state_dict: dict[str, torch.Tensor], tag: str | None, *, lora: dict | None = None) -> list[int]:
        staged = self.stage_weights(state_dict, tag)
        return self.commit_weights(staged, lora=lora)

    def stage_weights(self, state_dict: dict[str, torch.Tensor], tag: str | None = None) -> StagedWeights:
        """Upload HF-named weights to every replica without loading them (the http transport's buckets): the served
        weights do not change, so this may run while requests are in flight (an asynchronous run uploads the next
        weights while the current batch generates). :meth:`commit_weights` loads them; :meth:`discard_weights` frees
        them. A replica keeps one staged sync: staging another discards it."""
        if self.weight_sync != "http":
            raise RuntimeError("stage_weights needs weight_sync='http' (the collective transport sends while loading)")
        from safetensors.torch import save

        sync_id = uuid.uuid4().hex
        meta = plan_buckets(state_dict, self.bucket_bytes)
        try:
            for i, bucket in enumerate(meta):
                # clone(): safetensors refuses tensors that share storage (tied embeddings).
                body = save({name: state_dict[name].detach().to("cpu").contiguous().clone() for name, _ in bucket["tensors"]})
                self._all(lambda u, i=i, body=body: self._request("POST", f"{u}/weights/{sync_id}/bucket/{i}", content=body),
                          tolerate_loss=True)
                del body
        except BaseException:
            self.discard_weights(StagedWeights(sync_id, len(meta), len(state_dict), tag))
            raise
        return StagedWeights(sync_id, len(meta), len(state_dict), tag)

    def commit_weights(self, staged: StagedWeights, *, lora: dict | None = None) -> list[int]:
        """Load a staged sync (:meth:`stage_weights`) on every replica; returns their new ``weights_version``. Refused
        while requests are in flight. A failed commit frees the staged buckets (nothing was loaded)."""
        if self._inflight:
            raise RuntimeError("commit_weights while requests are in flight; let the rollout finish first")
        commit = {"buckets": staged.buckets, "tensors": staged.tensors, "tag": staged.tag}
        if lora is not None:
            commit["lora"] = lora
        try:
            answers = self._all(lambda u: self._request("POST", f"{u}/weights/{staged.sync_id}/commit", json=commit, retry_5xx=False).json(),
                                tolerate_loss=True)
        except BaseException:
            self.discard_weights(staged)
            raise
        return [a["weights_version"] for a in answers]

    def discard_weights(self, staged: StagedWeights) -> None:
        """Free a staged sync on every replica (nothing is loaded); unreachable replicas are skipped."""
        for u in self.urls:
            try:
                self._http.delete(f"{u}/weights/{staged.sync_id}")
            except httpx.HTTPError:
                pass

    def _load_collective(self, state_dict: dict[str, torch.Tensor], tag: str | None, *, lora: dict | None = None) -> list[int]:
        from agent.engines.collective import CollectiveSender

        host, port, backend, timeout_s = self._collective_args
        if self._sender is None:
            self._sender = CollectiveSender(host, port, backend, timeout_s)
        sender = self._sender
        try:
            if sender.pg is None:
                self._join_group(sender)
            sync_id = uuid.uuid4().hex
            meta = plan_buckets(state_dict, self.bucket_bytes)
            body = {"sync_id": sync_id, "buckets": meta, "tag": tag}
            if lora is not None:
                body["lora"] = lora
            futs = [self._pool.submit(self._request, "POST", u + "/weights/collective/receive", json=body, retry_5xx=False) for u in self.urls]

            sender.wait_ready(sync_id, lambda: _raise_if_done(futs, "received nothing"))
            sender.send(state_dict, meta)
            return [f.result().json()["weights_version"] for f in futs]
        except BaseException:
            sender.drop_group()  # rebuilt on the next sync
            raise

    def _join_group(self, sender) -> None:
        ranks = [int(h.get("collective_ranks", 1)) for h in self.health()]
        world = 1 + sum(ranks)
        group = sender.new_group_name()
        offsets = list(itertools.accumulate([1, *ranks[:-1]]))
        body = {"host": sender.host, "port": sender.port, "world_size": world, "backend": sender.backend, "group": group, "timeout_s": sender.timeout_s}
        futs = [
            self._pool.submit(self._request, "POST", u + "/weights/collective/init", json={**body, "rank_offset": off}, retry_5xx=False)
            for u, off in zip(self.urls, offsets)
        ]
        sender.join(group, world, lambda: _raise_if_done(futs, "joined no group"))
        for f in futs:
            f.result()

    # ------------------------------------------------------------------ lifecycle
    def sleep(self) -> bool:
        return any(self._all(lambda u: self._request("POST", u + "/sleep").json()["released"]))

    def wake(self) -> None:
        self._all(lambda u: self._request("POST", u + "/wake"))

    def close(self) -> None:
        for f, _ in self._inflight.values():
            f.cancel()
        self._inflight.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()
        if self._sender is not None:
            self._sender.close()
            self._sender = None
