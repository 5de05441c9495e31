"""The generation server: one local engine (vLLM or transformers) behind HTTP (``emapg engine serve``).

The trainer talks to it through :class:`agent.engines.remote.RemoteEngine`; the wire format is
in agent/engines/wire.py. Endpoints:

* ``GET /health``: 503 while the engine loads (or after a failed load), then 200 with the model,
  ``max_model_len``, ``vocab_size``, ``weights_version`` (bumped by every committed sync) and
  ``collective_ranks`` (worker processes that join a collective weight sync).
* ``POST /generate``: ``{"prompts": [[ids]], "params": {...} | [{...} per prompt]}`` ->
  ``{"outputs": [{"token_ids", "logprobs", "finish_reason", "stop_reason"}], "weights_version"}``.
  A single ``params`` with ``seed=s`` gives prompt i the seed ``s + i`` (as the local engines).
* ``POST /score``: ``{"token_ids": [[ids]], "start": [int]}`` -> ``{"logprobs": [[float]]}``.
* ``POST /weights/{sync_id}/bucket/{index}`` (a safetensors body), ``POST /weights/{sync_id}/commit``,
  ``DELETE /weights/{sync_id}``: the http weight transport. Buckets are *staged*; only a commit
  that finds every bucket loads them, so an aborted sync leaves the old weights, and a new
  sync id discards whatever an older one had staged.
* ``POST /weights/collective/init`` and ``/weights/collective/receive``: the collective transport
  (agent/engines/collective.py).
* ``POST /sleep``, ``POST /wake``; ``GET /metrics`` (JSON counters).

Design: one worker thread owns the engine. Generation requests are fed to the engine's
continuous-batching interface (``submit``/``step``): requests that arrive while others run join
them at the next engine step (vLLM), or are collected for ``max_wait_ms`` and run as one batch
(transformers). Everything else (weight loads, score, sleep) is a *barrier*: it runs once the
in-flight generations have finished, and generations submitted after it wait for it, so a
request is served entirely by one set of weights. Bad input gets a 4xx with a message before
it reaches the engine.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import json
import logging
import queue
import threading
import time
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from agent.engines.base import SamplingParams, check_prompts, per_prompt_params
from agent.engines.wire import check_bucket_meta, output_to_json, params_from_json, parse_prompts
from emapg.servers import HTTPError, api_key_ok, read_body

log = logging.getLogger("agent.engines.server")


@dataclass
class EngineServeConfig:
    """Options of ``emapg engine serve`` (help texts in agent/engines/cli.py)."""

    model: str
    engine: str = "vllm"
    host: str = "127.0.0.1"
    port: int = 8001
    api_key: str | None = None
    max_model_len: int = 4096
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enable_sleep_mode: bool = False
    dtype: str | None = None
    device: str = "auto"
    seed: int = 0
    max_wait_ms: float = 2.0
    max_prompts_per_request: int = 4096
    max_body_bytes: int = 64 << 20
    max_bucket_bytes: int = 1 << 30
    log_level: str = "info"

    def validate(self) -> None:
        if self.engine not in ("vllm", "hf"):
            raise ValueError(f"--engine must be vllm or hf, got {self.engine!r}")
        for name in ("max_model_len", "tensor_parallel_size", "max_prompts_per_request", "max_body_bytes", "max_bucket_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("--gpu-memory-utilization must be in (0, 1]")
        if self.max_wait_ms < 0:
            raise ValueError("--max-wait-ms must be >= 0")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port {self.port} is not a TCP port")

    def engine_options(self) -> dict[str, Any]:
        if self.engine == "vllm":
            opts: dict[str, Any] = dict(
                max_model_len=self.max_model_len, tensor_parallel_size=self.tensor_parallel_size,
                gpu_memory_utilization=self.gpu_memory_utilization, enable_sleep_mode=self.enable_sleep_mode, seed=self.seed,
            )  # fmt: skip
            if self.dtype:
                opts["dtype"] = self.dtype
            return opts
        import torch

        device = self.device if self.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        return dict(max_model_len=self.max_model_len, seed=self.seed, dtype=self.dtype or "float32", device=device)


# ----------------------------------------------------------------------------- the engine thread


@dataclass
class _GenJob:
    outputs: list
    remaining: int
    future: Future


def _resolve(fut: Future, result: Any = None, exc: BaseException | None = None) -> None:
    if fut.done():  # cancelled: the client went away
        return
    try:
        fut.set_exception(exc) if exc is not None else fut.set_result(result)
    except Exception:  # noqa: BLE001 - cancelled in between
        pass


class EngineLoop:
    """The one thread that owns the engine: loads it, admits generations, steps it, runs barriers."""

    def __init__(self, load: Callable[[], Any], max_wait_s: float, on_fatal: Callable[[str], None] | None = None) -> None:
        self._load = load
        self.max_wait_s = max_wait_s
        self.on_fatal = on_fatal
        self.engine: Any = None
        self.status = "loading"
        self.error: str | None = None
        self.asleep = False
        self._q: queue.Queue = queue.Queue()
        self._jobs: dict[str, tuple[_GenJob, int]] = {}
        self._ids = itertools.count()
        self.counters: collections.Counter[str] = collections.Counter()
        self._thread = threading.Thread(target=self._main, name="engine-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=30)

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> Future:
        fut: Future = Future()
        self._q.put(("gen", (prompts, params), fut))
        return fut

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn()`` in the engine thread once in-flight generations are done (a barrier)."""
        fut: Future = Future()
        self._q.put(("call", fn, fut))
        return fut

    def _main(self) -> None:
        t0 = time.perf_counter()
        try:
            self.engine = self._load()
        except Exception as e:  # noqa: BLE001 - reported through /health and the exit code
            self.status, self.error = "failed", f"{type(e).__name__}: {e}"
            log.error("loading the engine failed: %s", self.error)
            if self.on_fatal is not None:
                self.on_fatal(self.error)
            return
        self.status = "ok"
        log.info("engine %s loaded in %.1f s", self.engine.info.kind, time.perf_counter() - t0)
        collect = 0.0 if self.engine.info.continuous_batching else self.max_wait_s
        waiting: collections.deque = collections.deque()
        try:
            while True:
                items = []
                if not self.engine.has_unfinished() and not waiting:
                    items.append(self._q.get())  # idle: block
                    if collect and items[0] is not None and items[0][0] == "gen":
                        time.sleep(collect)  # let concurrent requests join this batch
                while True:
                    try:
                        items.append(self._q.get_nowait())
                    except queue.Empty:
                        break
                if any(item is None for item in items):
                    raise _Stop
                waiting.extend(items)
                while waiting:
                    kind, payload, fut = waiting[0]
                    if kind == "gen":
                        waiting.popleft()
                        self._admit(payload, fut)
                    elif self.engine.has_unfinished():
                        break  # barrier: let the running generations finish first
                    else:
                        waiting.popleft()
                        self._run_call(payload, fut)
                if self.engine.has_unfinished():
                    self._step()
        except _Stop:
            pass
        finally:
            err = RuntimeError("the generation server is shutting down")
            for job, _ in list(self._jobs.values()):
                _resolve(job.future, exc=err)
            for _, _, fut in waiting:
                _resolve(fut, exc=err)
            self.engine.close()

    def _admit(self, payload: tuple[list[list[int]], list[SamplingParams]], fut: Future) -> None:
        prompts, params = payload
        if fut.done():
            return
        if self.asleep:
            _resolve(fut, exc=HTTPError(409, "the engine is asleep; POST /wake first"))
            return
        job = _GenJob([None] * len(prompts), len(prompts), fut)
        n = next(self._ids)
        try:
            for i, (ids, p) in enumerate(zip(prompts, params)):
                rid = f"g{n}-{i}"
                self.engine.submit(rid, ids, p)
                self._jobs[rid] = (job, i)
        except Exception as e:  # noqa: BLE001 - requests already submitted finish and are dropped
            _resolve(fut, exc=e)
        self.counters["prompts"] += len(prompts)

    def _step(self) -> None:
        try:
            finished = self.engine.step()
        except Exception as e:  # noqa: BLE001 - the engine broke: fail what it was running
            log.exception("engine step failed")
            jobs = {id(j): j for j, _ in self._jobs.values()}
            self._jobs.clear()
            for job in jobs.values():
                _resolve(job.future, exc=RuntimeError(f"engine step failed: {type(e).__name__}: {e}"))
            return
        self.counters["steps"] += 1
        for rid, out in finished:
            job, i = self._jobs.pop(rid, (None, 0))
            if job is None:
                continue
            self.counters["tokens"] += len(out.token_ids)
            job.outputs[i] = out
            job.remaining -= 1
            if job.remaining == 0:
                _resolve(job.future, job.outputs)

    def _run_call(self, fn: Callable[[], Any], fut: Future) -> None:
        if fut.done():
            return
        try:
            _resolve(fut, fn())
        except BaseException as e:  # noqa: BLE001 - handed to the request
            _resolve(fut, exc=e)


