"""Tool sources of the agent (``rollout.tools``): the built-in search, and MCP servers (docs/mcp.md).

A source is one string:

* ``search`` -- the built-in search tool (:data:`agent.formats.SEARCH_TOOL`), answered by the rollout's retriever
  (batched with every other search of the round, as without ``rollout.tools``);
* ``http://HOST:PORT/mcp`` (or ``https://``) -- an MCP server over streamable HTTP, e.g. ``emapg serve --mcp``;
* ``stdio:COMMAND ARGS`` -- an MCP server launched as a subprocess, spoken to over its stdin/stdout;
* ``calculator`` -- the bundled sandboxed calculator (agent/calculator.py: ``calculate(expression)``), an MCP server
  over stdio (``python -m agent.calculator``).

Every tool an MCP server lists (``list_tools``) is offered to the model as an OpenAI-style function schema (its name,
description and input schema), through the chat template's ``tools=`` (``rollout.format=tool_calls``). Two sources may
not offer the same name.

A call is dispatched with a deadline (``rollout.tool_timeout_s``) and a size limit (``rollout.max_tool_output_chars``).
Whatever goes wrong -- the server errors, answers ``isError``, hangs past the deadline, answers more than the limit,
has gone away -- the model gets a message that says so as the tool's result, the trajectory counts it
(``Trajectory.tool_failures``, ``tool_errors``), and the batch goes on. An oversized output is cut at the limit, with
a note, and counted as a failure.

The MCP clients live on one event loop in a daemon thread per :class:`ToolBox`; the rollout drivers (threads) hand it
calls with :meth:`ToolBox.call_many`, which runs them concurrently and waits at most the deadline (plus a second).
A toolbox is opened once per process and set of sources (:func:`open_toolbox`) and closed at exit.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import shlex
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from emapg.config import ConfigError

log = logging.getLogger(__name__)

__all__ = ["BUILTIN_SEARCH", "ToolResult", "ToolBox", "ToolConnectError", "open_toolbox", "toolbox_for", "http_headers",
           "check_sources", "close_toolboxes"]

BUILTIN_SEARCH = "search"
CONNECT_ATTEMPTS = 3
CALCULATOR = "calculator"


class ToolConnectError(ConfigError):
    """An MCP tool source could not be connected: ``source`` (the URL or command), ``phase`` (``connect``: the
    transport and the protocol handshake; ``list_tools``), and why. A server that never answers ends here after
    ``connect_timeout_s``, never hangs the run."""

    def __init__(self, source: str, phase: str, why: str) -> None:
        super().__init__(f"rollout.tools: cannot reach the MCP server {source!r} ({phase}): {why}")
        self.source, self.phase, self.why = source, phase, why


class _ClosedEarly(RuntimeError):
    """The MCP clients' context ended before they were ready, without an exception (an anyio cancel scope swallowed it)."""


@dataclass(frozen=True)
class ToolResult:
    """One call's answer: ``text`` (what the model reads) and ``error`` (None when the call succeeded)."""

    text: str
    error: str | None = None


def check_sources(sources: list[str]) -> None:
    """ConfigError naming the entry when a source is none of the three forms (module docstring)."""
    seen = set()
    for s in sources:
        if s in seen:
            raise ConfigError(f"rollout.tools lists {s!r} twice")
        seen.add(s)
        if s in (BUILTIN_SEARCH, CALCULATOR) or s.startswith(("http://", "https://")):
            continue
        if s.startswith("stdio:"):
            if not shlex.split(s[len("stdio:"):]):
                raise ConfigError(f"rollout.tools: {s!r} names no command (stdio:COMMAND ARGS)")
            continue
        raise ConfigError(f"rollout.tools: {s!r} is not a tool source; use 'search' (the built-in search), 'calculator' (the bundled "
                          f"calculator), an MCP server's URL (http://HOST:PORT/mcp) or 'stdio:COMMAND ARGS' (an MCP server over stdio)")


