"""Tool-call parsers: a model's own tool-call syntax -> calls, registered by name (``rollout.tool_parser``).

A parser reads one assistant turn (decoded text; the tokens are never re-derived from it) and
returns a :class:`ParsedTurn`: the text outside the calls, the well-formed calls, and one error
per malformed call block. It also writes a call the way that model family writes it
(:meth:`ToolCallParser.render`), which is what constructed (SFT) trajectories contain.

Registered:

* ``hermes`` -- Hermes / Qwen2.5 / Qwen3 style, what vLLM's ``hermes`` tool parser reads::

      <tool_call>
      {"name": "search", "arguments": {"query": "capital of France"}}
      </tool_call>

  Several blocks in one turn are several (parallel) calls. ``arguments`` may also be a JSON
  string holding an object (some checkpoints emit it so). A block that is not closed, is not
  JSON, is not an object, or lacks a string ``name`` / an object ``arguments`` is an error.

* ``llama3_json`` -- Llama 3.1 / 3.2 / 3.3 JSON calls (vLLM's ``llama3_json``): the whole turn is the call(s),
  optionally after ``<|python_tag|>``, several separated by ``;``::

      {"name": "search", "parameters": {"query": "capital of France"}}

  (``arguments`` is read as well as ``parameters``). A turn that does not start with ``{`` is plain content.

* ``mistral`` -- Mistral / Mixtral / Mistral-Nemo / Ministral (vLLM's ``mistral``): ``[TOOL_CALLS]`` then a JSON
  array of ``{"name", "arguments"}`` (tokenizer v3), or ``name[ARGS]{json}`` per call (v11 and later)::

      [TOOL_CALLS][{"name": "search", "arguments": {"query": "capital of France"}}]

* ``qwen3_coder`` -- Qwen3-Coder's XML calls (vLLM's ``qwen3_coder``); each parameter's value is text (a value
  starting with ``{`` or ``[`` that is JSON is read as JSON)::

      <tool_call>
      <function=search>
      <parameter=query>
      capital of France
      </parameter>
      </function>
      </tool_call>

Each is proven with a chat template of its family (agent/formats.py ``TOOL_CHAT_TEMPLATES``: ``llama3_json``,
``mistral_tools``, ``qwen3_coder``) on a tiny model scripted to call in that syntax (tests/agent/test_tool_parsers.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from emapg.config import ConfigError

__all__ = ["ToolCall", "ParsedTurn", "ToolCallParser", "HermesParser", "Llama3JsonParser", "MistralParser", "Qwen3CoderParser",
           "get_tool_parser", "tool_parser_names", "register_tool_parser"]


@dataclass(frozen=True)
class ToolCall:
    """One function call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedTurn:
    """What one assistant turn says: ``content`` (text outside the calls), ``calls``, and ``errors``
    (one message per malformed call block; a turn with errors is an invalid action)."""

    content: str
    calls: tuple[ToolCall, ...] = ()
    errors: tuple[str, ...] = field(default=())


class ToolCallParser(Protocol):
    name: str

    def parse(self, text: str) -> ParsedTurn: ...

    def render(self, call: ToolCall) -> str: ...


class HermesParser:
    """``<tool_call>{json}</tool_call>`` blocks (see the module docstring)."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        calls: list[ToolCall] = []
        errors: list[str] = []
        for m in self._BLOCK.finditer(text):
            call = _call_from_json(m.group(1).strip())
            (errors if isinstance(call, str) else calls).append(call)
        rest = self._BLOCK.sub("", text)
        if self.OPEN in rest:
            errors.append(f"a {self.OPEN} block is not closed with {self.CLOSE}")
        elif self.CLOSE in rest:
            errors.append(f"a {self.CLOSE} without its {self.OPEN}")
        return ParsedTurn(rest.split(self.OPEN)[0].strip(), tuple(calls), tuple(errors))

    def render(self, call: ToolCall) -> str:
        body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
        return f"{self.OPEN}\n{body}\n{self.CLOSE}"


def _call_from_json(body: str) -> ToolCall | str:
    """A call from a block's JSON, or a message saying what is wrong with it."""
    try:
        data = json.loads(body)
    except ValueError as e:
        return f"the tool call is not valid JSON ({e.msg} at character {e.pos})"
    if not isinstance(data, dict):
        return "the tool call must be a JSON object with \"name\" and \"arguments\""
    name, args = data.get("name"), data.get("arguments", {})
    if not isinstance(name, str) or not name:
        return "the tool call has no \"name\" string"
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return f"the \"arguments\" of {name!r} are neither a JSON object nor a string holding one"
    if not isinstance(args, dict):
        return f"the \"arguments\" of {name!r} must be a JSON object"
    return ToolCall(name, args)


