"""CPU-heavy request work off the servers' event loop, with a bound: :class:`RequestWorkers`.

A handler's own Python runs on the event loop, so anything slow there (rendering a chat template over a
long conversation, tokenizing megabytes of text, assembling and encoding a large recorded session) stalls
every other request, ``/health`` included. :meth:`RequestWorkers.run` hands such work to a few threads
instead. Threads are enough: the tokenizers' Rust code releases the GIL while it encodes, and pure-Python
work (Jinja rendering) gives it up every switch interval (5 ms), so the loop keeps answering either way.

The bound: at most ``workers`` jobs run and ``max_waiting`` more wait; a request beyond that is refused
at once (503, ``Retry-After: 1``, reason ``busy``) rather than queued without limit, since what a waiting
job holds (its request) is what the bound protects. A job whose client went away still runs to the end
(a thread cannot be stopped) and keeps its place in the count until it does.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from emapg.server_input import HTTPError

__all__ = ["RequestWorkers"]

T = TypeVar("T")


class RequestWorkers:
    """``workers`` threads for request work, at most ``max_waiting`` jobs queued behind them (module docstring)."""

    def __init__(self, workers: int, max_waiting: int, name: str = "request-work") -> None:
        if workers < 1 or max_waiting < 0:
            raise ValueError(f"RequestWorkers needs workers >= 1 and max_waiting >= 0, got {workers}, {max_waiting}")
        self.workers, self.max_waiting = workers, max_waiting
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._lock = threading.Lock()
        self._pending = 0  # submitted and not finished (running + waiting)
        self.done = 0  # jobs finished (answered or not)
        self.refused = 0

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread; its exception (an :class:`HTTPError` too) is raised here."""
        with self._lock:
            if self._pending >= self.workers + self.max_waiting:
                self.refused += 1
                raise HTTPError(503, f"the server is busy preparing {self._pending} large requests (--prep-workers "
                                     f"{self.workers}, --prep-max-waiting {self.max_waiting}); retry shortly",
                                "busy", retry_after=1)  # fmt: skip
            self._pending += 1
        future = self._pool.submit(fn, *args)
        future.add_done_callback(self._finished)
        return await asyncio.wrap_future(future)

    def _finished(self, _future) -> None:
        with self._lock:
            self._pending -= 1
            self.done += 1

    def stats(self) -> dict[str, int]:
        """For ``/metrics``: the bound, the jobs in hand now (``pending``: running + waiting), finished and refused ones."""
        with self._lock:
            return {"workers": self.workers, "max_waiting": self.max_waiting, "pending": self._pending,
                    "done": self.done, "refused": self.refused}  # fmt: skip

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
