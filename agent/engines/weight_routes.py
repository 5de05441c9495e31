"""The generation server's weight endpoints: how new policy weights reach the served engine.

* ``POST /weights/{sync_id}/bucket/{index}`` (a safetensors body), ``POST /weights/{sync_id}/commit``,
  ``DELETE /weights/{sync_id}``: the http transport (agent/engines/staging.py). A commit with
  ``"lora": {"r", "lora_alpha", "target_modules"}`` loads the staged tensors as LoRA adapters (peft names)
  over the served base (``--max-lora-rank``).
* ``POST /weights/collective/init`` (only to the addresses ``--collective-allow`` names) and
  ``/weights/collective/receive``: the collective transport (agent/engines/collective.py); a receive with
  ``"lora"`` (as a commit's) broadcasts only LoRA adapters and loads them as the served adapters' next version.

Every committed sync bumps :attr:`ServedWeights.version` (``weights_version`` in ``/health``). The routes are
registered on the server's app by :func:`add_weight_routes` (agent/engines/server.py).
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from agent.engines.base import MAX_LORA_RANK, MAX_LORA_TARGETS, lora_adapter_config
from agent.engines.engine_loop import log
from agent.engines.staging import Manifest, WeightStaging, check_against_manifest, lora_rank
from agent.engines.wire import MAX_SEED, check_bucket_meta, check_weights, meta_bytes
from emapg.config import ConfigError
from emapg.server_input import HTTPError, as_float, as_int, as_text, openapi_body, read_body, show

__all__ = ["ServedWeights", "add_weight_routes", "allowed_address", "allow_entry", "MAX_BUCKETS"]

MAX_BUCKETS = 100_000
SYNC_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


@dataclass
class ServedWeights:
    """The served weights' version and what the weight endpoints keep between calls."""

    staging: WeightStaging  # the http transport's staged buckets
    manifest: Manifest | None  # the served model's tensor names and shapes (every sync is checked against them)
    version: int = 0  # bumped by every committed sync
    tag: str | int | None = None  # the last committed sync's label
    collective_timeout: float = 600.0  # seconds a collective receive may wait (set by collective init)
    receiver: Any = None  # transformers engine: the agent.engines.collective.CollectiveReceiver, once joined

    def committed(self, tag: str | int | None) -> dict:
        self.version += 1
        self.tag = tag
        log.info("weights version %d (%s)", self.version, self.tag)
        return {"weights_version": self.version, "tag": self.tag}


# ----------------------------------------------------------------------------- collective address allow-list


