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
* ``POST /v1/responses``: the Responses API (``input`` items, flat function ``tools``, ``function_call_output``,
  ``previous_response_id``, ``max_output_tokens``), translated to and served as a chat turn, recorded the same way
  (agent/engines/responses_api.py).
* ``GET /v1/models``; ``GET /v1/sessions/{id}`` (the recorded calls and their assembled trajectories,
  agent/recorded_sessions.py) and ``DELETE /v1/sessions/{id}`` (the same, then forgotten).

A call belongs to a session when it carries ``X-Session-Id: ID`` or the OpenAI ``user`` field; calls
without one are served and not recorded. Within a session the prompt of a chat call whose messages start
with an earlier call's messages plus the reply it got is built from that call's recorded ids (its prompt
and sampled completion) followed by what the template writes after the reply
(:func:`agent.formats.ids_after_turn`), so a multi-call episode is one context, token for token, exactly
as the built-in tool-call loop builds it. Completions reuse a recorded prefix when the new prompt text
starts with the earlier prompt + returned text and those texts are what the recorded ids decode to.

Bounds (issue 46; docs/hardening.md). Every field is checked before any work: types, sizes, JSON held in strings
(tool-call ``arguments``) and kept whole (a tool's ``parameters``) at most 64 levels deep with valid Unicode
(emapg.server_input.parse_json_field / check_json_value), each refusal a 4xx naming the field. Then the cheap
bounds: at most ``--openai-max-messages`` messages and ``--openai-max-prompt-chars`` characters of text (default:
max_model_len x the vocabulary's longest token in bytes x 4, more than any prompt that fits the context can hold),
checked again on the rendered prompt before it is tokenized. Then admission (a recorded session's count, call and
byte bounds, agent/recorded_sessions.py), before templating and before sampling, so a refused call costs neither.
Templating and tokenization of a request over 16,384 characters run in the bounded worker threads
(emapg/request_workers.py, ``--prep-workers``/``--prep-max-waiting``), as does encoding a large session, so
``/health`` and other requests keep answering meanwhile.

Not supported (422 with a message): streaming, ``n`` > 1, ``top_logprobs`` > 0, penalties, ``echo``,
``tool_choice`` ``required`` or a named function. Log-probs are the sampling log-probs
(agent/engines/base.py); one that is not finite is sent as -9999.0 (vLLM's convention).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Awaitable, Callable, Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from agent.engines.base import SamplingParams, check_prompts
from agent.engines.wire import MAX_INT32, MAX_SEED, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_TEMPERATURE, MIN_TEMPERATURE
from agent.formats import TOOL_CHAT_TEMPLATES, ids_after_turn
from agent.recorded_sessions import Admission, RecordedCall, Session, SessionStore, assemble, expected_call_nbytes, value_nbytes
from agent.toolcall_parsers import get_tool_parser
from emapg.request_workers import RequestWorkers
from emapg.server_input import (HTTPError, as_bool, as_float, as_int, as_list, as_text, check_fields, check_json_value, json_response,
                                openapi_body, parse_json_field, show)  # fmt: skip

__all__ = ["OpenAIOptions", "add_openai_routes", "prompt_char_limit"]

SESSION_HEADER = "x-session-id"
SESSION_ID = re.compile(r"[\x21-\x7e]{1,256}")  # printable ASCII, no spaces
NONFINITE_LOGPROB = -9999.0
MAX_MESSAGES, MAX_TOOLS, MAX_TEXT, MAX_PARTS, MAX_NAME = 1024, 128, 1 << 22, 256, 256
ROLES = ("system", "user", "assistant", "tool")
# A request with at most this many characters of text is prepared (templated, tokenized) on the event loop,
# where it takes about a millisecond; a larger one in the bounded worker threads (emapg/request_workers.py).
INLINE_CHARS = 16_384
# A recorded session with at most this many tokens is assembled and encoded on the event loop, a larger one in the workers.
INLINE_SESSION_TOKENS = 65_536
# Unicode normalisation (NFC) merges at most 4 code points into one character (a base and 3 combining marks), so a
# prompt of more than max_model_len * (longest token's bytes) * NORMALIZATION_SLACK characters cannot fit the context.
NORMALIZATION_SLACK = 4

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
    max_messages: int = MAX_MESSAGES
    max_prompt_chars: int | None = None  # None: prompt_char_limit of the served tokenizer and context
    session_memory_bytes: int = 2048 << 20


def longest_token_bytes(tok) -> int:
    """An upper bound on the bytes of text one token of ``tok`` stands for: its vocabulary's longest entry in UTF-8
    (a byte-level BPE entry spells each byte as one character of one or two bytes; SentencePiece writes a space as
    3-byte "▁" and byte fallbacks as "<0xNN>"), added tokens included."""
    return max((len(t.encode("utf-8", "surrogatepass")) for t in tok.get_vocab()), default=1)


def prompt_char_limit(tok, max_model_len: int) -> int:
    """The most characters a prompt that fits ``max_model_len`` tokens can hold (module docstring, "Bounds")."""
    return max_model_len * longest_token_bytes(tok) * NORMALIZATION_SLACK


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
    parts = as_list(value, where, max_len=MAX_PARTS)
    texts = []
    for j, part in enumerate(parts):
        part = check_fields(part, f"{where}[{j}]", ("type", "text"), ("type", "text"))
        if part["type"] != "text":
            raise HTTPError(422, f"{where}[{j}]: only text parts are supported, got type {show(part['type'])}")
        texts.append(as_text(part["text"], f"{where}[{j}].text", max_chars=MAX_TEXT, nonempty=False))
    text = "".join(texts)
    if len(text) > MAX_TEXT:
        raise HTTPError(422, f"{where} has {len(text)} characters in its parts, more than the limit of {MAX_TEXT}; shorten it")
    return text


def _arguments(value: Any, where: str) -> dict:
    """A tool call's ``arguments``: a JSON object, or a string holding one (as the API sends it); bounded in size and
    depth (emapg.server_input.parse_json_field), so no nesting reaches the chat template or ``json.dumps``."""
    if isinstance(value, str):
        value = parse_json_field(value, where, max_chars=MAX_TEXT)
    else:
        check_json_value(value, where)
    if not isinstance(value, dict):
        raise HTTPError(422, f"{where} must hold a JSON object, got {show(value)}")
    return value


def _size(value: Any) -> int:
    """Characters of text in a parsed value (strings and keys; a number counts its digits), for the prompt bound."""
    total, stack = 0, [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            total += len(node)
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
        else:
            total += 8
    return total


def parse_messages(raw: Any, max_messages: int = MAX_MESSAGES) -> list[dict]:
    """Normalised messages: ``{"role", "content": str}`` plus ``tool_calls`` (arguments as objects),
    ``tool_call_id`` and ``name`` where given."""
    out = []
    for i, m in enumerate(as_list(raw, "'messages'", max_len=max_messages, min_len=1)):
        where = f"messages[{i}]"
        m = check_fields(m, where, ("role", "content", "name", "tool_calls", "tool_call_id"), ("role",))
        if m["role"] not in ROLES:
            raise HTTPError(422, f"{where}.role must be one of {list(ROLES)}, got {show(m['role'])}")
        msg: dict[str, Any] = {"role": m["role"]}
        calls = m.get("tool_calls")
        msg["content"] = _text_content(m.get("content"), f"{where}.content", allow_none=m["role"] == "assistant")
        if calls is not None:
            calls = as_list(calls, f"{where}.tool_calls", max_len=MAX_TOOLS)
        if calls:
            if m["role"] != "assistant":
                raise HTTPError(422, f"{where}: only assistant messages carry tool_calls")
            msg["tool_calls"] = []
            for j, c in enumerate(calls):
                at = f"{where}.tool_calls[{j}]"
                c = check_fields(c, at, ("id", "type", "function"), ("function",))
                if c.get("type") not in (None, "function"):
                    raise HTTPError(422, f"{at}.type must be \"function\", got {show(c['type'])}")
                f = check_fields(c["function"], f"{at}.function", ("name", "arguments"), ("name",))
                msg["tool_calls"].append({
                    "id": "" if c.get("id") is None else as_text(c["id"], f"{at}.id", max_chars=MAX_NAME, nonempty=False),
                    "type": "function",
                    "function": {"name": as_text(f["name"], f"{at}.function.name", max_chars=MAX_NAME),
                                 "arguments": _arguments({} if f.get("arguments") is None else f["arguments"], f"{at}.function.arguments")},
                })  # fmt: skip
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                msg[key] = as_text(m[key], f"{where}.{key}", max_chars=MAX_NAME)
        out.append(msg)
    return out


def parse_tools(raw: Any) -> list[dict]:
    tools = []
    for i, t in enumerate(as_list(raw, "'tools'", max_len=MAX_TOOLS)):
        t = check_fields(t, f"tools[{i}]", ("type", "function"), ("type", "function"))
        if t["type"] != "function":
            raise HTTPError(422, f"tools[{i}].type must be \"function\", got {show(t['type'])}")
        f = check_fields(t["function"], f"tools[{i}].function", ("name", "description", "parameters", "strict"), ("name",))
        fn: dict[str, Any] = {"name": as_text(f["name"], f"tools[{i}].function.name", max_chars=MAX_NAME)}
        if f.get("strict") is not None:
            as_bool(f["strict"], f"tools[{i}].function.strict")
        if f.get("description") is not None:
            fn["description"] = as_text(f["description"], f"tools[{i}].function.description", max_chars=MAX_TEXT, nonempty=False)
        if f.get("parameters") is not None:
            if not isinstance(f["parameters"], dict):
                raise HTTPError(422, f"tools[{i}].function.parameters must be a JSON schema object, got {show(f['parameters'])}")
            fn["parameters"] = check_json_value(f["parameters"], f"tools[{i}].function.parameters")
        tools.append({"type": "function", "function": fn})
    return tools


def _only(body: dict, key: str, allowed: tuple, message: str) -> None:
    """``body[key]`` absent, null or one of ``allowed`` (compared with its type: ``true`` is not ``1``)."""
    value = body.get(key)
    if value is not None and not any(type(value) is type(a) and value == a for a in allowed):
        raise HTTPError(422, f"'{key}' {message}, got {show(value)}")


def _unsupported(body: dict) -> None:
    """The fields the endpoint accepts only at their default (and the ignored ones' types), checked before any work."""
    _only(body, "stream", (False,), "must be false: streaming is not supported (or leave it out)")
    _only(body, "n", (1,), "must be 1 (one choice per call; make several calls)")
    for key in ("presence_penalty", "frequency_penalty"):
        _only(body, key, (0, 0.0), "is not supported (the sampling distribution must stay the trainer's); send 0")
    if body.get("model") is not None:
        as_text(body["model"], "'model'", max_chars=1024, nonempty=False)  # any name is served (the one model)


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


# ----------------------------------------------------------------------------- API schema (OpenAPI, fuzzing)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME)]
Text = Annotated[str, Field(max_length=MAX_TEXT)]


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class FunctionCall(_Strict):
    name: Name
    arguments: Text | dict | None = Field(None, description="a JSON object, or a string holding one (at most 64 levels deep)")


class ToolCall(_Strict):
    id: Annotated[str, Field(max_length=MAX_NAME)] | None = None
    type: Literal["function"] | None = None
    function: FunctionCall


class Message(_Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_PARTS)] | None = None
    name: Name | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: Name | None = None


class FunctionSpec(_Strict):
    name: Name
    description: Text | None = None
    parameters: dict | None = Field(None, description="a JSON schema (at most 64 levels deep)")
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionSpec


class _Sampling(_Strict):
    model: Annotated[str, Field(max_length=1024)] | None = None
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE, description="0: greedy; else at least 1e-5")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32, description="-1: off")
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)] | \
        Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: Literal[1] | None = None
    user: Annotated[str, Field(pattern=r"^[\x21-\x7e]{1,256}$")] | None = Field(None, description="the session id (or X-Session-Id)")
    stream: Literal[False] | None = None
    presence_penalty: Literal[0] | None = None
    frequency_penalty: Literal[0] | None = None


