"""FastAPI retrieval server, a drop-in replacement for Search-R1's ``retrieval_server.py``.

``POST /retrieve`` takes ``{"queries": [str], "topk": int, "return_scores": bool}`` and answers
``{"result": [[{"document": {"id", "contents"}, "score": float}, ...], ...]}`` with scores, or
``{"result": [[{"id", "contents"}, ...], ...]}`` without (Search-R1 crashes on that branch); the
schema and the body checks are in :mod:`retriever.schema`.

Design (where it departs from Search-R1, and why):

* Batch workers own encoder, FAISS index and document store. Search-R1 runs a sync endpoint
  in FastAPI's thread pool, so GPU FAISS is searched from several threads at once (unsafe) and
  every request is encoded alone.
* ``POST /retrieve`` is answered straight from the ASGI entry point (:func:`emapg.server_input.serve_directly`):
  Starlette's router and FastAPI's dependency solving were half of a request's time on the event loop.
* Requests are micro-batched **across requests** by :class:`retriever.batcher.MicroBatcher` (at most
  ``max_batch`` queries, waiting at most ``max_wait_ms`` for company; one batch worker per CPU encoder
  thread, one with a GPU); a failed batch is retried request by request, so only the request that
  causes the failure gets a 500.
* In a closed loop the mean latency is clients / throughput (Little's law), so the tail at 32
  clients is shortened by throughput: larger batches, both cores encoding, no garbage-collector
  pauses over the model's objects. ``/metrics`` (:mod:`retriever.metrics`) says where a request's time
  went (queue wait, the worker's encode/search/lookup time, the wait for company, the event loop's
  delivery lag).
* Validation returns 4xx with a message that says what to fix.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from emapg.config import ConfigError, option
from emapg.server_input import HTTPError, guarded, install_error_handlers, json_response, openapi_body, read_body, serve_directly
from emapg.servers import ServerOptions, help_of
from retriever.batcher import MicroBatcher
from retriever.encoder import default_encode_threads
from retriever.metrics import Metrics
from retriever.schema import RetrieveRequest, RetrieveResponse, format_result, parse_retrieve_body, parse_search_body

log = logging.getLogger("retriever.server")


@dataclass(kw_only=True)
class ServeConfig(ServerOptions):
    """Options of ``emapg serve`` (the command-line flags are generated from these fields)."""

    port: int = option(8000, help=help_of(ServerOptions, "port"))
    api_key_env: str = option("EMAPG_RETRIEVER_API_KEY", help=help_of(ServerOptions, "api_key_env"))
    max_body_bytes: int = option(4 << 20, help=help_of(ServerOptions, "max_body_bytes"))
    index: str = option(help="index directory built by `emapg index build`")
    topk: int = option(3, help="hits per query when a request gives no topk")
    max_topk: int = option(100, help="largest topk a request may ask for")
    max_batch: int = option(64, help="most queries encoded together across requests; 1 disables micro-batching")
    max_wait_ms: float = option(5.0, ge=0, help="how long the first query of a batch may wait for company when traffic is "
                                          "concurrent, in ms; a lone client never waits")  # fmt: skip
    regroup_wait_ms: float = option(5.0, ge=0, help="how long a batch worker, back from a batch with fewer than its share of the "
                                              "queries queued, may wait for the clients it just answered, in ms, so that "
                                              "alternating groups of clients merge into full batches; 0 disables")  # fmt: skip
    max_queries_per_request: int = option(4096, help="reject requests with more queries (Search-R1 sends a whole rollout "
                                                     "batch, e.g. 512 x 5, in one request)")  # fmt: skip
    max_query_chars: int = option(2000, help="reject queries longer than this many characters")
    device: str = option("auto", help="encoder device: auto, cpu, cuda (all GPUs) or cuda:N")
    fp16: bool | None = option(None, help="fp16 encoder and GPU index (default: on with GPU, off on CPU; --no-fp16 on GPU: fp32)")
    bf16: bool | None = option(None, help="bf16 query encoder (default: on for a CPU with bf16 instructions, AVX512-BF16/AMX: "
                                          "1.98x the requests/s at 32 clients, top-3 ids as fp32's for 97.8% of 3,125 QA questions, "
                                          "gold recall@3 0.3488 vs 0.3485; "
                                          "fp32 on other CPUs, where bf16 is emulated; --no-bf16: fp32); /health's dtype "
                                          "says which ran")  # fmt: skip
    gpu_shards: int = option(-1, help="GPUs for the FAISS index when the encoder is on GPU: -1 all, 0 keep the index on CPU, "
                                      "N the first N")  # fmt: skip
    gpu_replicate: bool = option(False, help="replicate the index on each GPU instead of sharding it (more memory, more throughput)")
    hybrid_bm25: bool = option(False, help="fuse dense and BM25 rankings by reciprocal-rank fusion (index built with --bm25)")
    rrf_k: int = option(60, help="RRF constant k in 1/(k + rank)")
    nprobe: int | None = option(None, help="IVF lists probed per query (default: the value in meta.json)")
    encode_batch_size: int = option(64, help="queries per encoder forward pass inside a batch")
    encode_threads: int = option(0, help="CPU encoder: forward passes run at once, each micro-batch split between them "
                                         "(each on OMP_NUM_THREADS torch threads); 0: CPU cores / torch threads")  # fmt: skip
    batch_workers: int = option(0, help="micro-batches run at once: 0 one per CPU encoder thread (--encode-threads; 1 with a GPU), "
                                        "1 one at a time, each split over the encoder threads")  # fmt: skip
    batch_invariant: bool = option(False, help="encode and search each query on its own, so its passages never depend on the "
                                               "queries batched with it: 420 questions asked alone and in one request changed "
                                               "18 top-3 lists in bf16, 0 in fp32, 0 with this; it costs throughput on "
                                               "batched traffic (one request of 420: 0.27x in bf16, 0.34x in fp32)")  # fmt: skip
    query_cache_size: int = option(4096, help="LRU of query embeddings: repeated queries (GRPO groups) skip the encoder; 0 disables")
    encoder: str | None = option(None, help="assert the index was built with this encoder; refuse to start otherwise")
    mcp: bool = option(False, help="also answer the Model Context Protocol (MCP) on /mcp (streamable HTTP, stateless, JSON): tools "
                                   "search(query, topk) and search_batch(queries, topk) over the same index, limits and API key as "
                                   "/retrieve (docs/mcp.md)")  # fmt: skip
    mmap: bool = option(False, help="memory-map the index's codes instead of reading them into RAM (FAISS IO_FLAG_MMAP_IFC): "
                                    "server processes on one machine share one copy in the page cache; on-disk IVF "
                                    "indexes (built with --ondisk) are always mapped")  # fmt: skip

    def validate(self) -> None:
        super().validate()
        for name in ("topk", "max_topk", "max_batch", "max_queries_per_request", "max_query_chars", "encode_batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if self.topk > self.max_topk:
            raise ConfigError(f"--topk {self.topk} exceeds --max-topk {self.max_topk}")
        if self.bf16 and self.fp16:
            raise ConfigError("--fp16 and --bf16 exclude each other")
        if self.query_cache_size < 0:
            raise ConfigError("--query-cache-size must be >= 0")
        if self.batch_workers < 0:
            raise ConfigError("--batch-workers must be >= 0 (0: one per CPU encoder thread)")
        if self.encode_threads < 0:
            raise ConfigError("--encode-threads must be >= 0 (0: CPU cores / torch threads)")


def _dtype_reason(cfg: ServeConfig, encoder) -> str:
    """Why the query encoder runs in its dtype (``--fp16``/``--bf16`` given, or the automatic rule)."""
    if (cfg.fp16, cfg.bf16) != (None, None):
        return "--fp16/--bf16 as given"
    return "automatic: " + ("fp16 on GPU" if encoder.fp16 else "this CPU has bf16 instructions" if encoder.bf16
                            else "fp32 (no native bf16 on this CPU)")


# ----------------------------------------------------------------------------- app


class _State:
    def __init__(self) -> None:
        self.status = "loading"
        self.error: str | None = None
        self.searcher = None
        self.batcher: MicroBatcher | None = None
        self.executor: ThreadPoolExecutor | None = None


def create_app(cfg: ServeConfig, on_fatal=None) -> FastAPI:
    """Build the app. The index loads in the worker thread after startup; /health says when it is ready."""
    cfg.validate()
    metrics = Metrics()
    state = _State()

    def load():
        from retriever.searcher import Searcher

        return Searcher(
            cfg.index,
            device=cfg.device,
            fp16=cfg.fp16,
            bf16=cfg.bf16,
            gpu_shards=cfg.gpu_shards,
            gpu_replicate=cfg.gpu_replicate,
            hybrid_bm25=cfg.hybrid_bm25,
            rrf_k=cfg.rrf_k,
            nprobe=cfg.nprobe,
            encode_batch_size=cfg.encode_batch_size,
            query_cache_size=cfg.query_cache_size,
            encode_threads=cfg.encode_threads or default_encode_threads(),
            mmap=cfg.mmap,
            batch_invariant=cfg.batch_invariant,
        )

    async def load_in_worker():
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        try:
            state.searcher = await loop.run_in_executor(state.executor, load)
        except Exception as e:  # noqa: BLE001 - reported through /health and the exit code
            state.status, state.error = "failed", f"{type(e).__name__}: {e}"
            log.error("loading the index failed: %s", state.error)
            if on_fatal is not None:
                on_fatal(state.error)
            return
        # The model, tokenizer and libraries are ~485k tracked objects: a full collection would traverse
        # them all (0.5-0.9 s measured on the loaded 2-core box, holding the GIL: a latency spike for every
        # request in flight). They live as long as the server, so they move to the permanent generation
        # (no collection first: after a load it finds ~20 unreachable objects and would block the loop).
        gc.freeze()
        workers = min(cfg.batch_workers or state.searcher.concurrent_batches, state.searcher.concurrent_batches)
        if cfg.batch_workers > workers:
            log.warning("--batch-workers %d: %d batch workers (one per encoder thread%s)", cfg.batch_workers, workers,
                        "" if state.searcher.encoder.devices[0] == "cpu" else "; one with a GPU")  # fmt: skip
        state.batcher = MicroBatcher(state.searcher.retrieve, state.executor, cfg.max_batch, cfg.max_wait_ms / 1000, metrics,
                                     cfg.regroup_wait_ms / 1000, workers=workers)  # fmt: skip
        state.batcher.start()
        state.status = "ok"
        log.info("index loaded in %.1f s: %s", time.perf_counter() - t0, state.searcher.info())
        enc = state.searcher.encoder
        log.info("query encoder %s on %s in %s (%s)", enc.spec.name, ",".join(enc.devices), enc.dtype, _dtype_reason(cfg, enc))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # the loader, then the batch workers, at most one per encoder thread (threads start as needed)
        state.executor = ThreadPoolExecutor(max_workers=max(os.cpu_count() or 1, cfg.encode_threads), thread_name_prefix="retriever-worker")
        loader = asyncio.get_running_loop().create_task(load_in_worker())
        try:
            if mcp_manager is not None:
                async with mcp_manager.run():
                    yield
            else:
                yield
        finally:
            loader.cancel()
            if state.batcher is not None:
                await state.batcher.stop()
            state.executor.shutdown(wait=False, cancel_futures=True)

    mcp_asgi = mcp_manager = None
    if cfg.mcp:
        from retriever.mcp_server import build_mcp

        mcp_asgi, mcp_manager = build_mcp(state, cfg, metrics.count)

    app = FastAPI(
        title="ema-pg retriever",
        version="1",
        description="Search-R1 compatible dense/BM25 retrieval with cross-request micro-batching.",
        lifespan=lifespan,
    )
    app.state.retriever = state
    app.state.metrics = metrics
    api_key = cfg.api_key_value()
    install_error_handlers(app, metrics.count)
    endpoint = guarded(api_key, metrics.count, log)

    @app.post(
        "/retrieve",
        response_model=RetrieveResponse,
        openapi_extra=openapi_body(RetrieveRequest),
        responses={400: {"description": "not JSON"}, 401: {"description": "API key"}, 408: {"description": "body too slow"},
                   413: {"description": "too large"}, 422: {"description": "invalid field"}, 503: {"description": "still loading"}},
    )  # fmt: skip
    @endpoint
    async def retrieve(request: Request):
        """Top-k passages for each query (Search-R1 request/response format)."""
        body = await read_body(request, cfg.max_body_bytes, timeout_s=cfg.body_timeout, hint="; send fewer or shorter queries")
        queries, topk, return_scores = parse_retrieve_body(body, cfg)
        if state.status != "ok":
            raise HTTPError(503, f"index is {state.status}{': ' + state.error if state.error else ''}; retry when GET /health returns 200")
        try:
            hits = await state.batcher.submit(queries, topk)
        except Exception as e:  # noqa: BLE001 - this request only (its batch mates were re-run without it)
            raise HTTPError(500, f"retrieval failed: {type(e).__name__}: {e}", "retrieval") from None
        return json_response(format_result(hits, return_scores))

    serve_directly(app, "POST", "/retrieve", retrieve)
    if mcp_asgi is not None:
        from retriever.mcp_server import MCP_PATH

        class MCPRoute:  # the MCP endpoint, past Starlette's router (its transport reads the ASGI messages itself)
            def __init__(self, app):
                self.app = app

            async def __call__(self, scope, receive, send):
                if scope["type"] == "http" and scope["path"].rstrip("/") == MCP_PATH:
                    await mcp_asgi(scope, receive, send)
                else:
                    await self.app(scope, receive, send)

        app.add_middleware(MCPRoute)

    @app.post("/search", responses={401: {"description": "API key"}, 413: {"description": "too large"},
                                    422: {"description": "invalid field"}, 503: {"description": "still loading"}})  # fmt: skip
    @endpoint
    async def search(request: Request):
        """Top-k passages for query vectors the caller encoded with this index's encoder (the router does:
        ``retriever.router``): ``{"vectors_b64": base64 of float32 [B, dim] little-endian, "dim", "topk"}``;
        the answer has /retrieve's scored shape; with ``"documents": false``, ``{"rows": [[row, ...]], "scores":
        [[score, ...]]}`` instead: this index's row numbers, best first, no passages (the router's ``--docs``)."""
        body = await read_body(request, cfg.max_body_bytes, timeout_s=cfg.body_timeout, hint="; send fewer vectors")
        if state.status != "ok":
            raise HTTPError(503, f"index is {state.status}{': ' + state.error if state.error else ''}; retry when GET /health returns 200")
        q, topk, documents = parse_search_body(body, cfg, state.searcher.meta["dim"])
        # the loop's default thread pool: the server's own executor is taken by the long-running batch workers
        if not documents:
            rows, scores = await asyncio.to_thread(state.searcher.search_rows, q, topk)
            found = rows >= 0
            return json_response({"rows": [r[f].tolist() for r, f in zip(rows, found)], "scores": [s[f].tolist() for s, f in zip(scores, found)]})
        hits = await asyncio.to_thread(state.searcher.search_vectors, q, topk)
        return json_response(format_result(hits, True))

    serve_directly(app, "POST", "/search", search)

    @app.get("/health")
    @guarded(api_key, metrics.count, log, open_=True)
    async def health(request: Request):
        """200 with index info once the index is loaded; 503 while loading or after a failed load."""
        if state.status == "ok":
            info = state.searcher.info()
            info.update(dtype_reason=_dtype_reason(cfg, state.searcher.encoder), batch_workers=state.batcher.workers, max_batch=cfg.max_batch, max_wait_ms=cfg.max_wait_ms, regroup_wait_ms=cfg.regroup_wait_ms, topk=cfg.topk, max_topk=cfg.max_topk)
            return {"status": "ok", "index": info, "fingerprint": state.searcher.fingerprint}
        body = {"status": state.status}
        if state.error:
            body["error"] = state.error
        return JSONResponse(body, status_code=503)

    @app.get("/metrics", response_class=PlainTextResponse)
    @endpoint
    async def metrics_endpoint(request: Request):
        """Prometheus text format: requests by route and status, errors by reason, queries, batch sizes, latency."""
        text = metrics.render()
        if state.searcher is not None:
            text += (
                "# HELP retriever_query_cache_hits_total Queries answered without encoding (LRU of query embeddings).\n"
                "# TYPE retriever_query_cache_hits_total counter\n"
                f"retriever_query_cache_hits_total {state.searcher.cache_hits}\n"
                "# HELP retriever_stage_seconds_total Worker time by stage of a micro-batch (encode, search, lookup).\n"
                "# TYPE retriever_stage_seconds_total counter\n"
            )
            text += "".join(f'retriever_stage_seconds_total{{stage="{k}"}} {v:.6f}\n' for k, v in sorted(state.searcher.stage_seconds.items()))
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app


def serve(cfg: ServeConfig) -> int:
    """Run the server until interrupted. Returns the process exit code."""
    from emapg.servers import run_uvicorn
    from retriever.searcher import check_encoder

    cfg.validate()
    meta = check_encoder(cfg.index, cfg.encoder)  # refuse before binding the port
    if cfg.hybrid_bm25 and not meta.get("bm25"):
        raise ValueError(f"--hybrid-bm25 needs a BM25 index: rebuild {cfg.index} with `emapg index build --bm25`")
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)  # its CPU-feature probing is noise
    banner = f"serving {cfg.index} on http://{cfg.host}:{cfg.port}{' (MCP on /mcp)' if cfg.mcp else ''} (max batch {cfg.max_batch}, max wait {cfg.max_wait_ms:.1f} ms)"
    return run_uvicorn(create_app, cfg, log=log, exposes="query the index", banner=banner)