def allow_entry(entry: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | str:
    """A ``--collective-allow`` entry: a network (an IP is a /32 or /128), else a host name (resolved when used)."""
    try:
        return ipaddress.ip_network(entry, strict=False)
    except ValueError:
        if not re.fullmatch(r"[A-Za-z0-9.-]{1,253}", entry):
            raise ConfigError(f"--collective-allow {entry!r} is neither an IP address, a CIDR network nor a host name") from None
        return entry


def _resolve(host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise HTTPError(422, f"collective init: cannot resolve host {show(host)} ({e})") from None
    return [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]


def allowed_address(host: str, allow: list[str]) -> str:
    """The address of ``host`` to connect to, if ``allow`` permits one of them; HTTPError 403 otherwise.

    The check is on the resolved addresses, and the server connects to the address it checked (not the
    name again), so a name that resolves differently the second time cannot redirect it.
    """
    if not allow:
        raise HTTPError(403, "collective weight sync is off on this server (start it with --collective-allow ADDRESS...)", "forbidden")
    networks = []
    for entry in map(allow_entry, allow):
        if isinstance(entry, str):
            networks += [ipaddress.ip_network(a) for a in _resolve(entry)]
        else:
            networks.append(entry)
    for address in _resolve(host):
        if any(address.version == n.version and address in n for n in networks):
            return str(address)
    raise HTTPError(403, f"collective init to {show(host)} refused: this server joins weight-sync groups only at {allow} (--collective-allow)")


# ----------------------------------------------------------------------------- API schema (OpenAPI, documentation)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LoraBody(_Strict):
    r: int = Field(..., ge=1, le=MAX_LORA_RANK)
    lora_alpha: float = Field(..., gt=0)
    target_modules: list[str] = Field(..., min_length=1, max_length=MAX_LORA_TARGETS)


class CommitBody(_Strict):
    buckets: int = Field(..., ge=1, le=MAX_BUCKETS)
    tensors: int | None = Field(None, ge=1)
    tag: str | int | None = None
    lora: LoraBody | None = None


class CollectiveInitBody(_Strict):
    host: str = Field(..., min_length=1, max_length=255)
    port: int = Field(..., ge=1, le=65535)
    world_size: int = Field(..., ge=2, le=65536)
    rank_offset: int = Field(..., ge=1)
    backend: Literal["gloo", "nccl"]
    group: str = Field(..., min_length=1, max_length=200)
    timeout_s: float | None = Field(None, gt=0, le=86400)


class BucketMeta(_Strict):
    dtype: Literal["float32", "bfloat16", "float16"]
    tensors: list[tuple[str, list[int]]] = Field(..., min_length=1)


class CollectiveReceiveBody(_Strict):
    sync_id: str = Field(..., pattern=SYNC_ID.pattern)
    buckets: list[BucketMeta] = Field(..., min_length=1)
    tag: str | int | None = None
    lora: LoraBody | None = None

SAFETENSORS_BODY = {"requestBody": {"required": True, "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}}


# ----------------------------------------------------------------------------- request checks


def check_sync_id(sync_id: Any, where: str = "sync id") -> str:
    if not isinstance(sync_id, str) or not SYNC_ID.fullmatch(sync_id):
        raise HTTPError(422, f"{where} must be 1-128 characters of letters, digits and ._:-, got {show(sync_id)}")
    return sync_id


def parse_tag(tag: Any) -> str | int | None:
    """A sync's label (``weights_tag`` in /health): a short string, an integer, or null."""
    if tag is None or isinstance(tag, str):
        return None if tag is None else as_text(tag, "'tag'", max_chars=200, nonempty=False)
    return as_int(tag, "'tag'", -MAX_SEED, MAX_SEED)


def parse_lora(value: Any, info: Any) -> dict:
    """A commit's ``lora`` config (:func:`agent.engines.base.lora_adapter_config`), and the engine must serve that rank."""
    try:
        lora = lora_adapter_config(value)
    except ValueError as e:
        raise HTTPError(422, f"'lora': {e}") from None
    problem = info.lora_problem(lora["r"])
    if problem:
        raise HTTPError(422, f"cannot serve LoRA adapters: {problem} (start it with --max-lora-rank {lora['r']})", "lora_unsupported")
    return lora


def check_sync_kind(shapes: dict[str, tuple[int, ...]], lora: dict | None) -> None:
    """A sync of LoRA adapters comes with its ``lora`` config (of the adapters' rank), a sync of model weights without."""
    rank = lora_rank(shapes)
    if (lora is None) != (rank is None) or (lora is not None and rank != lora["r"]):
        raise HTTPError(422, "a sync of LoRA adapters needs a matching 'lora' config (r = the adapters' rank), "
                             "and a sync of model weights none", "weights_mismatch")


def load_bucket(body: bytes, index: int) -> dict:
    """A safetensors body -> checked tensors (worker thread: parsing and the finite check touch every byte)."""
    from safetensors.torch import load as load_safetensors

    try:
        tensors = load_safetensors(body)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise HTTPError(422, f"bucket {index} is not a valid safetensors body ({type(e).__name__}: {e})") from None
    try:
        check_weights(tensors)
    except ValueError as e:
        raise HTTPError(422, f"bucket {index}: {e}", "invalid_weights") from None
    return tensors


# ----------------------------------------------------------------------------- routes


def add_weight_routes(app: FastAPI, weights: ServedWeights, *, endpoint: Callable, json_body: Callable[..., Awaitable[dict]],
                      ready_engine: Callable[[], Any], run: Callable[[Future], Awaitable[Any]], call: Callable[[Callable[[], Any]], Future],
                      max_bucket_bytes: int, body_timeout: float, collective_allow: list[str]) -> None:  # fmt: skip
    """Register the weight endpoints on the generation server ``app``: ``call`` runs a function on the engine's
    thread (a future), ``run`` awaits one and turns its errors into HTTP errors."""
    staging = weights.staging

    # ------------------------------------------------------------------ http weight transport
    @app.post("/weights/{sync_id}/bucket/{index}", openapi_extra=SAFETENSORS_BODY)
    @endpoint
    async def weights_bucket(request: Request, sync_id: str, index: int):
        """Stage one bucket (a safetensors body) of sync ``sync_id``; a new sync id discards older staged buckets."""
        ready_engine()
        check_sync_id(sync_id)
        if not 0 <= index < MAX_BUCKETS:
            raise HTTPError(422, f"bucket index must be between 0 and {MAX_BUCKETS - 1}, got {index}")
        body = await read_body(request, max_bucket_bytes, timeout_s=body_timeout, hint=" (--max-bucket-mb)")
        tensors = await asyncio.to_thread(load_bucket, body, index)
        return staging.stage(sync_id, index, tensors)

    @app.post("/weights/{sync_id}/commit", openapi_extra=openapi_body(CommitBody))
    @endpoint
    async def weights_commit(request: Request, sync_id: str):
        """Load a fully staged sync into the engine (``{"buckets": N, "tensors": M, "tag": ...}``) and bump the version."""
        engine = ready_engine()
        check_sync_id(sync_id)
        data = await json_body(request, ("buckets", "tensors", "tag", "lora"), ("buckets",))
        n = as_int(data["buckets"], "'buckets'", 1, MAX_BUCKETS)
        n_tensors = None if data.get("tensors") is None else as_int(data["tensors"], "'tensors'", 1, 1 << 24)
        tag = parse_tag(data.get("tag"))
        lora = None if data.get("lora") is None else parse_lora(data["lora"], engine.info)
        sd = staging.take(sync_id, n, n_tensors)
        check_sync_kind({k: tuple(v.shape) for k, v in sd.items()}, lora)
        await run(call(lambda: engine.load_weights(sd) if lora is None else engine.load_lora(sd, lora)))
        return weights.committed(tag)

    @app.delete("/weights/{sync_id}")
    @endpoint
    async def weights_abort(request: Request, sync_id: str):
        """Discard the staged buckets of sync ``sync_id`` (nothing is loaded)."""
        return {"discarded": staging.discard(sync_id)}

    # ------------------------------------------------------------------ collective weight transport
    @app.post("/weights/collective/init", openapi_extra=openapi_body(CollectiveInitBody))
    @endpoint
    async def collective_init(request: Request):
        """Join the trainer's weight-sync process group (``{host, port, world_size, rank_offset, backend, group, timeout_s}``)."""
        engine = ready_engine()
        d = await json_body(request, ("host", "port", "world_size", "rank_offset", "backend", "group", "timeout_s"),
                            ("host", "port", "world_size", "rank_offset", "backend", "group"))  # fmt: skip
        host = as_text(d["host"], "'host'", max_chars=255)
        port = as_int(d["port"], "'port'", 1, 65535)
        world = as_int(d["world_size"], "'world_size'", 2, 65536)
        offset = as_int(d["rank_offset"], "'rank_offset'", 1, world - 1)
        if d["backend"] not in ("gloo", "nccl"):
            raise HTTPError(422, f"'backend' must be \"gloo\" or \"nccl\", got {show(d['backend'])}")
        backend = d["backend"]
        group = as_text(d["group"], "'group'", max_chars=200)
        timeout_s = 600.0 if d.get("timeout_s") is None else as_float(d["timeout_s"], "'timeout_s'", 1e-3, 86400.0)
        address = await asyncio.to_thread(allowed_address, host, collective_allow)
        weights.collective_timeout = timeout_s
        if hasattr(engine, "collective_init"):  # vLLM: every worker joins
            ranks = await run(call(lambda: engine.collective_init(address, port, world, offset, backend, group, timeout_s)))
        else:
            from agent.engines.collective import CollectiveReceiver

            receiver = weights.receiver = weights.receiver or CollectiveReceiver()
            await run(call(lambda: receiver.join(address, port, world, offset, backend, group, timeout_s)))
            ranks = [offset]
        return {"ranks": ranks}

    @app.post("/weights/collective/receive", openapi_extra=openapi_body(CollectiveReceiveBody))
    @endpoint
    async def collective_receive(request: Request):
        """Receive one broadcast sync (``{sync_id, buckets: [{dtype, tensors: [[name, shape]]}], tag, lora}``) and load it
        (``lora``: the buckets are LoRA adapters, served over the base from now on)."""
        engine = ready_engine()
        d = await json_body(request, ("sync_id", "buckets", "tag", "lora"), ("sync_id", "buckets"))
        sync_id = check_sync_id(d["sync_id"], "'sync_id'")
        try:
            meta = check_bucket_meta(d["buckets"], MAX_BUCKETS)
        except ValueError as e:
            raise HTTPError(422, str(e)) from None
        tag = parse_tag(d.get("tag"))
        names = [n for b in meta for n, _ in b["tensors"]]
        if len(set(names)) != len(names):
            raise HTTPError(422, "a tensor name appears twice in 'buckets'")
        lora = None if d.get("lora") is None else parse_lora(d["lora"], engine.info)
        shapes = {n: tuple(s) for b in meta for n, s in b["tensors"]}
        check_against_manifest(shapes, weights.manifest, complete=True)
        check_sync_kind(shapes, lora)
        if meta_bytes(meta) > staging.max_bytes:
            raise HTTPError(413, f"the sync describes {meta_bytes(meta)} bytes, more than the limit of {staging.max_bytes} (--max-staged-mb)")
        timeout_s = weights.collective_timeout
        if hasattr(engine, "collective_receive"):  # vLLM: the workers receive
            await run(call(lambda: engine.collective_receive(meta, sync_id, timeout_s, lora=lora)))
        else:
            receiver = weights.receiver
            if receiver is None or receiver.pg is None:
                raise HTTPError(409, "no weight-sync group: POST /weights/collective/init first")

            def do():
                weights_in = receiver.receive(meta, sync_id, engine.device)  # refuses non-finite values
                if lora is None:
                    engine.load_weights(weights_in)
                else:
                    engine.load_lora(weights_in, lora)

            await run(call(do))
        return weights.committed(tag)
