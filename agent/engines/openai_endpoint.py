"""The generation server's OpenAI-compatible endpoint, recording every call of a session for training.

Routes (registered on the generation server by :func:`add_openai_routes`; all need the server's API key,
sent as the ``openai`` client does, ``Authorization: Bearer KEY``):

* ``POST /v1/chat/completions``: ``messages`` (system/user/assistant/tool; assistant ``tool_calls`` as the API
  sends them), ``tools`` (function schemas, rendered by the chat template), ``tool_choice`` ``auto``/``none``,
  ``temperature``, ``top_p``, ``top_k`` (extension), ``max_tokens``/``max_completion_tokens``, ``seed``,
  ``stop``, ``logprobs`` (+ ``top_logprobs: 0``), ``n: 1``. The reply's ``tool_calls`` are parsed from the
  model's own syntax by ``--tool-parser`` (agent/toolcall_parsers.py); a turn whose calls do not parse is
  returned as plain content, as vLLM does.
* ``POST /v1/completions``: ``prompt`` (text, or token ids), the same sampling fields, ``logprobs: 0``.
* ``GET /v1/models``; ``GET /v1/sessions/{id}`` (the recorded calls and their assembled trajectories,
  agent/recorded_sessions.py) and ``DELETE /v1/sessions/{id}`` (the same, then forgotten).

A call belongs to a session when it carries ``X-Session-Id: ID`` or the OpenAI ``user`` field; calls
without one are served and not recorded. Within a session the prompt of a chat call whose messages start
with an earlier call's messages plus the reply it got is built from that call's recorded ids (its prompt
and sampled completion) followed by what the template writes after the reply
(:func:`agent.formats.ids_after_turn`), so a multi-call episode is one context, token for token, exactly
as the built-in tool-call loop builds it. Completions reuse a recorded prefix when the new prompt text
starts with the earlier prompt + returned text and those texts are what the recorded ids decode to.

Not supported (422 with a message): streaming, ``n`` > 1, ``top_logprobs`` > 0, penalties, ``echo``,
``tool_choice`` ``required`` or a named function. Log-probs are the sampling log-probs
(agent/engines/base.py); one that is not finite is sent as -9999.0 (vLLM's convention).
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request

from agent.engines.base import SamplingParams, check_prompts
from agent.engines.wire import MAX_INT32, MAX_SEED, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_TEMPERATURE, MIN_TEMPERATURE
from agent.formats import TOOL_CHAT_TEMPLATES, ids_after_turn
from agent.recorded_sessions import RecordedCall, Session, SessionStore, assemble
from agent.toolcall_parsers import get_tool_parser
from emapg.server_input import HTTPError, as_bool, as_float, as_int, as_list, as_text, check_fields, show

__all__ = ["OpenAIOptions", "add_openai_routes"]

SESSION_HEADER = "x-session-id"
SESSION_ID = re.compile(r"[\x21-\x7e]{1,256}")  # printable ASCII, no spaces
NONFINITE_LOGPROB = -9999.0
MAX_MESSAGES, MAX_TOOLS, MAX_TEXT = 1024, 128, 1 << 22
ROLES = ("system", "user", "assistant", "tool")

_SAMPLING = ("temperature", "top_p", "top_k", "max_tokens", "seed", "stop", "n", "user", "stream",
             "presence_penalty", "frequency_penalty", "model")
CHAT_FIELDS = (*_SAMPLING, "messages", "tools", "tool_choice", "parallel_tool_calls", "max_completion_tokens",
               "logprobs", "top_logprobs")
COMPLETION_FIELDS = (*_SAMPLING, "prompt", "logprobs", "echo", "best_of", "suffix")


@dataclass
class OpenAIOptions:
    """The endpoint's limits and tool-call settings (``emapg engine serve --openai-*`` / ``--tool-*``)."""

    max_sessions: int
    max_calls_per_session: int
    session_ttl_s: float
    tool_parser: str
    tool_chat_template: str | None


# ----------------------------------------------------------------------------- request parsing


