"""External agents (``rollout.agent=module:function``): any program that talks to the OpenAI API, trained here.

The function is called once per trajectory, concurrently (``rollout.agent_workers`` at a time)::

    def solve(client: openai.OpenAI, row: dict, session_id: str, **optional) -> str | None

* ``client``: the official ``openai`` client pointed at the policy's OpenAI-compatible endpoint
  (agent/engines/openai_endpoint.py) with the session id already in its headers, so every call it
  makes is recorded; ``row``: the task row without its gold answers (``question``, ``id``);
* optional keyword arguments, passed when the function declares them: ``retriever`` (the run's
  retriever client: ``retrieve(queries, topk=...)``) and ``sampling`` (``temperature``, ``top_p``,
  ``max_tokens`` -- the rollout settings, to pass on to the model calls);
* it returns its final answer (scored by the task's QA metrics, like the built-in agent's) or None.

The session's calls are assembled into the trajectory token-exactly (agent/recorded_sessions.py): the
sampled tokens are trained on, everything in between (tool results, framing) is masked. A session that
did not assemble into one context (the agent rewrote or truncated its history) splits into several
trajectories: the one holding its last call is the episode's (graded, in its GRPO group), the others are its
``extra_segments``, each trained as a row of its own carrying the episode's advantage
(trainer.sampled_batch.training_rows; counted as ``rollout/session_splits`` and ``rollout/segments_per_session``).
An agent that raises gives an errored trajectory (scored 0, not trained on), like any failed rollout. The endpoint is the generation servers' (``rollout.engine=remote``) or, for
an engine in this process, a loopback server started around it for the batch (:class:`LocalEndpoint`).
"""

from __future__ import annotations

import concurrent.futures as cf
import importlib
import inspect
import logging
import secrets
import threading
import time
import uuid
from typing import Any, Callable, Sequence

from emapg.config import ConfigError

log = logging.getLogger(__name__)

__all__ = ["load_agent", "LocalEndpoint", "run_external_rollouts", "user_rewards"]


def load_agent(spec: str, option: str = "rollout.agent") -> Callable[..., Any]:
    """The function ``module:function`` names (the module importable from ``sys.path``, e.g. the working directory)."""
    module_name, sep, func_name = spec.partition(":")
    if not sep or not module_name or not func_name:
        raise ConfigError(f"{option}: {spec!r} is not module:function (e.g. examples.search_agent:solve)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{option}: cannot import {module_name!r} ({e})") from None
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise ConfigError(f"{option}: {module_name!r} has no function {func_name!r}")
    return fn


