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
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from emapg.config import ConfigError

__all__ = ["ToolCall", "ParsedTurn", "ToolCallParser", "HermesParser", "get_tool_parser", "tool_parser_names",
           "register_tool_parser"]


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


_PARSERS: dict[str, ToolCallParser] = {"hermes": HermesParser()}


def register_tool_parser(parser: ToolCallParser) -> None:
    """Add a parser under ``parser.name`` (chosen with ``rollout.tool_parser``)."""
    _PARSERS[parser.name] = parser


def tool_parser_names() -> list[str]:
    return sorted(_PARSERS)


def get_tool_parser(name: str) -> ToolCallParser:
    if name not in _PARSERS:
        raise ConfigError(f"rollout.tool_parser: unknown parser {name!r}; choose from {', '.join(tool_parser_names())}")
    return _PARSERS[name]
