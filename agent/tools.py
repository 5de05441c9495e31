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
from emapg.server_input import MAX_JSON_DEPTH

log = logging.getLogger(__name__)

__all__ = ["BUILTIN_SEARCH", "ToolResult", "ToolBox", "ToolConnectError", "open_toolbox", "toolbox_for", "http_headers",
           "check_sources", "close_toolboxes"]

BUILTIN_SEARCH = "search"
CONNECT_ATTEMPTS = 3
CALCULATOR = "calculator"
MAX_ARGUMENT_CHARS = 1 << 20  # a tool call's arguments as JSON; a model's real calls are a few hundred characters


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


def argument_problem(arguments: Any) -> str | None:
    """What makes a tool call's ``arguments`` unfit to send (None: fit): not a JSON object, nested more than
    :data:`emapg.server_input.MAX_JSON_DEPTH` levels, a string or key that is not valid Unicode (a lone surrogate,
    which a model's text can hold and no transport can encode), a number JSON cannot carry (NaN, infinity, an integer
    past the interpreter's digit limit), or more than :data:`MAX_ARGUMENT_CHARS` characters as JSON."""
    from emapg.server_input import HTTPError, check_json_value

    if not isinstance(arguments, dict):
        return f"the arguments must be a JSON object, got {type(arguments).__name__}"
    try:
        check_json_value(arguments, "the arguments", max_depth=MAX_JSON_DEPTH)
        size = len(json.dumps(arguments, allow_nan=False))
    except HTTPError as e:
        return e.message
    except (ValueError, TypeError) as e:  # NaN or infinity, an over-long integer, a value JSON has no form for
        return f"the arguments are not JSON a tool can receive ({str(e)[:200]})"
    if size > MAX_ARGUMENT_CHARS:
        return f"the arguments are {size} characters as JSON, more than {MAX_ARGUMENT_CHARS}"
    return None