class _Stop(Exception):
    pass


# ----------------------------------------------------------------------------- weights


def checkpoint_manifest(model_dir: str) -> dict[str, tuple[int, ...]] | None:
    """Tensor names and shapes of a safetensors checkpoint folder (None when it has none)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    out: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                out[name] = tuple(fh.get_slice(name).get_shape())
    return out


def check_against_manifest(shapes: dict[str, tuple[int, ...]], manifest: dict[str, tuple[int, ...]] | None) -> None:
    """Refuse a sync that does not fit the served model *before* any weight is touched."""
    if manifest is None:
        return
    # A tied lm_head is absent from the checkpoint but present in a trainer's state dict.
    allowed = dict(manifest)
    if "lm_head.weight" not in allowed and "model.embed_tokens.weight" in allowed:
        allowed["lm_head.weight"] = allowed["model.embed_tokens.weight"]
    unknown = sorted(set(shapes) - set(allowed))
    missing = sorted(set(manifest) - set(shapes))
    wrong = sorted(n for n in shapes if n in allowed and tuple(shapes[n]) != tuple(allowed[n]))
    if unknown or missing or wrong:
        raise HTTPError(
            422,
            f"the weights do not fit the served model: unknown={unknown[:5]} missing={missing[:5]} "
            f"wrong shape={[(n, list(shapes[n]), list(allowed[n])) for n in wrong[:3]]}",
        )


@dataclass
class _Staging:
    sync_id: str
    buckets: dict[int, dict]
    nbytes: int = 0


# ----------------------------------------------------------------------------- app


def create_app(cfg: EngineServeConfig, on_fatal=None, load: Callable[[], Any] | None = None) -> FastAPI:
    cfg.validate()
    from emapg.models import resolve_model

    model_dir = resolve_model(cfg.model)

    def default_load():
        from agent.engines import make_engine

        return make_engine(cfg.engine, model_dir, **cfg.engine_options())

    loop_ = EngineLoop(load or default_load, cfg.max_wait_ms / 1000, on_fatal)
    manifest = checkpoint_manifest(model_dir)
    state: dict[str, Any] = {"version": 0, "tag": None, "staging": None, "collective_timeout": 600.0, "receiver": None}
    requests: collections.Counter[str] = collections.Counter()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop_.start()
        try:
            yield
        finally:
            await asyncio.to_thread(loop_.stop)

    app = FastAPI(title="ema-pg generation server", version="1", lifespan=lifespan,
                  description="Token-in/token-out generation with weight sync for the ema-pg trainer.")  # fmt: skip
    app.state.engine_loop = loop_

    async def json_body(request: Request) -> dict:
        body = await read_body(request, cfg.max_body_bytes)
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HTTPError(400, f"body is not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise HTTPError(422, f"body must be a JSON object, got a JSON {type(data).__name__}")
        return data

    def ready_engine():
        if loop_.status != "ok":
            raise HTTPError(503, f"engine is {loop_.status}{': ' + loop_.error if loop_.error else ''}; retry when GET /health returns 200")
        return loop_.engine

    async def run(fut: Future) -> Any:
        try:
            return await asyncio.wrap_future(fut)
        except HTTPError:
            raise
        except ValueError as e:  # engine-side validation
            raise HTTPError(422, str(e)) from None

    def endpoint(fn):
        """Auth, error mapping and request counting around a handler."""

        @functools.wraps(fn)  # FastAPI reads the path parameters from fn's signature
        async def wrapper(request: Request, **kwargs):
            name = request.url.path.split("/")[1] or "/"
            if not api_key_ok(request, cfg.api_key):
                requests[f"{name}:401"] += 1
                return JSONResponse({"detail": "missing or wrong API key: send 'Authorization: Bearer <key>' or 'X-API-Key: <key>'"}, 401)
            try:
                result = await fn(request, **kwargs)
            except HTTPError as e:
                requests[f"{name}:{e.status}"] += 1
                return JSONResponse({"detail": e.message}, e.status)
            except Exception as e:  # noqa: BLE001 - this request only
                log.exception("%s failed", request.url.path)
                requests[f"{name}:500"] += 1
                return JSONResponse({"detail": f"{type(e).__name__}: {e}"}, 500)
            requests[f"{name}:200"] += 1
            return result

        return wrapper

    # ------------------------------------------------------------------ generation
    @app.post("/generate")
    @endpoint
    async def generate(request: Request):
        """Token ids in, token ids + sampling log-probs + finish/stop reason out."""
        engine = ready_engine()
        data = await json_body(request)
        unknown = sorted(set(data) - {"prompts", "params"})
        if unknown:
            raise HTTPError(422, f"unknown field(s) {unknown}; allowed fields are ['prompts', 'params']")
        try:
            prompts = parse_prompts(data.get("prompts"), engine.vocab_size, cfg.max_prompts_per_request)
            raw = data.get("params", {})
            if isinstance(raw, list):
                params = [params_from_json(p, f"params[{i}]") for i, p in enumerate(raw)]
            else:
                params = params_from_json(raw)
            plist = per_prompt_params(params, len(prompts))
            check_prompts(prompts, engine.vocab_size, engine.max_model_len, [p.max_tokens for p in plist])
            for i, p in enumerate(plist):
                if p.allowed_token_ids is not None and not all(0 <= t < engine.vocab_size for t in p.allowed_token_ids):
                    raise ValueError(f"params[{i}].allowed_token_ids has ids outside the vocabulary (size {engine.vocab_size})")
        except ValueError as e:
            raise HTTPError(422, str(e)) from None
        outs = await run(loop_.generate(prompts, plist))
        body = {"outputs": [output_to_json(o) for o in outs], "weights_version": state["version"]}
        return Response(json.dumps(body).encode(), media_type="application/json")

    @app.post("/score")
    @endpoint
    async def score(request: Request):
        """log p(token_t | tokens_<t) for t >= start[i] under the served weights (raw model, temperature 1)."""
        engine = ready_engine()
        data = await json_body(request)
        try:
            ids = parse_prompts(data.get("token_ids"), engine.vocab_size, cfg.max_prompts_per_request)
            start = data.get("start")
            if not isinstance(start, list) or len(start) != len(ids) or not all(isinstance(s, int) and 1 <= s <= len(t) for s, t in zip(start, ids)):
                raise ValueError("'start' must be a list with one integer in [1, len(token_ids[i])] per sequence")
            check_prompts(ids, engine.vocab_size, engine.max_model_len, 1)
        except ValueError as e:
            raise HTTPError(422, str(e)) from None
        return {"logprobs": await run(loop_.call(lambda: engine.score(ids, start)))}

    # ------------------------------------------------------------------ sleep / wake
    @app.post("/sleep")
    @endpoint
    async def sleep(request: Request):
        """Release weights/KV memory (vLLM sleep mode on GPU; transformers offloads to CPU); a no-op elsewhere."""
        engine = ready_engine()

        def do():
            released = bool(engine.sleep())
            loop_.asleep = loop_.asleep or released
            return released

        return {"released": await run(loop_.call(do))}

    @app.post("/wake")
    @endpoint
    async def wake(request: Request):
        """Undo /sleep (a no-op when awake)."""
        engine = ready_engine()

        def do():
            engine.wake()
            loop_.asleep = False

        await run(loop_.call(do))
        return {"asleep": False}

    # ------------------------------------------------------------------ http weight transport
    def committed(tag: Any) -> dict:
        state["version"] += 1
        state["tag"] = tag if isinstance(tag, (str, int)) else None
        log.info("weights version %d (%s)", state["version"], state["tag"])
        return {"weights_version": state["version"], "tag": state["tag"]}

    @app.post("/weights/{sync_id}/bucket/{index}")
    @endpoint
    async def weights_bucket(request: Request, sync_id: str, index: int):
        """Stage one bucket (a safetensors body) of sync ``sync_id``; a new sync id discards older staged buckets."""
        from safetensors.torch import load as load_safetensors

        ready_engine()
        if index < 0:
            raise HTTPError(422, "bucket index must be >= 0")
        body = await read_body(request, cfg.max_bucket_bytes)
        try:
            tensors = await asyncio.to_thread(load_safetensors, body)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise HTTPError(422, f"bucket {index} is not a valid safetensors body ({type(e).__name__}: {e})") from None
        staging = state["staging"]
        if staging is None or staging.sync_id != sync_id:
            if staging is not None:
                log.warning("discarding %d staged buckets of unfinished sync %s", len(staging.buckets), staging.sync_id)
            staging = state["staging"] = _Staging(sync_id, {})
        old = staging.buckets.get(index)
        staging.nbytes += len(body) - (sum(t.numel() * t.element_size() for t in old.values()) if old else 0)
        staging.buckets[index] = tensors
        return {"sync_id": sync_id, "staged_buckets": len(staging.buckets), "staged_tensors": sum(len(b) for b in staging.buckets.values())}

    @app.post("/weights/{sync_id}/commit")
    @endpoint
    async def weights_commit(request: Request, sync_id: str):
        """Load a fully staged sync into the engine (``{"buckets": N, "tensors": M, "tag": ...}``) and bump the version."""
        engine = ready_engine()
        data = await json_body(request)
        n = data.get("buckets")
        if not isinstance(n, int) or n < 1:
            raise HTTPError(422, "'buckets' must be the number of buckets sent (>= 1)")
        staging = state["staging"]
        if staging is None or staging.sync_id != sync_id:
            raise HTTPError(409, f"nothing staged for sync {sync_id!r} (a newer sync replaced it, or the server restarted); resend its buckets")
        missing = sorted(set(range(n)) - set(staging.buckets))
        extra = sorted(set(staging.buckets) - set(range(n)))
        if missing or extra:
            raise HTTPError(409, f"sync {sync_id!r} is incomplete: missing buckets {missing[:10]}, unexpected {extra[:10]}; nothing was loaded")
        sd: dict = {}
        for i in range(n):
            dup = set(sd) & set(staging.buckets[i])
            if dup:
                raise HTTPError(422, f"tensor(s) {sorted(dup)[:5]} sent in more than one bucket")
            sd.update(staging.buckets[i])
        if data.get("tensors") is not None and data["tensors"] != len(sd):
            raise HTTPError(409, f"sync {sync_id!r} staged {len(sd)} tensors, the client sent {data['tensors']}; nothing was loaded")
        check_against_manifest({k: tuple(v.shape) for k, v in sd.items()}, manifest)
        state["staging"] = None
        await run(loop_.call(lambda: engine.load_weights(sd)))
        return committed(data.get("tag"))

    @app.delete("/weights/{sync_id}")
    @endpoint
    async def weights_abort(request: Request, sync_id: str):
        """Discard the staged buckets of sync ``sync_id`` (nothing is loaded)."""
        staging = state["staging"]
        if staging is not None and staging.sync_id == sync_id:
            state["staging"] = None
            return {"discarded": True}
        return {"discarded": False}

    # ------------------------------------------------------------------ collective weight transport
    @app.post("/weights/collective/init")
    @endpoint
    async def collective_init(request: Request):
        """Join the trainer's weight-sync process group (``{host, port, world_size, rank_offset, backend, group, timeout_s}``)."""
        engine = ready_engine()
        d = await json_body(request)
        try:
            host, port, world, offset = str(d["host"]), int(d["port"]), int(d["world_size"]), int(d["rank_offset"])
            backend, group, timeout_s = str(d["backend"]), str(d["group"]), float(d.get("timeout_s", 600.0))
        except (KeyError, TypeError, ValueError) as e:
            raise HTTPError(422, f"collective init needs host, port, world_size, rank_offset, backend, group ({type(e).__name__}: {e})") from None
        if backend not in ("gloo", "nccl") or not 1 <= offset < world or timeout_s <= 0:
            raise HTTPError(422, f"bad collective init: backend={backend!r} (gloo|nccl), rank_offset={offset}, world_size={world}")
        state["collective_timeout"] = timeout_s
        if hasattr(engine, "collective_init"):  # vLLM: every worker joins
            ranks = await run(loop_.call(lambda: engine.collective_init(host, port, world, offset, backend, group, timeout_s)))
        else:
            from agent.engines.collective import CollectiveReceiver

            receiver = state["receiver"] = state["receiver"] or CollectiveReceiver()
            await run(loop_.call(lambda: receiver.join(host, port, world, offset, backend, group, timeout_s)))
            ranks = [offset]
        return {"ranks": ranks}

    @app.post("/weights/collective/receive")
    @endpoint
    async def collective_receive(request: Request):
        """Receive one broadcast sync (``{sync_id, buckets: [{dtype, tensors: [[name, shape]]}], tag}``) and load it."""
        engine = ready_engine()
        d = await json_body(request)
        sync_id = d.get("sync_id")
        if not isinstance(sync_id, str) or not sync_id:
            raise HTTPError(422, "'sync_id' must be a non-empty string")
        try:
            meta = check_bucket_meta(d.get("buckets"))
        except ValueError as e:
            raise HTTPError(422, str(e)) from None
        names = [n for b in meta for n, _ in b["tensors"]]
        if len(set(names)) != len(names):
            raise HTTPError(422, "a tensor name appears twice in 'buckets'")
        check_against_manifest({n: tuple(s) for b in meta for n, s in b["tensors"]}, manifest)
        timeout_s = state["collective_timeout"]
        if hasattr(engine, "collective_receive"):
            await run(loop_.call(lambda: engine.collective_receive(meta, sync_id, timeout_s)))
        else:
            receiver = state["receiver"]
            if receiver is None or receiver.pg is None:
                raise HTTPError(409, "no weight-sync group: POST /weights/collective/init first")

            def do():
                weights = receiver.receive(meta, sync_id, engine.device)
                engine.load_weights(weights)

            await run(loop_.call(do))
        return committed(d.get("tag"))

    # ------------------------------------------------------------------ status
    @app.get("/health")
    async def health():
        """200 with the model and weights version once the engine is loaded; 503 while loading or after a failed load."""
        if loop_.status != "ok":
            body = {"status": loop_.status}
            if loop_.error:
                body["error"] = loop_.error
            return JSONResponse(body, status_code=503)
        info = loop_.engine.info
        return {
            "status": "ok", "engine": info.kind, "model": str(model_dir), "max_model_len": info.max_model_len,
            "vocab_size": loop_.engine.vocab_size, "weights_version": state["version"], "weights_tag": state["tag"],
            "asleep": loop_.asleep, "supports_sleep": info.supports_sleep, "continuous_batching": info.continuous_batching,
            "collective_ranks": int(info.extra.get("tensor_parallel_size", 1)), "max_bucket_bytes": cfg.max_bucket_bytes,
            "max_body_bytes": cfg.max_body_bytes, "max_prompts_per_request": cfg.max_prompts_per_request,
        }  # fmt: skip

    @app.get("/metrics")
    @endpoint
    async def metrics(request: Request):
        """JSON counters: requests by endpoint and status, prompts, generated tokens, engine steps, in-flight prompts, staged weight bytes."""
        staging = state["staging"]
        return {"requests": dict(requests), **dict(loop_.counters), "in_flight": loop_.in_flight, "weights_version": state["version"],
                "staged_bytes": staging.nbytes if staging is not None else 0}  # fmt: skip

    return app


def serve(cfg: EngineServeConfig) -> int:
    """Run the server until interrupted. Returns the process exit code."""
    from emapg.servers import run_uvicorn

    cfg.validate()
    banner = f"serving {cfg.model} ({cfg.engine} engine) on http://{cfg.host}:{cfg.port}"
    return run_uvicorn(create_app, cfg, log=log, exposes="generate and replace the weights", banner=banner)