def parse_session_id(request: Request, body: dict) -> str | None:
    raw = request.headers.get(SESSION_HEADER)
    where = "the X-Session-Id header"
    if raw is None and body.get("user") is not None:
        raw, where = body["user"], "'user'"
    if raw is None:
        return None
    if not isinstance(raw, str) or not SESSION_ID.fullmatch(raw):
        raise HTTPError(422, f"{where} must be 1-256 printable ASCII characters without spaces, got {show(raw)}")
    return raw


def _text_content(value: Any, where: str, *, allow_none: bool) -> str:
    if value is None:
        if allow_none:
            return ""
        raise HTTPError(422, f"{where} is missing")
    if isinstance(value, str):
        return as_text(value, where, max_chars=MAX_TEXT, nonempty=False)
    parts = as_list(value, where, max_len=256)
    texts = []
    for j, part in enumerate(parts):
        part = check_fields(part, f"{where}[{j}]", ("type", "text"), ("type", "text"))
        if part["type"] != "text":
            raise HTTPError(422, f"{where}[{j}]: only text parts are supported, got type {show(part['type'])}")
        texts.append(as_text(part["text"], f"{where}[{j}].text", max_chars=MAX_TEXT, nonempty=False))
    return "".join(texts)


def _arguments(value: Any, where: str) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise HTTPError(422, f"{where} is not a JSON string") from None
    if not isinstance(value, dict):
        raise HTTPError(422, f"{where} must hold a JSON object")
    return value


def parse_messages(raw: Any) -> list[dict]:
    """Normalised messages: ``{"role", "content": str}`` plus ``tool_calls`` (arguments as objects),
    ``tool_call_id`` and ``name`` where given."""
    out = []
    for i, m in enumerate(as_list(raw, "'messages'", max_len=MAX_MESSAGES, min_len=1)):
        where = f"messages[{i}]"
        m = check_fields(m, where, ("role", "content", "name", "tool_calls", "tool_call_id"), ("role",))
        if m["role"] not in ROLES:
            raise HTTPError(422, f"{where}.role must be one of {list(ROLES)}, got {show(m['role'])}")
        msg: dict[str, Any] = {"role": m["role"]}
        calls = m.get("tool_calls")
        msg["content"] = _text_content(m.get("content"), f"{where}.content", allow_none=m["role"] == "assistant")
        if calls:
            if m["role"] != "assistant":
                raise HTTPError(422, f"{where}: only assistant messages carry tool_calls")
            msg["tool_calls"] = []
            for j, c in enumerate(as_list(calls, f"{where}.tool_calls", max_len=MAX_TOOLS)):
                c = check_fields(c, f"{where}.tool_calls[{j}]", ("id", "type", "function"), ("function",))
                f = check_fields(c["function"], f"{where}.tool_calls[{j}].function", ("name", "arguments"), ("name",))
                msg["tool_calls"].append({
                    "id": str(c.get("id") or ""), "type": "function",
                    "function": {"name": as_text(f["name"], f"{where}.tool_calls[{j}].function.name", max_chars=256),
                                 "arguments": _arguments(f.get("arguments", {}), f"{where}.tool_calls[{j}].function.arguments")},
                })  # fmt: skip
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                msg[key] = as_text(m[key], f"{where}.{key}", max_chars=256)
        out.append(msg)
    return out


def parse_tools(raw: Any) -> list[dict]:
    tools = []
    for i, t in enumerate(as_list(raw, "'tools'", max_len=MAX_TOOLS)):
        t = check_fields(t, f"tools[{i}]", ("type", "function"), ("type", "function"))
        if t["type"] != "function":
            raise HTTPError(422, f"tools[{i}].type must be \"function\", got {show(t['type'])}")
        f = check_fields(t["function"], f"tools[{i}].function", ("name", "description", "parameters", "strict"), ("name",))
        fn: dict[str, Any] = {"name": as_text(f["name"], f"tools[{i}].function.name", max_chars=256)}
        if f.get("description") is not None:
            fn["description"] = as_text(f["description"], f"tools[{i}].function.description", max_chars=MAX_TEXT, nonempty=False)
        if f.get("parameters") is not None:
            if not isinstance(f["parameters"], dict):
                raise HTTPError(422, f"tools[{i}].function.parameters must be a JSON schema object")
            fn["parameters"] = f["parameters"]
        tools.append({"type": "function", "function": fn})
    return tools