def _connection_lost(e: BaseException) -> bool:
    """Whether a call failed because its client's connection is gone (the SDK's CONNECTION_CLOSED error, or a closed
    or broken stream), rather than with an answer of the server."""
    import anyio
    from mcp.types import CONNECTION_CLOSED

    e = _cause(e)
    code = getattr(getattr(e, "error", None), "code", None)
    return code == CONNECTION_CLOSED or isinstance(e, (anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream))


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
        self._owner: dict[str, str] = {}  # tool name -> its source
        self._clients: dict[str, Any] = {}  # source -> its connected client
        self._holders: dict[str, asyncio.Future] = {}  # source -> the task that holds its client's context (_hold)
        self._reconnecting: dict[str, asyncio.Lock] = {}
        self.reconnects = 0  # clients connected again after their transport failed
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="emapg-mcp-tools", daemon=True)
        self._thread.start()
        self._closing: asyncio.Event | None = None
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
                    asyncio.run_coroutine_threadsafe(self._close_holders(), self._loop).result(20)
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
        """Connect every source (each in a task of its own: :meth:`_hold`) and collect the tools they offer."""
        self._closing = asyncio.Event()
        names: dict[str, str] = {}
        if self.builtin_search:
            from agent.formats import SEARCH_TOOL

            self.schemas.append(SEARCH_TOOL)
            names[BUILTIN_SEARCH] = "the built-in search"
        for source in self.sources:
            if source == BUILTIN_SEARCH:
                continue
            for tool in await self._connect(source):
                if tool.name in names:
                    raise RuntimeError(f"the tool {tool.name!r} of {source!r} is also offered by {names[tool.name]}")
                names[tool.name] = repr(source)
                self._owner[tool.name] = source
                self.schemas.append(_schema(tool))

    async def _connect(self, source: str) -> list[Any]:
        """Start ``source``'s holder task; its tools once its client is connected (the error of the connect otherwise)."""
        started: asyncio.Future = self._loop.create_future()
        self._holders[source] = asyncio.ensure_future(self._hold(source, started))
        client, tools = await started
        self._clients[source] = client
        return tools

    async def _hold(self, source: str, started: asyncio.Future) -> None:
        """Enter ``source``'s client (its context must be left by the task that entered it), list its tools, then
        wait for :meth:`close`. One source per task: a client whose transport fails ends its own task only, never
        another source's client (:meth:`_live_client` reconnects it)."""
        try:  # every exit, an import's included, resolves ``started`` (else _open would wait out the whole deadline)
            from contextlib import AsyncExitStack

            from mcp import Client, StdioServerParameters

            async with AsyncExitStack() as stack:
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
                    phase = self._connecting[1] if self._connecting else "connect"
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
                started.set_result((client, tools))
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
            elif self._closing is not None and not self._closing.is_set() and not isinstance(e, asyncio.CancelledError):
                log.warning("the MCP client of %r closed (%s: %s); the next call reconnects it", source, type(e).__name__, e)

    async def _drop(self, source: str) -> None:
        """End ``source``'s holder task (its client's context unwinds there), so :meth:`_live_client` reconnects it."""
        holder = self._holders.get(source)
        if holder is not None and not holder.done():
            log.warning("the MCP server %r closed its connection; the next call reconnects it", source)
            holder.cancel()
            await asyncio.wait([holder], timeout=10)

    async def _live_client(self, source: str) -> Any:
        """``source``'s client, reconnected first when its holder task has ended (its transport failed)."""
        holder = self._holders.get(source)
        if holder is not None and not holder.done():
            return self._clients[source]
        lock = self._reconnecting.setdefault(source, asyncio.Lock())
        async with lock:  # concurrent calls of a dead source reconnect it once
            holder = self._holders.get(source)
            if holder is None or holder.done():
                self._timed_out = None
                await self._connect(source)
                self.reconnects += 1
            return self._clients[source]

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

    async def _call(self, name: str, arguments: Any) -> ToolResult:
        source = self._owner.get(name)
        if source is None:
            return ToolResult(f"Error: unknown tool {name!r}; the tools are {', '.join(self.names())}.", "unknown tool")
        problem = argument_problem(arguments)
        if problem is not None:  # before any client sees them: what a client cannot encode must never reach it
            return ToolResult(f"Error: {name} was not called: {problem}."[:1000], "invalid arguments")
        try:
            client = await asyncio.wait_for(self._live_client(source), self.timeout_s)
        except Exception as e:  # noqa: BLE001 - the server cannot be reached again: this call fails, the next one retries
            e = _cause(e)
            return ToolResult(f"Error: the tool {name} is unavailable: its server could not be reconnected "
                              f"({type(e).__name__}: {e})"[:1000], "disconnected")
        try:
            result = await asyncio.wait_for(client.call_tool(name, arguments), self.timeout_s)
        except asyncio.TimeoutError:
            return ToolResult(f"Error: the tool {name} did not answer within {self.timeout_s:g} s.", "timeout")
        except Exception as e:  # noqa: BLE001 - the server's or the transport's: the model is told, the batch goes on
            if _connection_lost(e):  # the server or its transport is gone: the next call of this source reconnects
                await self._drop(source)
            return ToolResult(f"Error: the tool {name} failed: {type(e).__name__}: {e}"[:1000], f"{type(e).__name__}")
        text = _result_text(result).strip()
        reason = "tool error" if result.is_error else None
        if result.is_error and not text.startswith("Error"):
            text = f"Error: {text}"
        if len(text) > self.max_output_chars:
            text = f"{text[: self.max_output_chars]}\n[output cut: {len(text)} characters, the limit is {self.max_output_chars}]"
            reason = reason or "oversized"
        return ToolResult(text, reason)

    async def _call_all(self, calls: list[tuple[str, Any]]) -> list[ToolResult]:
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

    async def _close_holders(self) -> None:
        """Let every holder task leave its client's context (at most 10 s; a server that will not close is left to its
        process group)."""
        if self._closing is None:
            return
        self._closing.set()
        holders = [h for h in self._holders.values() if not h.done()]
        if holders:
            _, pending = await asyncio.wait([asyncio.shield(h) for h in holders], timeout=10)
            if pending:
                for h in holders:
                    h.cancel()
        self._holders.clear()
        self._clients.clear()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._close_holders(), self._loop).result(15)
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