def _from_object(data: Any, keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | str:
    if not isinstance(data, dict):
        return "a tool call must be a JSON object with \"name\" and \"arguments\""
    name = data.get("name")
    args = next((data[k] for k in keys if k in data), {})
    return _call_from_json(json.dumps({"name": name, "arguments": args})) if isinstance(name, str) and name else \
        "the tool call has no \"name\" string"


class Llama3JsonParser:
    """Llama 3.x JSON calls (see the module docstring)."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> ParsedTurn:
        body = text.split(self.TAG, 1)[1] if self.TAG in text else text
        body = body.strip()
        if not body.startswith("{"):
            return ParsedTurn(text.strip())
        calls, errors = [], []
        decoder, at = json.JSONDecoder(), 0
        while at < len(body):
            try:
                data, end = decoder.raw_decode(body, at)
            except ValueError as e:
                errors.append(f"the tool call is not valid JSON ({e.msg} at character {e.pos})")
                break
            call = _from_object(data, ("parameters", "arguments"))
            (errors if isinstance(call, str) else calls).append(call)
            at = end
            while at < len(body) and body[at] in " \t\n;":
                at += 1
            if at < len(body) and body[at] != "{":
                errors.append("text after the tool call(s); a call turn holds only the JSON calls")
                break
        return ParsedTurn("", tuple(calls), tuple(errors))

    def render(self, call: ToolCall) -> str:
        return json.dumps({"name": call.name, "parameters": call.arguments}, ensure_ascii=False)


class MistralParser:
    """``[TOOL_CALLS]`` calls, v3 (JSON array) and v11 (``name[ARGS]{json}``) (see the module docstring)."""

    name = "mistral"
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def parse(self, text: str) -> ParsedTurn:
        if self.TAG not in text:
            return ParsedTurn(text.strip())
        content, _, rest = text.partition(self.TAG)
        rest = rest.replace(self.TAG, "").strip()
        calls, errors = [], []
        if rest.startswith("["):
            try:
                data, end = json.JSONDecoder().raw_decode(rest)
            except ValueError as e:
                return ParsedTurn(content.strip(), (), (f"the [TOOL_CALLS] array is not valid JSON ({e.msg} at character {e.pos})",))
            if not isinstance(data, list) or not data:
                errors.append("[TOOL_CALLS] must be followed by a non-empty JSON array of calls")
            for item in data if isinstance(data, list) else ():
                call = _from_object(item)
                (errors if isinstance(call, str) else calls).append(call)
            if rest[end:].strip():
                errors.append("text after the [TOOL_CALLS] array")
        else:
            for piece in rest.split(self.TAG):
                while piece.strip():
                    name, sep, tail = piece.partition(self.ARGS)
                    if not sep:
                        errors.append(f"a call without {self.ARGS}: {piece.strip()[:40]!r}")
                        break
                    try:
                        args, end = json.JSONDecoder().raw_decode(tail.lstrip())
                    except ValueError as e:
                        errors.append(f"the arguments of {name.strip()!r} are not valid JSON ({e.msg})")
                        break
                    call = _from_object({"name": name.strip(), "arguments": args})
                    (errors if isinstance(call, str) else calls).append(call)
                    piece = tail.lstrip()[end:]
        return ParsedTurn(content.strip(), tuple(calls), tuple(errors))

    def render(self, call: ToolCall) -> str:
        return self.TAG + json.dumps([{"name": call.name, "arguments": call.arguments}], ensure_ascii=False)


class Qwen3CoderParser:
    """Qwen3-Coder's ``<tool_call><function=NAME><parameter=KEY>value</parameter></function></tool_call>``."""

    name = "qwen3_coder"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
    _FUNCTION = re.compile(r"^\s*<function=([^>\n]+)>(.*)</function>\s*$", re.DOTALL)
    _PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        calls: list[ToolCall] = []
        errors: list[str] = []
        for m in self._BLOCK.finditer(text):
            f = self._FUNCTION.match(m.group(1))
            if f is None:
                errors.append("a <tool_call> block must hold one <function=NAME>...</function>")
                continue
            args: dict[str, Any] = {}
            for p in self._PARAM.finditer(f.group(2)):
                value = p.group(2)
                value = value[1:] if value.startswith("\n") else value
                value = value[:-1] if value.endswith("\n") else value
                if value.lstrip().startswith(("{", "[")):
                    try:
                        value = json.loads(value)
                    except ValueError:
                        pass
                args[p.group(1).strip()] = value
            leftover = self._PARAM.sub("", f.group(2)).strip()
            if leftover:
                errors.append(f"text outside <parameter=...> blocks in the call of {f.group(1).strip()!r}")
                continue
            calls.append(ToolCall(f.group(1).strip(), args))
        rest = self._BLOCK.sub("", text)
        if self.OPEN in rest:
            errors.append(f"a {self.OPEN} block is not closed with {self.CLOSE}")
        return ParsedTurn(rest.split(self.OPEN)[0].strip(), tuple(calls), tuple(errors))

    def render(self, call: ToolCall) -> str:
        params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n</parameter>\n"
                         for k, v in call.arguments.items())
        return f"{self.OPEN}\n<function={call.name}>\n{params}</function>\n{self.CLOSE}"


_PARSERS: dict[str, ToolCallParser] = {p.name: p for p in (HermesParser(), Llama3JsonParser(), MistralParser(), Qwen3CoderParser())}


def register_tool_parser(parser: ToolCallParser) -> None:
    """Add a parser under ``parser.name`` (chosen with ``rollout.tool_parser``)."""
    _PARSERS[parser.name] = parser


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_tool_parser(name: str) -> ToolCallParser:
    if name not in _PARSERS:
        raise ConfigError(f"rollout.tool_parser: unknown parser {name!r}; choose from {', '.join(tool_parser_names())}")
    return _PARSERS[name]
