"""What an HTTP connection of the servers may hold before it sends a request: a header deadline, a cap on idle connections.

uvicorn (0.54) bounds neither. Its keep-alive timeout runs only after a response, and any byte
received cancels it, so a client that connects and sends nothing, or sends half of a request's
headers and stops (a *slowloris*), holds the connection, its buffers and a file descriptor for as
long as it likes; a few hundred such clients exhaust the server's descriptors. ``limit_concurrency``
does not help: it answers *requests* with 503 once that many connections are open, so idle
connections would lock out real clients rather than the other way round.

:func:`guarded_protocol` returns uvicorn's HTTP/1.1 protocol class (httptools when it is installed,
as uvicorn's ``auto`` picks, else h11) extended with:

* **a header deadline**: a request's headers must be complete ``header_timeout`` seconds after the
  connection opened, or after the previous answer on a kept-alive connection; otherwise the
  connection is closed, with a ``408`` (JSON, ``Connection: close``) when part of a request came.
  Bytes trickling in do not extend it. It also bounds how long a kept-alive connection waits for its
  next request (uvicorn's keep-alive timeout is 60 s here; httpx clients let go of an idle
  connection after 5 s). Once the headers are complete the body has its own deadline
  (``--body-timeout``, :func:`emapg.server_input.read_body`), and the handler all the time it needs.
* **a bound on the headers' size**: more than :data:`MAX_HEAD_BYTES` bytes without the end of the
  headers get ``431`` and the connection is closed (h11 has the same bound built in, and answers 400).
* **a cap on idle connections**: when a new connection would make more than ``max_idle``
  connections idle (no request in progress: fresh, sending headers, or kept alive), the one idle
  longest is closed. A real client sends its headers at once, so the connections that go are the
  stalled ones and pooled ones nobody uses.

Every close the guards decide (and the body deadline's, :func:`emapg.server_input.read_body`) is counted
by cause in :data:`CLOSES` (``header_timeout``: part of a request's headers came, then the deadline;
``idle_timeout``: nothing came before it, a fresh or kept-alive connection; ``idle_cap``: closed to make
room; ``oversized_headers``; ``body_timeout``), which both servers' ``/metrics`` show, and logged at INFO
at most once per cause per minute (with how many closes the line stands for), so a flood of stalled
clients is visible in the log without filling it; ``idle_timeout``, how every kept-alive connection
ends, is logged at DEBUG.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import threading
import time
from typing import Any, Callable

log = logging.getLogger("emapg.connection_guard")

#: Most bytes a request's headers (request line included) may take; h11's own bound is set to the same.
MAX_HEAD_BYTES = 64 << 10

#: The causes of a close, as :data:`CLOSES` counts them.
CLOSE_CAUSES = ("header_timeout", "idle_timeout", "idle_cap", "oversized_headers", "body_timeout")
#: Counted, logged at DEBUG only: a pooled client's kept-alive connection expiring is how keep-alive ends.
ROUTINE_CAUSES = frozenset({"idle_timeout"})


class CloseCounter:
    """Closes by cause; one INFO line per cause per ``log_every_s`` seconds at most (the first at once, a later
    one saying how many closes it stands for). Thread-safe (the body deadline is noted from the event loop,
    tests may run several servers in one process)."""

    def __init__(self, log_every_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.log_every_s, self.clock = log_every_s, clock
        self._counts: collections.Counter[str] = collections.Counter()
        self._unlogged: collections.Counter[str] = collections.Counter()
        self._logged_at: dict[str, float] = {}
        self._lock = threading.Lock()

    def note(self, cause: str, detail: str) -> None:
        with self._lock:
            self._counts[cause] += 1
            self._unlogged[cause] += 1
            now = self.clock()
            last = self._logged_at.get(cause)
            if last is not None and now - last < self.log_every_s:
                return
            n, self._unlogged[cause], self._logged_at[cause] = self._unlogged[cause], 0, now
        since = "" if last is None else f" in the last {now - last:.0f} s"
        level = logging.DEBUG if cause in ROUTINE_CAUSES else logging.INFO
        log.log(level, "closed %d connection(s) (%s)%s; latest: %s", n, cause, since, detail)

    def counts(self) -> dict[str, int]:
        """Every cause, 0 when none happened (so ``/metrics`` always shows the names)."""
        with self._lock:
            return {cause: self._counts[cause] for cause in (*CLOSE_CAUSES, *sorted(set(self._counts) - set(CLOSE_CAUSES)))}


#: This process's closes (both servers run one per process); ``/metrics`` reads it.
CLOSES = CloseCounter()


def _base_protocol() -> type:
    """uvicorn's HTTP/1.1 protocol, as ``http="auto"`` chooses it."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    except ImportError:  # httptools is not installed
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol


