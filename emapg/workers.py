"""A killable worker-process pool with a per-item deadline, for any importable function.

:class:`WorkerPool` runs ``task(*args)`` for a list of argument tuples in worker processes, and the
*parent* enforces each item's deadline: a worker that overruns it (or dies) is killed and replaced, so
one pathological input costs one item, never the batch. This is what untrusted model output needs when
a checker may hang (math-verify on a power tower) or crash; the math grader (:mod:`tasks.math`) is one
user.

Workers are plain ``python -c`` subprocesses talking over two pipes with multiprocessing's framed
pickles. Unlike multiprocessing's spawn/forkserver children they never re-import the caller's
``__main__`` (which breaks scripts without a main guard and re-runs notebooks), and they inherit no CUDA
or thread state from a training process. The pipes carry only what this process itself sends and its
own children answer; nothing from outside is unpickled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Literal

__all__ = ["Outcome", "WorkerPool", "importable_name"]

#: One item's outcome: ``("ok", value)``, ``("error", message)`` or ``("timeout", None)``.
Outcome = tuple[Literal["ok", "error", "timeout"], Any]

_BOOT = (
    "import json, sys; sys.path[:0] = json.loads(sys.argv[1]); "
    "from emapg.workers import _worker_entry; _worker_entry(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])"
)


def importable_name(func: Callable[..., Any]) -> str:
    """``"module:qualname"`` of a module-level function (what a worker imports), or a ValueError."""
    name = f"{func.__module__}:{func.__qualname__}"
    if "<" in name or func.__module__ == "__main__":
        raise ValueError(f"task must be a module-level function importable by workers, got {name}")
    return name


def _resolve(name: str) -> Callable[..., Any]:
    import importlib

    module, qualname = name.split(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _worker_entry(read_fd: int, write_fd: int, task_name: str, warmup_name: str) -> None:
    """Worker loop: import the task (and run the warm-up), announce readiness, run ``task(*args)`` until None."""
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    task = _resolve(task_name)
    if warmup_name:
        _resolve(warmup_name)()
    outbox.send(("ready", None))
    while True:
        try:
            args = inbox.recv()
        except EOFError:  # the parent went away
            return
        if args is None:
            return
        try:
            outbox.send(("ok", task(*args)))
        except Exception as e:  # report, keep serving
            outbox.send(("error", f"{type(e).__name__}: {e}"))


@dataclass
class _Worker:
    proc: subprocess.Popen
    inbox: Connection  # the parent reads results here
    outbox: Connection  # the parent sends items here
    ready: bool = False
    job: int | None = None
    deadline: float = 0.0


class WorkerPool:
    """Worker processes running ``task(*args)`` with a per-item deadline enforced by the parent.

    ``map(items, timeout)`` returns one :data:`Outcome` per item, in order. Thread-safe (one map at a
    time); workers start on first use and live until :meth:`close`.

    Args:
        workers: number of worker processes.
        task: a module-level function; workers import it by name.
        warmup: optional module-level function each new worker calls once before it reports ready (an
            expensive import), so the start-up cost does not count against the first item's deadline.
        startup_timeout: seconds a new worker may take to import the task and warm up.
    """

    what = "worker"

    def __init__(self, workers: int, task: Callable[..., Any], *, warmup: Callable[[], Any] | None = None,
                 startup_timeout: float = 120.0) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self._task_name = importable_name(task)
        self._warmup_name = importable_name(warmup) if warmup is not None else ""
        self._n = workers
        self._startup_timeout = startup_timeout
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        self.timeouts = 0  # items that hit their deadline, over the pool's life
        self.restarts = 0  # workers killed and replaced

    def _start_worker(self) -> _Worker:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, json.dumps(sys.path), str(to_child_r), str(from_child_w),
                 self._task_name, self._warmup_name],
                pass_fds=(to_child_r, from_child_w),
                stdin=subprocess.DEVNULL,
            )
        finally:
            os.close(to_child_r)
            os.close(from_child_w)
        w = _Worker(proc=proc, inbox=Connection(from_child_r, writable=False), outbox=Connection(to_child_w, readable=False))
        w.deadline = time.monotonic() + self._startup_timeout
        return w

    @staticmethod
    def _kill(w: _Worker) -> None:
        if w.proc.poll() is None:
            w.proc.kill()
        w.proc.wait(timeout=10)
        w.inbox.close()
        w.outbox.close()

    def _replace(self, w: _Worker) -> None:
        self._kill(w)
        self._workers[self._workers.index(w)] = self._start_worker()
        self.restarts += 1

    def map(self, items: Sequence[tuple], timeout: float) -> list[Outcome]:
        """Run ``task(*item)`` for every item; each item may take ``timeout`` seconds of a worker's time."""
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{type(self).__name__} is closed")
            while len(self._workers) < min(self._n, max(1, len(items))):
                self._workers.append(self._start_worker())
            return self._run(list(items), timeout)

    def _run(self, items: list[tuple], timeout: float) -> list[Outcome]:
        results: list[Outcome | None] = [None] * len(items)
        pending = deque(range(len(items)))
        remaining = len(items)
        while remaining:
            for w in self._workers:
                if w.ready and w.job is None and pending:
                    w.job = pending.popleft()
                    w.deadline = time.monotonic() + timeout
                    w.outbox.send(items[w.job])
            now = time.monotonic()
            first_deadline = min(w.deadline for w in self._workers)
            wait_for = None if first_deadline == float("inf") else max(0.0, first_deadline - now)
            readable = set(wait([w.inbox for w in self._workers], timeout=wait_for))
            for w in list(self._workers):
                if w.inbox in readable:
                    try:
                        kind, value = w.inbox.recv()
                    except (EOFError, OSError):
                        code = w.proc.wait(timeout=10)
                        if not w.ready:  # it cannot even start: retrying would loop forever
                            raise RuntimeError(
                                f"{self.what} process for {self._task_name} exited with code {code} during startup; "
                                "see its stderr above"
                            ) from None
                        if w.job is not None:
                            results[w.job] = ("error", f"worker died (exit code {code})")
                            remaining -= 1
                        self._replace(w)
                        continue
                    if kind == "ready":
                        w.ready = True
                        w.deadline = float("inf")
                    else:
                        results[w.job] = (kind, value)
                        remaining -= 1
                        w.job = None
                        w.deadline = float("inf")
                elif time.monotonic() >= w.deadline:
                    if not w.ready:
                        raise RuntimeError(f"{self.what} process did not start within {self._startup_timeout:.0f} s")
                    results[w.job] = ("timeout", None)
                    remaining -= 1
                    self.timeouts += 1
                    self._replace(w)
        return results  # type: ignore[return-value]

    def close(self) -> None:
        """Ask every worker to exit, then kill what is left."""
        with self._lock:
            self._closed = True
            for w in self._workers:
                try:
                    w.outbox.send(None)
                except OSError:
                    pass
            for w in self._workers:
                try:
                    w.proc.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    pass
                self._kill(w)
            self._workers.clear()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