class ChatCompletionBody(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    logprobs: bool | None = None
    top_logprobs: Literal[0] | None = None


class InputItem(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["message", "function_call", "function_call_output"] | None = None


class ResponseTool(_Strict):
    type: Literal["function"]
    name: Name
    description: Text | None = None
    parameters: dict | None = Field(None, description="a JSON schema (at most 64 levels deep)")
    strict: bool | None = None


class ResponsesBody(_Strict):
    """``POST /v1/responses`` (documentation; agent/engines/responses_api.py checks the body at least as strictly)."""

    model: Annotated[str, Field(max_length=1024)] | None = None
    input: Annotated[str, Field(max_length=MAX_TEXT)] | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: Text | None = None
    tools: Annotated[list[ResponseTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["auto", "none"] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: Name | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE, description="0: greedy; else at least 1e-5")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32, description="-1: off (extension)")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="extension")
    user: Annotated[str, Field(pattern=r"^[\x21-\x7e]{1,256}$")] | None = Field(None, description="the session id (or X-Session-Id)")
    store: bool | None = None
    stream: Literal[False] | None = None


class CompletionBody(_Sampling):
    prompt: Annotated[str, Field(min_length=1, max_length=MAX_TEXT)] | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | \
        Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_TEXT)]], Field(min_length=1, max_length=1)]
    logprobs: Literal[0] | None = None
    echo: Literal[False] | None = None
    best_of: Literal[1] | None = None
    suffix: None = None