def guarded_protocol(header_timeout: float, max_idle: int, base: type | None = None, closes: CloseCounter | None = None) -> type:
    """uvicorn's protocol class (``base``, default :func:`_base_protocol`) with the guards of this module;
    pass it as ``uvicorn.Config(http=...)``. Closes are counted in ``closes`` (default :data:`CLOSES`)."""
    base = base or _base_protocol()

    class GuardedProtocol(_Guard, base):  # type: ignore[misc, valid-type]
        pass

    GuardedProtocol.header_timeout = header_timeout
    GuardedProtocol.max_idle = max_idle
    GuardedProtocol.closes = closes or CLOSES
    GuardedProtocol.__name__ = GuardedProtocol.__qualname__ = f"Guarded{base.__name__}"
    return GuardedProtocol


def _raw_response(status: int, phrase: str, detail: str) -> bytes:
    body = json.dumps({"detail": detail}).encode()
    head = (f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n")
    return head.encode("ascii") + body


class _Guard:
    """The mixin over a uvicorn HTTP protocol (it uses their common ``cycle``, ``transport``, ``connections``, ``loop``)."""

    header_timeout: float = 10.0
    max_idle: int = 256
    closes: CloseCounter = CLOSES
    cycle: Any
    transport: asyncio.Transport
    connections: set
    loop: asyncio.AbstractEventLoop

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._idle_since = time.monotonic()
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()
        self._close_longest_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        super().data_received(data)  # type: ignore[misc]
        if self.cycle is not cycle:  # a request's headers are complete: it is the body's deadline now
            self._disarm()
        elif self._head_timer is not None:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self.closes.note("oversized_headers", f"{self._head_bytes} bytes of headers from {self._peer()}")
                self._refuse(431, "Request Header Fields Too Large",
                             f"the request headers exceed {MAX_HEAD_BYTES} bytes; the connection is closed")

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]  (h11 may start a pipelined request in it)
        self._idle_since = time.monotonic()
        if self._idle() and not self.transport.is_closing():
            self._arm()

    # ------------------------------------------------------------------ the header deadline

    def _idle(self) -> bool:
        """No request in progress: the next one's headers are still to come."""
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        self._head_bytes = 0
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if not self._idle() or self.transport.is_closing():
            return
        if self._head_bytes:  # part of a request came: say why it goes unanswered
            self.closes.note("header_timeout", f"{self._head_bytes} bytes of request headers from {self._peer()} "
                                               f"in {self.header_timeout:g} s")  # fmt: skip
            self._refuse(408, "Request Timeout",
                         f"the request headers did not arrive within {self.header_timeout:g} s; the connection is closed")
        else:  # nothing came (a fresh or kept-alive connection): close it, as any idle connection may be
            self.closes.note("idle_timeout", f"{self._peer()} sent nothing for {self.header_timeout:g} s")
            self.transport.close()

    def _peer(self) -> str:
        peer = self.transport.get_extra_info("peername")
        return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "a client"

    def _refuse(self, status: int, phrase: str, detail: str) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self.transport.write(_raw_response(status, phrase, detail))
            self.transport.close()

    # ------------------------------------------------------------------ the idle cap

    def _close_longest_idle(self) -> None:
        if len(self.connections) <= self.max_idle:  # fewer connections than the cap: fewer idle ones too
            return
        idle = [c for c in self.connections if c is not self and isinstance(c, _Guard) and c._idle()
                and not c.transport.is_closing()]
        if len(idle) + 1 > self.max_idle:
            oldest = min(idle, key=lambda c: c._idle_since)
            self.closes.note("idle_cap", f"{len(idle) + 1} idle connections (cap {self.max_idle}): closed {oldest._peer()}, "
                                         f"idle for {time.monotonic() - oldest._idle_since:.1f} s")  # fmt: skip
            oldest._disarm()
            oldest.transport.close()