def _unsupported(body: dict) -> None:
    if body.get("stream"):
        raise HTTPError(422, "'stream': streaming is not supported; send stream false (or leave it out)")
    n = body.get("n")
    if n is not None and n != 1:
        raise HTTPError(422, f"'n' must be 1 (one choice per call; make several calls), got {show(n)}")
    for key in ("presence_penalty", "frequency_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise HTTPError(422, f"'{key}' is not supported (the sampling distribution must stay the trainer's); send 0")


def sampling_params(body: dict, max_tokens: int) -> SamplingParams:
    """The engine's sampling settings from the OpenAI fields (``max_tokens`` already resolved)."""
    t = 1.0 if body.get("temperature") is None else as_float(body["temperature"], "'temperature'", 0.0, MAX_TEMPERATURE)
    if 0 < t < MIN_TEMPERATURE:
        raise HTTPError(422, f"'temperature' must be 0 (greedy) or at least {MIN_TEMPERATURE:g}")
    top_p = 1.0 if body.get("top_p") is None else as_float(body["top_p"], "'top_p'", 0.0, 1.0)
    if top_p == 0:
        raise HTTPError(422, "'top_p' must be > 0")
    top_k = -1 if body.get("top_k") is None else as_int(body["top_k"], "'top_k'", -1, MAX_INT32)
    if top_k == 0:
        raise HTTPError(422, "'top_k' must be -1 (off) or >= 1")
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else as_list(stop, "'stop'", max_len=MAX_STOP_STRINGS)
    stops = [as_text(s, f"stop[{i}]", max_chars=MAX_STOP_CHARS, nonempty=False) for i, s in enumerate(stops)]
    if any(not s for s in stops):
        raise HTTPError(422, "'stop' strings must be non-empty")
    seed = None if body.get("seed") is None else as_int(body["seed"], "'seed'", 0, MAX_SEED)
    greedy = t == 0
    return SamplingParams(temperature=t, top_p=1.0 if greedy else top_p, top_k=-1 if greedy else top_k,
                          max_tokens=max_tokens, stop=tuple(stops), seed=seed)


def _logprob(x: float) -> float:
    return x if math.isfinite(x) else NONFINITE_LOGPROB


def _visible_text(tok, out) -> str:
    """What the API returns as text: the decoded completion without a matched stop string and what follows."""
    text = tok.decode(out.token_ids, skip_special_tokens=True)
    if isinstance(out.stop_reason, str) and out.stop_reason in text:
        text = text[: text.find(out.stop_reason)]
    return text


def _message_key(m: dict) -> tuple:
    """What must agree for a sent-back message to count as the same one (ids and names aside)."""
    calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                  for c in m.get("tool_calls") or ())
    return m["role"], m.get("content") or "", calls


# ----------------------------------------------------------------------------- routes


def add_openai_routes(app: FastAPI, *, options: OpenAIOptions, endpoint: Callable, json_body: Callable[..., Awaitable[dict]],
                      ready_engine: Callable[[], Any], run: Callable[[Any], Awaitable[Any]],
                      generate: Callable[[list[list[int]], list[SamplingParams]], Any], model_name: str) -> SessionStore:
    """Register the endpoint's routes on the generation server ``app``; returns its session store."""
    store = SessionStore(options.max_sessions, options.max_calls_per_session, options.session_ttl_s)
    parser = get_tool_parser(options.tool_parser)
    override = TOOL_CHAT_TEMPLATES.get(options.tool_chat_template or "", None)
    if options.tool_chat_template and override is None:
        from pathlib import Path

        override = Path(options.tool_chat_template).expanduser().read_text(encoding="utf-8")

    def renderer(tok, tools: list[dict]) -> Callable[..., str]:
        template = override or getattr(tok, "chat_template", None)
        if not template:
            raise HTTPError(422, f"{model_name} has no chat template: use /v1/completions, or start the server with "
                                 "--tool-chat-template", "no_chat_template")
        if tools and "tools" not in (json.dumps(template) if isinstance(template, dict) else template):
            raise HTTPError(422, f"the chat template of {model_name} has no tool support (it never reads `tools`); start "
                                 "the server with --tool-chat-template chatml_tools (ChatML models) or a Jinja file", "no_tool_support")

        def render(messages: list[dict], *, add_generation_prompt: bool) -> str:
            return tok.apply_chat_template(messages, tools=tools or None, chat_template=override, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)

        return render

    def chat_prompt(tok, render, session: Session | None, messages: list[dict]) -> list[int]:
        keys = [_message_key(m) for m in messages]
        for call in reversed(session.calls if session else []):
            if call.kind != "chat" or not call.completion_ids:
                continue
            n = len(call.messages) + 1
            if len(messages) > n and keys[:n] == [_message_key(m) for m in [*call.messages, call.reply]]:
                after = ids_after_turn(tok, render, call.messages, messages[n:], call.completion_ids[-1])
                return call.prompt_ids + call.completion_ids + after
        return list(tok(render(messages, add_generation_prompt=True), add_special_tokens=False)["input_ids"])

    def completion_prompt(tok, session: Session | None, prompt: Any) -> tuple[list[int], str | None]:
        if isinstance(prompt, list) and prompt and all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
            return list(prompt), None
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        text = as_text(prompt, "'prompt'", max_chars=MAX_TEXT)
        for call in reversed(session.calls if session else []):
            if call.kind == "completion" and call.prompt_text is not None and call.completion_text is not None:
                known = call.prompt_text + call.completion_text
                if text.startswith(known) and tok.decode(call.completion_ids) == call.completion_text:
                    rest = list(tok(text[len(known):], add_special_tokens=False)["input_ids"])
                    return call.prompt_ids + call.completion_ids + rest, text
        return list(tok(text, add_special_tokens=True)["input_ids"]), text

    async def sample(engine, prompt_ids: list[int], body: dict, max_tokens_field: Any):
        room = engine.max_model_len - len(prompt_ids)
        if room < 1:
            raise HTTPError(422, f"the prompt has {len(prompt_ids)} tokens; the model's context is {engine.max_model_len}")
        max_tokens = room if max_tokens_field is None else as_int(max_tokens_field, "'max_tokens'", 1, MAX_INT32)
        params = sampling_params(body, max_tokens)
        try:
            check_prompts([prompt_ids], engine.vocab_size, engine.max_model_len, params.max_tokens)
        except ValueError as e:
            raise HTTPError(422, str(e)) from None
        (out,) = await run(generate([prompt_ids], [params]))
        return out

    def usage(prompt_ids: list[int], out) -> dict:
        return {"prompt_tokens": len(prompt_ids), "completion_tokens": len(out.token_ids),
                "total_tokens": len(prompt_ids) + len(out.token_ids)}

    @app.post("/v1/chat/completions")
    @endpoint
    async def chat_completions(request: Request):
        """OpenAI chat completions (see the module docstring); a call with a session id is recorded."""
        engine = ready_engine()
        body = await json_body(request, CHAT_FIELDS, ("messages",))
        _unsupported(body)
        if body.get("top_logprobs") not in (None, 0):
            raise HTTPError(422, "'top_logprobs' > 0 is not supported: the sampled tokens' log-probs come with logprobs true")
        want_logprobs = False if body.get("logprobs") is None else as_bool(body["logprobs"], "'logprobs'")
        choice = body.get("tool_choice", "auto")
        if choice not in ("auto", "none", None):
            raise HTTPError(422, f"'tool_choice' must be \"auto\" or \"none\" (forced calls are not supported), got {show(choice)}")
        sid = parse_session_id(request, body)
        messages = parse_messages(body["messages"])
        tools = parse_tools(body["tools"]) if body.get("tools") else []
        tok = engine.tokenizer
        render = renderer(tok, tools)
        prompt_ids = chat_prompt(tok, render, store.get(sid) if sid else None, messages)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        out = await sample(engine, prompt_ids, body, max_tokens)
        text = _visible_text(tok, out)
        reply: dict[str, Any] = {"role": "assistant", "content": text}
        finish = "stop" if out.finish_reason == "stop" else "length"
        parsed = parser.parse(text) if tools and choice != "none" else None
        if parsed is not None and parsed.calls and not parsed.errors:
            reply = {"role": "assistant", "content": parsed.content, "tool_calls": [
                {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.calls]}
            finish = "tool_calls" if out.finish_reason == "stop" else "length"
        if sid:
            store.record(sid, RecordedCall("chat", prompt_ids, list(out.token_ids), list(out.logprobs), out.finish_reason,
                                           messages=messages, reply=reply))
        message = {"role": "assistant", "content": reply["content"] or None}
        if "tool_calls" in reply:
            message["tool_calls"] = [dict(c, function={"name": c["function"]["name"],
                                                       "arguments": json.dumps(c["function"]["arguments"], ensure_ascii=False)})
                                     for c in reply["tool_calls"]]
        logprobs = None
        if want_logprobs:
            logprobs = {"content": [{"token": (s := tok.decode([t])), "logprob": _logprob(lp), "bytes": list(s.encode()),
                                     "top_logprobs": []} for t, lp in zip(out.token_ids, out.logprobs)]}
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": model_name, "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}],
                "usage": usage(prompt_ids, out)}

    @app.post("/v1/completions")
    @endpoint
    async def completions(request: Request):
        """OpenAI text completions (see the module docstring); a call with a session id is recorded."""
        engine = ready_engine()
        body = await json_body(request, COMPLETION_FIELDS, ("prompt",))
        _unsupported(body)
        if body.get("echo") or body.get("suffix") is not None or body.get("best_of") not in (None, 1):
            raise HTTPError(422, "'echo', 'suffix' and 'best_of' > 1 are not supported")
        if body.get("logprobs") not in (None, 0):
            raise HTTPError(422, "'logprobs' must be 0 or null: the sampled tokens' log-probs come with 0, alternatives are not returned")
        sid = parse_session_id(request, body)
        tok = engine.tokenizer
        prompt_ids, prompt_text = completion_prompt(tok, store.get(sid) if sid else None, body["prompt"])
        out = await sample(engine, prompt_ids, body, body.get("max_tokens", 16))
        text = _visible_text(tok, out)
        if sid:
            store.record(sid, RecordedCall("completion", prompt_ids, list(out.token_ids), list(out.logprobs),
                                           out.finish_reason, prompt_text=prompt_text, completion_text=text))
        logprobs = None
        if body.get("logprobs") == 0:
            tokens = [tok.decode([t]) for t in out.token_ids]
            offsets = [sum(len(x) for x in tokens[:i]) for i in range(len(tokens))]
            logprobs = {"tokens": tokens, "token_logprobs": [_logprob(x) for x in out.logprobs], "top_logprobs": None,
                        "text_offset": offsets}
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": model_name,
                "choices": [{"index": 0, "text": text, "finish_reason": out.finish_reason, "logprobs": logprobs}],
                "usage": usage(prompt_ids, out)}

    @app.get("/v1/models")
    @endpoint
    async def models(request: Request):
        """The served model (any ``model`` name is accepted by the completion routes)."""
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "ema-pg"}]}

    def session_json(session: Session) -> dict:
        assembly = assemble(session.calls)
        return {"session_id": session.id, "calls": [c.to_json() for c in session.calls], "split": assembly.split,
                "trajectories": [{"prompt_ids": s.prompt_ids, "response_ids": s.response_ids, "loss_mask": s.loss_mask,
                                  "logprobs": [_logprob(x) for x in s.logprobs], "spans": s.spans, "calls": s.calls}
                                 for s in assembly.segments]}

    def found(session: Session | None, session_id: str) -> dict:
        if session is None:
            raise HTTPError(404, f"no session {show(session_id)} (never recorded, deleted, or expired)")
        return session_json(session)

    @app.get("/v1/sessions/{session_id}")
    @endpoint
    async def get_session(request: Request, session_id: str):
        """A session's recorded calls (exact prompt and completion ids, sampling log-probs) and assembled trajectories."""
        return found(store.get(session_id), session_id)

    @app.delete("/v1/sessions/{session_id}")
    @endpoint
    async def delete_session(request: Request, session_id: str):
        """As GET, then the session is forgotten (frees its room)."""
        return found(store.pop(session_id), session_id)

    return store