def _cause(e: BaseException) -> BaseException:
    """The first leaf of an exception group (the SDK's task groups wrap the cause)."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return e


def _schema(tool: Any) -> dict:
    params = dict(tool.input_schema or {"type": "object", "properties": {}})
    params.setdefault("type", "object")
    return {"type": "function", "function": {"name": tool.name, "description": tool.description or "", "parameters": params}}


def _result_text(result: Any) -> str:
    parts = []
    for block in result.content or []:
        text = getattr(block, "text", None)
        parts.append(text if text is not None else json.dumps(block.model_dump(mode="json", exclude_none=True)))
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, ensure_ascii=False))
    return "\n".join(parts)


class ToolBox:
    """The MCP servers of ``sources`` (the built-in ``search`` is the rollout's), connected; see the module docstring."""

    def __init__(self, sources: list[str], *, timeout_s: float, max_output_chars: int, connect_timeout_s: float = 60.0,
                 headers: dict[str, str] | None = None) -> None:
        check_sources(sources)
        self.sources = list(sources)
        self.timeout_s, self.max_output_chars = timeout_s, max_output_chars
        self.connect_timeout_s = connect_timeout_s
        self.headers = dict(headers or {})  # sent to every HTTP source (rollout.tool_api_key_env, rollout.tool_headers)
        self.connect_failures = 0  # attempts that failed or timed out (a client closed early is retried)
        self._connecting: tuple[str, str] | None = None  # (source, phase) being connected, for a timeout's message
        self._timed_out: tuple[str, str] | None = None
        self._refused: dict[str, int] = {}  # HTTP source -> the 401/403 it answered (for the error message)
        self.builtin_search = BUILTIN_SEARCH in sources
        self.schemas: list[dict] = []
        self._owner: dict[str, Any] = {}  # tool name -> client
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="emapg-mcp-tools", daemon=True)
        self._thread.start()
        self._closing: asyncio.Event | None = None
        self._holder: asyncio.Future | None = None
        # Each source's connect and list_tools run under a deadline of connect_timeout_s on the tool loop (the holder task
        # is cancelled there, so the SDK's contexts unwind in the task that entered them); this thread waits for all of
        # them plus a margin, in case the loop itself is stuck.
        n_remote = max(1, sum(s not in (BUILTIN_SEARCH,) for s in self.sources))
        try:
            for attempt in range(CONNECT_ATTEMPTS):
                try:
                    asyncio.run_coroutine_threadsafe(self._open(), self._loop).result(connect_timeout_s * n_remote + 10.0)
                    break
                except _ClosedEarly as e:  # the SDK's task group was cancelled while connecting: try a fresh client
                    self.connect_failures += 1
                    if attempt + 1 == CONNECT_ATTEMPTS:
                        raise RuntimeError(str(e)) from None
                    log.warning("rollout.tools: %s; connecting again (%d/%d)", e, attempt + 2, CONNECT_ATTEMPTS)
                    self.schemas.clear()
                    self._owner.clear()
        except FutureTimeout:
            self.connect_failures += 1
            source, phase = self._connecting or ("?", "connect")
            log.warning("rollout.tools: connecting to %r timed out at %s; where each task of the tool loop waited:\n%s", source,
                        phase, self._stacks())
            self.close()
            raise ToolConnectError(source, phase, f"no answer within {connect_timeout_s:g} s (the tool loop did not respond)") from None
        except ToolConnectError:
            self.connect_failures += 1
            self.close()
            raise
        except Exception as e:
            self.connect_failures += 1
            self.close()
            raise ConfigError(f"rollout.tools: {_cause(e)}") from None

    def _stacks(self) -> str:
        """The stack of every task on the tool loop (for a connect that hangs)."""
        import io

        async def dump() -> str:
            out = io.StringIO()
            for task in asyncio.all_tasks():
                task.print_stack(limit=12, file=out)
            return out.getvalue()

        try:
            return asyncio.run_coroutine_threadsafe(dump(), self._loop).result(5)
        except Exception as e:  # noqa: BLE001 - a diagnostic only
            return f"(no stacks: {type(e).__name__}: {e})"

    # --- the event loop's side
    async def _open(self) -> None:
        started: asyncio.Future = self._loop.create_future()
        self._closing = asyncio.Event()
        self._holder = asyncio.ensure_future(self._hold(started))
        await started

    async def _hold(self, started: asyncio.Future) -> None:
        """Enter every client in one task (their contexts must be left by the task that entered them), list the
        tools, then wait for :meth:`close`."""
        try:  # every exit, an import's included, resolves ``started`` (else _open would wait out the whole deadline)
            from contextlib import AsyncExitStack

            from mcp import Client, StdioServerParameters

            from agent.formats import SEARCH_TOOL

            async with AsyncExitStack() as stack:
                names: dict[str, str] = {}
                if self.builtin_search:
                    self.schemas.append(SEARCH_TOOL)
                    names[BUILTIN_SEARCH] = "the built-in search"
                for source in self.sources:
                    if source == BUILTIN_SEARCH:
                        continue
                    if source == CALCULATOR:
                        import sys

                        server: Any = StdioServerParameters(command=sys.executable, args=["-m", "agent.calculator"])
                    elif source.startswith("stdio:"):
                        command, *args = shlex.split(source[len("stdio:"):])
                        server = StdioServerParameters(command=command, args=args)
                    else:
                        server = await self._http_transport(stack, source)
                    deadline = asyncio.get_running_loop().call_later(self.connect_timeout_s, self._cut_off, asyncio.current_task())
                    try:
                        self._connecting = (source, "connect")
                        client = await stack.enter_async_context(
                            Client(server, read_timeout_seconds=max(self.connect_timeout_s, self.timeout_s) + 5.0))
                        self._check_deadline()
                        self._connecting = (source, "list_tools")
                        tools = (await client.list_tools()).tools
                        self._check_deadline()
                    except asyncio.CancelledError:
                        if self._timed_out is None:
                            raise
                        src, phase = self._timed_out
                        raise ToolConnectError(src, phase, f"no answer within {self.connect_timeout_s:g} s") from None
                    except ToolConnectError:
                        raise
                    except Exception as e:  # noqa: BLE001 - said once, with the source
                        phase = self._connecting[1]
                        if self._timed_out is not None:
                            raise ToolConnectError(source, phase, f"no answer within {self.connect_timeout_s:g} s") from None
                        e = _cause(e)
                        why = f"{type(e).__name__}: {e}"
                        if source in self._refused:
                            why = (f"HTTP {self._refused[source]}: the server refused the API key or wants one (send it with "
                                   f"rollout.tool_api_key_env or rollout.tool_headers); {why}")
                        raise ToolConnectError(source, phase, why) from None
                    finally:
                        deadline.cancel()
                    self._connecting = None
                    for tool in tools:
                        if tool.name in names:
                            raise RuntimeError(f"the tool {tool.name!r} of {source!r} is also offered by {names[tool.name]}")
                        names[tool.name] = repr(source)
                        self._owner[tool.name] = client
                        self.schemas.append(_schema(tool))
                started.set_result(None)
                await self._closing.wait()
            if not started.done():
                if self._timed_out is not None:  # the deadline's cancellation was swallowed by one of the SDK's scopes
                    src, phase = self._timed_out
                    started.set_exception(ToolConnectError(src, phase, f"no answer within {self.connect_timeout_s:g} s"))
                else:
                    started.set_exception(_ClosedEarly("an MCP client's connection closed before it was ready"))
        except BaseException as e:
            e = _cause(e)
            if not started.done():
                if self._timed_out is not None and not isinstance(e, ToolConnectError):
                    src, phase = self._timed_out
                    e = ToolConnectError(src, phase, f"no answer within {self.connect_timeout_s:g} s")
                started.set_exception(e if isinstance(e, Exception) else RuntimeError(str(e)))
            elif not isinstance(e, (asyncio.CancelledError, GeneratorExit)):
                log.warning("closing the MCP tool clients: %s: %s", type(e).__name__, e)

    def _check_deadline(self) -> None:
        if self._timed_out is not None:
            src, phase = self._timed_out
            raise ToolConnectError(src, phase, f"no answer within {self.connect_timeout_s:g} s")

    def _cut_off(self, task: asyncio.Task) -> None:
        """The deadline of the source being connected: cancel the holder task (it unwinds the SDK's contexts itself)."""
        if self._connecting is not None and not task.done():
            self._timed_out = self._connecting
            task.cancel()

    async def _http_transport(self, stack: Any, url: str) -> Any:
        """The streamable-HTTP transport to ``url`` with this box's headers (an API key) on every request and the HTTP
        client's connect/read timeouts bounded by ``connect_timeout_s`` for the handshake (a call's own deadline is
        ``timeout_s``; the read timeout is the longer of the two)."""
        import httpx2
        from mcp.client.streamable_http import streamable_http_client
        from mcp.shared._httpx_utils import create_mcp_http_client

        read = max(self.connect_timeout_s, self.timeout_s) + 5.0
        timeout = httpx2.Timeout(self.connect_timeout_s, read=read)
        http = await stack.enter_async_context(create_mcp_http_client(headers=self.headers or None, timeout=timeout))

        async def note_refusal(response: Any) -> None:  # the SDK reports a 401 as "Server returned an error response"
            if response.status_code in (401, 403):
                self._refused[url] = response.status_code

        http.event_hooks = {**http.event_hooks, "response": [*http.event_hooks.get("response", []), note_refusal]}
        return streamable_http_client(url, http_client=http)

    async def _call(self, name: str, arguments: dict) -> ToolResult:
        client = self._owner.get(name)
        if client is None:
            return ToolResult(f"Error: unknown tool {name!r}; the tools are {', '.join(self.names())}.", "unknown tool")
        try:
            result = await asyncio.wait_for(client.call_tool(name, arguments), self.timeout_s)
        except asyncio.TimeoutError:
            return ToolResult(f"Error: the tool {name} did not answer within {self.timeout_s:g} s.", "timeout")
        except Exception as e:  # noqa: BLE001 - the server's or the transport's: the model is told, the batch goes on
            return ToolResult(f"Error: the tool {name} failed: {type(e).__name__}: {e}"[:1000], f"{type(e).__name__}")
        text = _result_text(result).strip()
        reason = "tool error" if result.is_error else None
        if result.is_error and not text.startswith("Error"):
            text = f"Error: {text}"
        if len(text) > self.max_output_chars:
            text = f"{text[: self.max_output_chars]}\n[output cut: {len(text)} characters, the limit is {self.max_output_chars}]"
            reason = reason or "oversized"
        return ToolResult(text, reason)

    async def _call_all(self, calls: list[tuple[str, dict]]) -> list[ToolResult]:
        return list(await asyncio.gather(*(self._call(name, args) for name, args in calls)))

    # --- the drivers' side
    def names(self) -> list[str]:
        return [s["function"]["name"] for s in self.schemas]

    def offers(self, name: str) -> bool:
        return name in self._owner

    def call_many(self, calls: list[tuple[str, dict]]) -> list[ToolResult]:
        """Run MCP tool calls ``(name, arguments)`` concurrently; one :class:`ToolResult` each, in order, within the
        deadline (a call still running then is answered as timed out)."""
        if not calls:
            return []
        fut = asyncio.run_coroutine_threadsafe(self._call_all(calls), self._loop)
        try:
            return fut.result(self.timeout_s + 5.0)
        except FutureTimeout:
            fut.cancel()
            return [ToolResult(f"Error: the tool {n} did not answer within {self.timeout_s:g} s.", "timeout") for n, _ in calls]

    def close(self) -> None:
        if self._loop.is_closed():
            return
        if self._closing is not None and self._holder is not None:
            async def stop():
                self._closing.set()
                try:
                    await asyncio.wait_for(asyncio.shield(self._holder), 10)
                except Exception:  # noqa: BLE001 - a server that will not close is left to its process group
                    self._holder.cancel()

            try:
                asyncio.run_coroutine_threadsafe(stop(), self._loop).result(15)
            except Exception:  # noqa: BLE001
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()


