"""The OpenAI Responses API on the recording endpoint (``POST /v1/responses``): its request as chat messages, a chat
reply as its output items, and the bounded store behind ``previous_response_id``.

A Responses request is the chat endpoint's turn in another shape, so it is served by the same code
(agent/engines/openai_endpoint.py ``chat_call``: the same checks, bounds, admission, templating and recording) and a
session mixing the two APIs assembles the same way. What is translated:

* ``instructions`` -> a leading ``system`` message; ``input`` (a string: one ``user`` message; or items):
  ``message`` items (roles ``user``, ``system``, ``developer`` (as ``system``), ``assistant``; content a string or
  ``input_text``/``output_text`` parts), ``function_call`` items (merged into the assistant message before them, as
  the chat API's ``tool_calls``) and ``function_call_output`` items (``tool`` messages);
* ``tools``: the Responses API's flat function tools (``{"type": "function", "name", "description", "parameters"}``);
* ``previous_response_id``: the stored conversation of that response (its messages and its reply) goes before
  ``input``, so a multi-turn agent that sends only the new items gets the same prompt, token for token (the recorded
  ids of the earlier call are reused exactly as in a chat session);
* the reply -> ``output``: a ``message`` item (``output_text``) when the model wrote text, then one ``function_call``
  item per parsed tool call (``call_id`` is the id a ``function_call_output`` answers).

Stored responses (``store``, default true) are kept for ``previous_response_id`` in a bounded LRU (at most
``max_items`` responses and ``max_bytes`` of messages); a response dropped from it is a 404 that says so, never a
different conversation. Not supported (422): streaming, ``background``, ``reasoning``, non-text content (images,
files), non-function tools (web search, file search, computer use), ``tool_choice`` ``required`` or named.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

from agent.recorded_sessions import value_nbytes
from emapg.server_input import HTTPError, as_bool, as_list, as_text, check_fields, show

__all__ = ["RESPONSES_FIELDS", "ResponseStore", "parse_input", "parse_response_tools", "output_items"]

RESPONSES_FIELDS = ("model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "previous_response_id",
                    "max_output_tokens", "temperature", "top_p", "top_k", "seed", "stop", "user", "store", "stream",
                    "metadata", "text", "truncation", "include", "background", "reasoning")  # fmt: skip
ROLE_OF = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text")


def _text(content: Any, where: str, max_chars: int, max_parts: int) -> str:
    if isinstance(content, str):
        return as_text(content, where, max_chars=max_chars, nonempty=False)
    texts = []
    for j, part in enumerate(as_list(content, where, max_len=max_parts)):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else part
            raise HTTPError(422, f"{where}[{j}]: only text parts ({', '.join(TEXT_PARTS)}) are supported, got type {show(kind)}")
        part = check_fields(part, f"{where}[{j}]", ("type", "text", "annotations", "logprobs", "id"), ("type",))
        texts.append(as_text(part.get("text", ""), f"{where}[{j}].text", max_chars=max_chars, nonempty=False))
    return "".join(texts)


def parse_input(body: dict, *, max_messages: int, max_chars: int, max_parts: int) -> list[dict]:
    """The request's ``instructions`` and ``input`` as chat-API messages (not yet normalised: the caller passes them
    to ``parse_messages``, which checks the rest, e.g. the arguments' JSON)."""
    messages: list[dict] = []
    if body.get("instructions") is not None:
        messages.append({"role": "system", "content": as_text(body["instructions"], "'instructions'", max_chars=max_chars, nonempty=False)})
    raw = body.get("input")
    if raw is None:
        raise HTTPError(422, "missing field 'input': a string, or a list of input items")
    if isinstance(raw, str):
        messages.append({"role": "user", "content": as_text(raw, "'input'", max_chars=max_chars, nonempty=False)})
        return messages
    for i, item in enumerate(as_list(raw, "'input'", max_len=max_messages, min_len=1)):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise HTTPError(422, f"{where} must be an object, got {show(item)}")
        kind = item.get("type", "message")
        if kind == "message":
            item = check_fields(item, where, ("type", "role", "content", "id", "status"), ("role", "content"))
            role = ROLE_OF.get(item["role"]) if isinstance(item["role"], str) else None
            if role is None:
                raise HTTPError(422, f"{where}.role must be one of {list(ROLE_OF)}, got {show(item['role'])}")
            messages.append({"role": role, "content": _text(item["content"], f"{where}.content", max_chars, max_parts)})
        elif kind == "function_call":
            item = check_fields(item, where, ("type", "call_id", "name", "arguments", "id", "status"), ("call_id", "name", "arguments"))
            call = {"id": as_text(item["call_id"], f"{where}.call_id", max_chars=256), "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # the calls of one reply are one assistant message
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            item = check_fields(item, where, ("type", "call_id", "output", "id", "status"), ("call_id", "output"))
            output = item["output"]
            text = output if isinstance(output, str) else _text(output, f"{where}.output", max_chars, max_parts)
            messages.append({"role": "tool", "tool_call_id": as_text(item["call_id"], f"{where}.call_id", max_chars=256),
                             "content": as_text(text, f"{where}.output", max_chars=max_chars, nonempty=False)})
        else:
            raise HTTPError(422, f"{where}.type must be message, function_call or function_call_output, got {show(kind)}")
    return messages


def parse_response_tools(raw: Any, max_tools: int) -> list[dict]:
    """The Responses API's flat function tools as the chat API's (``{"type": "function", "function": {...}}``)."""
    out = []
    for i, t in enumerate(as_list(raw, "'tools'", max_len=max_tools)):
        t = check_fields(t, f"tools[{i}]", ("type", "name", "description", "parameters", "strict"), ("type", "name"))
        if t["type"] != "function":
            raise HTTPError(422, f"tools[{i}].type must be \"function\" (built-in tools are not served), got {show(t['type'])}")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}})
    return out