# ----------------------------------------------------------------------------- routes


def add_openai_routes(app: FastAPI, *, options: OpenAIOptions, endpoint: Callable, json_body: Callable[..., Awaitable[dict]],
                      ready_engine: Callable[[], Any], run: Callable[[Any], Awaitable[Any]],
                      generate: Callable[[list[list[int]], list[SamplingParams]], Any], model_name: str,
                      workers: RequestWorkers) -> SessionStore:
    """Register the endpoint's routes on the generation server ``app``; returns its session store.

    ``workers`` prepare large requests (templating, tokenization) and encode large sessions off the event loop."""
    store = SessionStore(options.max_sessions, options.max_calls_per_session, options.session_ttl_s, options.session_memory_bytes)
    parser = get_tool_parser(options.tool_parser)
    override = TOOL_CHAT_TEMPLATES.get(options.tool_chat_template or "", None)
    if options.tool_chat_template and override is None:
        from pathlib import Path

        override = Path(options.tool_chat_template).expanduser().read_text(encoding="utf-8")
    limits: dict[int, tuple[int, int]] = {}  # id(tokenizer) -> (longest token's bytes, prompt character limit)

    def limits_of(engine) -> tuple[int, int]:
        """The served tokenizer's longest token (bytes) and the prompt character limit, computed once."""
        tok = engine.tokenizer
        if id(tok) not in limits:
            longest = longest_token_bytes(tok)
            limits[id(tok)] = longest, options.max_prompt_chars or engine.max_model_len * longest * NORMALIZATION_SLACK
        return limits[id(tok)]

    def check_chars(n: int, limit: int, what: str) -> None:
        if n > limit:
            how = "--openai-max-prompt-chars" if options.max_prompt_chars else \
                "max_model_len x the longest token's bytes x 4: more cannot fit the context"
            raise HTTPError(422, f"{what} {n} characters, more than the limit of {limit} ({how}); shorten it", "prompt_too_long")

    async def prepare(chars: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the event loop for a small request, in the bounded workers for a large one (E2 of issue 46)."""
        return fn(*args) if chars <= INLINE_CHARS else await workers.run(fn, *args)

    def renderer(tok, tools: list[dict]) -> Callable[..., str]:
        template = override or getattr(tok, "chat_template", None)
        if not template:
            raise HTTPError(422, f"{model_name} has no chat template: use /v1/completions, or start the server with "
                                 "--tool-chat-template", "no_chat_template")
        if tools and "tools" not in (json.dumps(template) if isinstance(template, dict) else template):
            raise HTTPError(422, f"the chat template of {model_name} has no tool support (it never reads `tools`); start "
                                 "the server with --tool-chat-template chatml_tools (ChatML models) or a Jinja file", "no_tool_support")

        def render(messages: list[dict], *, add_generation_prompt: bool) -> str:
            from jinja2 import TemplateError

            try:
                return tok.apply_chat_template(messages, tools=tools or None, chat_template=override, tokenize=False,
                                               add_generation_prompt=add_generation_prompt)
            except TemplateError as e:  # the template's own checks (raise_exception: roles must alternate, ...)
                raise HTTPError(422, f"the chat template of {model_name} refused 'messages': {str(e)[:300]}", "template") from None

        return render

    def tokenize(tok, text: str, limit: int, *, special: bool) -> list[int]:
        """``text``'s ids, after the character bound: the rendered text is what is tokenized, so this refusal is exact
        up to normalisation (NORMALIZATION_SLACK)."""
        check_chars(len(text), limit, "the prompt renders to")
        return list(tok(text, add_special_tokens=special)["input_ids"])

    def chat_prompt(tok, render, calls: list[RecordedCall], messages: list[dict], limit: int) -> list[int]:
        keys = [_message_key(m) for m in messages]
        for call in reversed(calls):
            if call.kind != "chat" or not call.completion_ids:
                continue
            n = len(call.messages) + 1
            if len(messages) > n and keys[:n] == [_message_key(m) for m in [*call.messages, call.reply]]:
                after = ids_after_turn(_Bounded(tok, limit), render, call.messages, messages[n:], call.completion_ids[-1])
                return call.prompt_ids + call.completion_ids + after
        return tokenize(tok, render(messages, add_generation_prompt=True), limit, special=False)

    class _Bounded:
        """The tokenizer as ids_after_turn calls it, with the character bound before it tokenizes."""

        def __init__(self, tok, limit: int) -> None:
            self.tok, self.limit = tok, limit
            self.all_special_ids = tok.all_special_ids

        def __call__(self, text: str, add_special_tokens: bool) -> dict:
            return {"input_ids": tokenize(self.tok, text, self.limit, special=add_special_tokens)}

        def decode(self, ids: list[int]) -> str:
            return self.tok.decode(ids)

    def completion_prompt(tok, calls: list[RecordedCall], text: str, limit: int) -> list[int]:
        for call in reversed(calls):
            if call.kind == "completion" and call.prompt_text is not None and call.completion_text is not None:
                known = call.prompt_text + call.completion_text
                if text.startswith(known) and tok.decode(call.completion_ids) == call.completion_text:
                    return call.prompt_ids + call.completion_ids + tokenize(tok, text[len(known):], limit, special=False)
        return tokenize(tok, text, limit, special=True)

    def prompt_of(prompt: Any) -> tuple[list[int] | None, str | None]:
        """The completion prompt as token ids or as text (checked; not yet tokenized)."""
        if isinstance(prompt, list) and prompt and all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
            return list(prompt), None
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        return None, as_text(prompt, "'prompt'", max_chars=MAX_TEXT)

    def budget(engine, prompt_ids: list[int], max_tokens_field: Any, params: SamplingParams) -> SamplingParams:
        """``params`` with ``max_tokens`` resolved (the room left when not given), or 422 when the prompt does not fit."""
        room = engine.max_model_len - len(prompt_ids)
        if room < 1:
            raise HTTPError(422, f"the prompt has {len(prompt_ids)} tokens; the model's context is {engine.max_model_len}",
                            "prompt_too_long")
        max_tokens = room if max_tokens_field is None else max_tokens_field
        params = dataclasses.replace(params, max_tokens=max_tokens)
        try:
            check_prompts([prompt_ids], engine.vocab_size, engine.max_model_len, params.max_tokens)
        except ValueError as e:
            raise HTTPError(422, str(e)) from None
        return params

    def admit(engine, admission: Admission | None, prompt_ids: list[int], params: SamplingParams, kept: Any) -> None:
        """Reserve the call's largest recorded size before it is sampled (E3/E4 of issue 46); ``kept``: what the call
        keeps of the request (messages or the prompt text)."""
        if admission is not None:
            longest = limits_of(engine)[0]
            admission.reserve(expected_call_nbytes(len(prompt_ids), params.max_tokens, request_bytes=value_nbytes(kept),
                                                   reply_bytes=2 * longest * params.max_tokens))  # fmt: skip

    def usage(prompt_ids: list[int], out) -> dict:
        return {"prompt_tokens": len(prompt_ids), "completion_tokens": len(out.token_ids),
                "total_tokens": len(prompt_ids) + len(out.token_ids)}

    async def chat_call(engine, sid: str | None, messages: list[dict], tools: list[dict], choice: Any,
                        params: SamplingParams, max_tokens: int | None) -> tuple[list[int], Any, dict, str]:
        """One chat turn, recorded when ``sid`` is given (after the fields were checked): the character bound,
        admission, templating (in the workers when large), the budget, the byte reservation, sampling, the reply
        read by the tool parser. Returns (prompt ids, the engine's output, the reply message, the finish reason)."""
        chars = _size(messages) + _size(tools)
        limit = limits_of(engine)[1]
        check_chars(chars, limit, "the messages and tools hold")
        tok = engine.tokenizer
        render = renderer(tok, tools)
        admission = store.admit(sid) if sid else None
        try:
            calls = list(admission.session.calls) if admission else []
            prompt_ids = await prepare(chars, chat_prompt, tok, render, calls, messages, limit)
            params = budget(engine, prompt_ids, max_tokens, params)
            admit(engine, admission, prompt_ids, params, messages)
            (out,) = await run(generate([prompt_ids], [params]))
            text = _visible_text(tok, out)
            reply: dict[str, Any] = {"role": "assistant", "content": text}
            finish = "stop" if out.finish_reason == "stop" else "length"
            parsed = parser.parse(text) if tools and choice != "none" else None
            if parsed is not None and parsed.calls and not parsed.errors:
                reply = {"role": "assistant", "content": parsed.content, "tool_calls": [
                    {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                     "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.calls]}
                finish = "tool_calls" if out.finish_reason == "stop" else "length"
            if admission is not None:
                admission.record(RecordedCall("chat", prompt_ids, list(out.token_ids), list(out.logprobs), out.finish_reason,
                                              messages=messages, reply=reply))
        finally:
            if admission is not None:
                admission.release()
        return prompt_ids, out, reply, finish

    @app.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionBody))
    @endpoint
    async def chat_completions(request: Request):
        """OpenAI chat completions (see the module docstring); a call with a session id is recorded."""
        engine = ready_engine()
        body = await json_body(request, CHAT_FIELDS, ("messages",))
        # Everything cheap first (fields, types, sizes), then admission, then the work (templating, sampling).
        _unsupported(body)
        _only(body, "top_logprobs", (0,), "> 0 is not supported: the sampled tokens' log-probs come with logprobs true")
        want_logprobs = False if body.get("logprobs") is None else as_bool(body["logprobs"], "'logprobs'")
        if body.get("parallel_tool_calls") is not None:
            as_bool(body["parallel_tool_calls"], "'parallel_tool_calls'")
        choice = body.get("tool_choice", "auto")
        if choice not in ("auto", "none", None):
            raise HTTPError(422, f"'tool_choice' must be \"auto\" or \"none\" (forced calls are not supported), got {show(choice)}")
        params = sampling_params(body, 1)
        field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = None if body.get(field) is None else as_int(body[field], f"'{field}'", 1, MAX_INT32)
        sid = parse_session_id(request, body)
        messages = parse_messages(body["messages"], options.max_messages)
        tools = parse_tools(body["tools"]) if body.get("tools") is not None else []
        prompt_ids, out, reply, finish = await chat_call(engine, sid, messages, tools, choice, params, max_tokens)
        tok = engine.tokenizer
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

    @app.post("/v1/completions", openapi_extra=openapi_body(CompletionBody))
    @endpoint
    async def completions(request: Request):
        """OpenAI text completions (see the module docstring); a call with a session id is recorded."""
        engine = ready_engine()
        body = await json_body(request, COMPLETION_FIELDS, ("prompt",))
        _unsupported(body)
        _only(body, "echo", (False,), "is not supported")
        _only(body, "best_of", (1,), "> 1 is not supported")
        if body.get("suffix") is not None:
            raise HTTPError(422, "'suffix' is not supported")
        _only(body, "logprobs", (0,), "must be 0 or null: the sampled tokens' log-probs come with 0, alternatives are not returned")
        params = sampling_params(body, 1)
        max_tokens = 16 if body.get("max_tokens") is None else as_int(body["max_tokens"], "'max_tokens'", 1, MAX_INT32)
        sid = parse_session_id(request, body)
        prompt_ids, prompt_text = prompt_of(body["prompt"])
        limit = limits_of(engine)[1]
        if prompt_text is not None:
            check_chars(len(prompt_text), limit, "the prompt has")
        tok = engine.tokenizer
        admission = store.admit(sid) if sid else None
        try:
            if prompt_ids is None:
                calls = list(admission.session.calls) if admission else []
                prompt_ids = await prepare(len(prompt_text), completion_prompt, tok, calls, prompt_text, limit)
            params = budget(engine, prompt_ids, max_tokens, params)
            admit(engine, admission, prompt_ids, params, prompt_text)
            (out,) = await run(generate([prompt_ids], [params]))
            text = _visible_text(tok, out)
            if admission is not None:
                admission.record(RecordedCall("completion", prompt_ids, list(out.token_ids), list(out.logprobs),
                                              out.finish_reason, prompt_text=prompt_text, completion_text=text))
        finally:
            if admission is not None:
                admission.release()
        logprobs = None
        if body.get("logprobs") == 0:
            tokens = [tok.decode([t]) for t in out.token_ids]
            offsets = [sum(len(x) for x in tokens[:i]) for i in range(len(tokens))]
            logprobs = {"tokens": tokens, "token_logprobs": [_logprob(x) for x in out.logprobs], "top_logprobs": None,
                        "text_offset": offsets}
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()), "model": model_name,
                "choices": [{"index": 0, "text": text, "finish_reason": out.finish_reason, "logprobs": logprobs}],
                "usage": usage(prompt_ids, out)}

    from agent.engines.responses_api import (RESPONSES_FIELDS, ResponseStore, check_unsupported, output_items, parse_input,
                                             parse_response_tools)  # fmt: skip

    responses = ResponseStore(max_items=4 * options.max_sessions, max_bytes=max(options.session_memory_bytes // 4, 1 << 20))
    app.state.responses = responses

    @app.post("/v1/responses", openapi_extra=openapi_body(ResponsesBody))
    @endpoint
    async def create_response(request: Request):
        """The OpenAI Responses API (agent/engines/responses_api.py): one chat turn, recorded like
        /v1/chat/completions when the call has a session id; ``previous_response_id`` continues a stored response."""
        engine = ready_engine()
        body = await json_body(request, RESPONSES_FIELDS, ("input",))
        check_unsupported(body)
        if body.get("model") is not None:
            as_text(body["model"], "'model'", max_chars=1024, nonempty=False)
        choice = body.get("tool_choice", "auto")
        if choice not in ("auto", "none", None):
            raise HTTPError(422, f"'tool_choice' must be \"auto\" or \"none\" (forced calls are not supported), got {show(choice)}")
        if body.get("parallel_tool_calls") is not None:
            as_bool(body["parallel_tool_calls"], "'parallel_tool_calls'")
        keep = True if body.get("store") is None else as_bool(body["store"], "'store'")
        params = sampling_params(body, 1)
        max_tokens = None if body.get("max_output_tokens") is None else as_int(body["max_output_tokens"], "'max_output_tokens'", 1, MAX_INT32)
        sid = parse_session_id(request, body)
        previous = None
        if body.get("previous_response_id") is not None:
            previous = as_text(body["previous_response_id"], "'previous_response_id'", max_chars=MAX_NAME)
        new = parse_messages(parse_input(body, max_messages=options.max_messages, max_chars=MAX_TEXT, max_parts=MAX_PARTS),
                             options.max_messages)  # fmt: skip
        messages = new
        if previous is not None:
            before, reply_before = responses.get(previous)
            if new and new[0]["role"] == "system" and before and before[0]["role"] == "system" and body.get("instructions") is not None:
                before = [new[0], *before[1:]]  # this request's instructions replace the earlier ones
                new = new[1:]
            messages = [*before, reply_before, *new]
            if len(messages) > options.max_messages:
                raise HTTPError(413, f"the conversation has {len(messages)} messages, more than the limit of {options.max_messages}")
        tools = parse_tools(parse_response_tools(body["tools"], MAX_TOOLS)) if body.get("tools") is not None else []
        prompt_ids, out, reply, finish = await chat_call(engine, sid, messages, tools, choice, params, max_tokens)
        response_id = f"resp_{uuid.uuid4().hex}"
        if keep:
            responses.put(response_id, messages, reply)
        complete = out.finish_reason == "stop"
        return {"id": response_id, "object": "response", "created_at": int(time.time()), "model": model_name,
                "status": "completed" if complete else "incomplete",
                "incomplete_details": None if complete else {"reason": "max_output_tokens"}, "error": None,
                "instructions": body.get("instructions"), "previous_response_id": previous,
                "output": output_items(reply, lambda prefix: f"{prefix}_{uuid.uuid4().hex[:24]}"),
                "tools": [dict({"type": "function"}, **t["function"]) for t in tools], "tool_choice": choice or "auto",
                "parallel_tool_calls": body.get("parallel_tool_calls", True), "temperature": params.temperature,
                "top_p": params.top_p, "max_output_tokens": max_tokens, "store": keep, "metadata": body.get("metadata") or {},
                "text": {"format": {"type": "text"}}, "truncation": "disabled", "user": body.get("user"),
                "usage": {"input_tokens": len(prompt_ids), "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens": len(out.token_ids), "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": len(prompt_ids) + len(out.token_ids)}}

    @app.get("/v1/models")
    @endpoint
    async def models(request: Request):
        """The served model (any ``model`` name is accepted by the completion routes)."""
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "ema-pg"}]}

    def session_response(session_id: str, calls: list[RecordedCall]):
        assembly = assemble(calls)
        return json_response({
            "session_id": session_id, "calls": [c.to_json() for c in calls], "split": assembly.split,
            "trajectories": [{"prompt_ids": s.prompt_ids, "response_ids": s.response_ids, "loss_mask": s.loss_mask,
                              "logprobs": [_logprob(x) for x in s.logprobs], "spans": s.spans, "calls": s.calls}
                             for s in assembly.segments]})  # fmt: skip

    async def found(session: Session | None, session_id: str):
        if session is None:
            raise HTTPError(404, f"no session {show(session_id)} (never recorded, deleted, or expired)")
        calls = list(session.calls)  # a snapshot: calls recorded meanwhile are not in this answer
        tokens = sum(len(c.prompt_ids) + len(c.completion_ids) for c in calls)
        if tokens <= INLINE_SESSION_TOKENS:
            return session_response(session.id, calls)
        return await workers.run(session_response, session.id, calls)

    @app.get("/v1/sessions/{session_id}")
    @endpoint
    async def get_session(request: Request, session_id: str):
        """A session's recorded calls (exact prompt and completion ids, sampling log-probs) and assembled trajectories."""
        return await found(store.get(session_id), session_id)

    @app.delete("/v1/sessions/{session_id}")
    @endpoint
    async def delete_session(request: Request, session_id: str):
        """As GET, then the session is forgotten (frees its room)."""
        return await found(store.pop(session_id), session_id)

    return store