_BOXES: dict[tuple, ToolBox] = {}
_LOCK = threading.Lock()


def open_toolbox(sources: list[str], *, timeout_s: float, max_output_chars: int, headers: dict[str, str] | None = None,
                 connect_timeout_s: float = 60.0) -> ToolBox:
    """The process's :class:`ToolBox` for these sources, limits and headers (connected once, closed at exit)."""
    key = (tuple(sources), timeout_s, max_output_chars, tuple(sorted((headers or {}).items())), connect_timeout_s)
    with _LOCK:
        box = _BOXES.get(key)
        if box is None:
            box = _BOXES[key] = ToolBox(sources, timeout_s=timeout_s, max_output_chars=max_output_chars, headers=headers,
                                        connect_timeout_s=connect_timeout_s)
        return box


def http_headers(api_key_env: str | None, headers: dict[str, str] | None) -> dict[str, str]:
    """The headers sent to the HTTP MCP sources: ``headers`` as given, and with ``api_key_env`` the key in that
    environment variable as ``Authorization: Bearer KEY`` (what ``emapg serve --mcp`` with a key asks for). ConfigError
    when the variable is unset or empty, naming it (never the key)."""
    import os

    out = dict(headers or {})
    if api_key_env:
        key = os.environ.get(api_key_env, "").strip()
        if not key:
            raise ConfigError(f"rollout.tool_api_key_env: the environment variable {api_key_env!r} is unset or empty; set it "
                              "to the MCP server's API key")
        out["Authorization"] = f"Bearer {key}"
    return out


def toolbox_for(rollout: Any) -> ToolBox:
    """The process's :class:`ToolBox` of a :class:`agent.rollout.RolloutConfig` (``tools``, ``tool_timeout_s``,
    ``max_tool_output_chars``, ``tool_connect_timeout_s``, ``tool_api_key_env``, ``tool_headers``)."""
    return open_toolbox(rollout.tools, timeout_s=rollout.tool_timeout_s, max_output_chars=rollout.max_tool_output_chars,
                        headers=http_headers(rollout.tool_api_key_env, rollout.tool_headers),
                        connect_timeout_s=rollout.tool_connect_timeout_s)


def close_toolboxes() -> None:
    with _LOCK:
        boxes = list(_BOXES.values())
        _BOXES.clear()
    for box in boxes:
        box.close()


atexit.register(close_toolboxes)