def check_unsupported(body: dict) -> None:
    """Fields the endpoint takes only at their defaults (422 naming them), before any work."""
    for key, why in (("stream", "streaming is not supported"), ("background", "background responses are not supported")):
        if body.get(key) is not None and as_bool(body[key], f"'{key}'"):
            raise HTTPError(422, f"'{key}' must be false: {why}")
    if body.get("reasoning") is not None:
        raise HTTPError(422, "'reasoning' is not supported (the served model's reasoning is in its text)")
    if body.get("truncation") not in (None, "disabled"):
        raise HTTPError(422, f"'truncation' must be \"disabled\" (a context is never cut), got {show(body['truncation'])}")
    text = body.get("text")
    if text is not None:
        fmt = check_fields(text, "'text'", ("format", "verbosity")).get("format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
            raise HTTPError(422, "'text.format' must be {\"type\": \"text\"} (structured outputs are not supported)")
    if body.get("metadata") is not None:
        meta = body["metadata"]
        if not isinstance(meta, dict) or len(meta) > 16 or any(not isinstance(v, str) or len(v) > 512 or len(k) > 64 for k, v in meta.items()):
            raise HTTPError(422, "'metadata' holds at most 16 string values of at most 512 characters (keys at most 64)")
    if body.get("include") is not None:
        as_list(body["include"], "'include'", max_len=16)


def output_items(reply: dict, new_id) -> list[dict]:
    """The Responses API's ``output`` for a chat reply (``new_id(prefix)`` makes item ids)."""
    items = []
    if reply.get("content") or not reply.get("tool_calls"):
        items.append({"type": "message", "id": new_id("msg"), "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": reply.get("content") or "", "annotations": []}]})
    for c in reply.get("tool_calls") or ():
        items.append({"type": "function_call", "id": new_id("fc"), "call_id": c["id"], "name": c["function"]["name"],
                      "arguments": json.dumps(c["function"]["arguments"], ensure_ascii=False), "status": "completed"})
    return items


class ResponseStore:
    """Stored responses for ``previous_response_id``: ``id -> (messages, reply)``, at most ``max_items`` and
    ``max_bytes`` (:func:`agent.recorded_sessions.value_nbytes`), least recently used dropped first."""

    def __init__(self, max_items: int, max_bytes: int) -> None:
        self.max_items, self.max_bytes = max_items, max_bytes
        self.items: OrderedDict[str, tuple[list[dict], dict, int]] = OrderedDict()
        self.bytes = 0
        self.dropped = 0

    def put(self, response_id: str, messages: list[dict], reply: dict) -> None:
        size = value_nbytes(messages) + value_nbytes(reply)
        if size > self.max_bytes:
            return  # larger than the whole store: not kept (a continuation gets the 404 that says so)
        self.items[response_id] = (messages, reply, size)
        self.bytes += size
        while len(self.items) > self.max_items or self.bytes > self.max_bytes:
            _, (_, _, n) = self.items.popitem(last=False)
            self.bytes -= n
            self.dropped += 1

    def get(self, response_id: str) -> tuple[list[dict], dict]:
        entry = self.items.get(response_id)
        if entry is None:
            raise HTTPError(404, f"no stored response {show(response_id)} for 'previous_response_id' (never stored, sent with "
                                 f"store false, or dropped: the server keeps the {self.max_items} most recent); send the "
                                 "whole conversation in 'input' instead")
        self.items.move_to_end(response_id)
        return entry[0], entry[1]

    def stats(self) -> dict:
        return {"stored": len(self.items), "bytes": self.bytes, "max_items": self.max_items, "max_bytes": self.max_bytes,
                "dropped": self.dropped}