class _Borrowed:
    """The caller's engine, served by a :class:`LocalEndpoint` without being closed when the server stops."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def close(self) -> None:
        pass


class LocalEndpoint:
    """A loopback generation server (with its OpenAI routes) around an engine of this process, for one batch."""

    def __init__(self, engine: Any, *, tool_parser: str = "hermes", tool_chat_template: str | None = None) -> None:
        self.engine, self.tool_parser, self.tool_chat_template = engine, tool_parser, tool_chat_template
        self.api_key = secrets.token_urlsafe(24)
        self.url = ""

    def __enter__(self) -> "LocalEndpoint":
        import uvicorn

        from agent.engines.server import EngineServeConfig, create_app

        # port: a placeholder the config requires; uvicorn below binds a free loopback port (0) itself.
        cfg = EngineServeConfig(model=self.engine.info.model_path, port=1, api_key=self.api_key, engine="hf",
                                max_model_len=self.engine.info.max_model_len, collective_allow=[], max_wait_ms=5.0,
                                tool_parser=self.tool_parser, tool_chat_template=self.tool_chat_template, log_level="warning")
        app = create_app(cfg, load=lambda: _Borrowed(self.engine))
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False))
        self._thread = threading.Thread(target=self._server.run, name="emapg-local-endpoint", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started or app.state.engine_loop.status == "loading":
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the local OpenAI endpoint did not start")
            time.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)


def _row(prompt: Any) -> dict[str, Any]:
    """What the agent sees of a task row: the question and id, never the gold answers."""
    if isinstance(prompt, str):
        return {"question": prompt, "id": None}
    if isinstance(prompt, dict):
        return {k: v for k, v in prompt.items() if k not in ("answers", "golden_answers", "answer")}
    return {"question": getattr(prompt, "question"), "id": getattr(prompt, "id", None)}


def _call(fn: Callable[..., Any], client: Any, row: dict, sid: str, retriever: Any, sampling: dict) -> Any:
    params = inspect.signature(fn).parameters
    extra = {k: v for k, v in (("retriever", retriever), ("sampling", sampling)) if k in params}
    return fn(client=client, row=row, session_id=sid, **extra)


def run_external_rollouts(engine: Any, prompts: Sequence[Any], retriever: Any, cfg: Any, trajectories: list[Any]) -> None:
    """Fill ``trajectories`` (made by the rollout loop: ids, groups, prompt index) by running ``cfg.agent`` once each."""
    import httpx
    import openai

    fn = load_agent(cfg.agent)
    sampling = {"temperature": cfg.temperature, "top_p": cfg.top_p, "max_tokens": cfg.max_tokens_per_turn}
    urls = list(getattr(engine, "urls", []) or [])
    local = None if urls else LocalEndpoint(engine, tool_parser=cfg.tool_parser, tool_chat_template=cfg.tool_chat_template)
    with local if local is not None else _nothing():
        urls = urls or [local.url]
        key = local.api_key if local is not None else getattr(engine, "api_key", None)
        headers = {"Authorization": f"Bearer {key}"} if key else {}

        def episode(i: int, t: Any) -> None:
            url, sid = urls[i % len(urls)], f"{t.uid}-{uuid.uuid4().hex[:8]}"  # unique even when a batch is retried
            client = openai.OpenAI(base_url=url + "/v1", api_key=key or "none", max_retries=0,
                                   default_headers={"X-Session-Id": sid}, timeout=cfg.agent_timeout_s)
            t0 = time.perf_counter()
            try:
                answer = _call(fn, client, _row(prompts[t.prompt_index]), sid, retriever, sampling)
                t.final_answer = None if answer is None else str(answer)
            except Exception as e:  # noqa: BLE001 - the agent's failure is this trajectory's, not the batch's
                detail = getattr(getattr(e, "response", None), "text", "")  # an API error: the server's message
                t.stop_reason, t.error = "error", f"agent: {type(e).__name__}: {e}{' ' + detail[:500] if detail else ''}"
            finally:
                client.close()
                t.timings["generation_s"] += time.perf_counter() - t0
                r = httpx.delete(f"{url}/v1/sessions/{sid}", headers=headers, timeout=60)
            if r.status_code == 404:
                t.stop_reason, t.error = "error", t.error or "the agent made no model call in its session"
                return
            r.raise_for_status()
            _fill(t, r.json(), cfg.max_response_tokens)

        with cf.ThreadPoolExecutor(max_workers=cfg.agent_workers, thread_name_prefix="emapg-agent") as pool:
            for fut in [pool.submit(episode, i, t) for i, t in enumerate(trajectories) if not t.done]:
                fut.result()


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _fill(t: Any, session: dict, max_response_tokens: int) -> None:
    """The trajectory of a recorded session (module docstring): the segment holding the last call fills ``t``; the
    session's other segments (it split: the agent rewrote or truncated its history) go to ``t.extra_segments``, in
    the order they were opened, each trained as its own row with the episode's reward. Every segment is cut at
    ``max_response_tokens`` like the built-in loop's response; ``num_turns`` and ``num_searches`` count all of them."""
    from agent.spans import Span, TrainingSegment

    segments = session["trajectories"]
    last = len(session["calls"]) - 1
    final = next(j for j, s in enumerate(segments) if last in s["calls"])
    seg = segments[final]
    if len(segments) > 1:
        log.info("session %s split into %d contexts (the agent rewrote its history); training every one", t.uid, len(segments))
    t.extra_segments = []
    for j, other in enumerate(segments):
        if j == final:
            continue
        n = max_response_tokens
        roles = [role for a, b, role in other["spans"] if a < n]
        t.extra_segments.append(TrainingSegment(list(other["prompt_ids"]), list(other["response_ids"][:n]),
                                                list(other["loss_mask"][:n]), [float(x) for x in other["logprobs"][:n]],
                                                num_turns=roles.count("model"), num_observations=roles.count("observation")))
    t.prompt_ids = list(seg["prompt_ids"])
    t.response_ids, t.loss_mask = list(seg["response_ids"]), list(seg["loss_mask"])
    t.sampling_logprobs = [float(x) for x in seg["logprobs"]]
    t.spans = [Span(a, b, role, "answer" if role == "model" else "tool") for a, b, role in seg["spans"]]
    if t.stop_reason == "error":
        _count_turns(t)
        return
    if len(t.response_ids) > max_response_tokens:  # the same cap as the built-in loop's
        del t.response_ids[max_response_tokens:], t.loss_mask[max_response_tokens:], t.sampling_logprobs[max_response_tokens:]
        t.spans = [Span(s.start, min(s.end, max_response_tokens), s.role, s.action) for s in t.spans if s.start < max_response_tokens]
        t.stop_reason = "length"
    else:
        t.stop_reason = "answer" if t.final_answer is not None else "max_turns"
    _count_turns(t)


def _count_turns(t: Any) -> None:
    """Model turns and tool observations of ``t``, its extra segments included."""
    t.num_turns = sum(s.role == "model" for s in t.spans) + sum(x.num_turns for x in t.extra_segments)
    t.num_searches = sum(s.role == "observation" for s in t.spans) + sum(x.num_observations for x in t.extra_segments)


def user_rewards(spec: str, rows: Sequence[Any], answers: Sequence[str | None]) -> list[float]:
    """``rollout.agent_reward``: the user's ``fn(row, answer)`` per trajectory, each a finite number."""
    import dataclasses
    import math

    fn = load_agent(spec, "rollout.agent_reward")
    out = []
    for row, answer in zip(rows, answers, strict=True):
        data = dataclasses.asdict(row) if dataclasses.is_dataclass(row) else row
        value = fn(data, answer)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"rollout.agent_reward {spec} returned {value!r}; a reward is a finite number")
        out.append(float(value))
    return out
