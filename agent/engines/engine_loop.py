"""The one thread of the generation server that owns the engine (agent/engines/server.py).

Generation requests are fed to the engine's continuous-batching interface (``submit``/``step``):
requests that arrive while others run join them at the next engine step (vLLM), or are collected
for ``max_wait_s`` and run as one batch (transformers). Everything else (weight loads, score,
sleep) is a *barrier*: it runs once the in-flight generations have finished, and generations
submitted after it wait for it, so a request is served entirely by one set of weights.

A request that breaks an engine step fails alone: the server validates every request before it
reaches the engine, and when a step fails anyway, which request caused it is unknown, so each
request that was in the step is run again on its own; only one that also fails alone fails
(its batch mates get the answers they would have got without it).
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

from agent.engines.base import GenerationOutput, SamplingParams
from emapg.server_input import HTTPError

log = logging.getLogger("agent.engines.server")


@dataclass
class _GenJob:
    """One /generate request: its prompts and params, and the outputs collected so far."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    outputs: list[GenerationOutput | None]
    remaining: int
    future: Future


def _resolve(fut: Future, result: Any = None, exc: BaseException | None = None) -> None:
    if fut.done():  # cancelled: the client went away
        return
    try:
        fut.set_exception(exc) if exc is not None else fut.set_result(result)
    except Exception:  # noqa: BLE001 - cancelled in between
        pass


class _Stop(Exception):
    pass


class EngineStepError(RuntimeError):
    """The engine failed on this request (also when it ran alone)."""


#: Errors after which an engine serves nothing again (vLLM's ``EngineDeadError``: its engine core or a worker
#: process died, e.g. killed for memory). Matched by class name anywhere in the chain, so vLLM need not be imported.
FATAL_ENGINE_ERRORS = ("EngineDeadError",)


def is_fatal(error: BaseException) -> bool:
    """The engine died with ``error`` (:data:`FATAL_ENGINE_ERRORS`), rather than failing one request."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if type(e).__name__ in FATAL_ENGINE_ERRORS:
            return True
        e = e.__cause__ or e.__context__
    return False


class _Fatal(Exception):
    """The engine died: the loop stops, /health reports it and the server exits (``on_fatal``)."""


class EngineLoop:
    """The one thread that owns the engine: loads it, admits generations, steps it, runs barriers."""

    def __init__(self, load: Callable[[], Any], max_wait_s: float, on_fatal: Callable[[str], None] | None = None) -> None:
        self._load = load
        self.max_wait_s = max_wait_s
        self.on_fatal = on_fatal
        self.engine: Any = None
        self.status = "loading"
        self.error: str | None = None
        self.asleep = False
        self._q: queue.Queue = queue.Queue()
        self._jobs: dict[str, tuple[_GenJob, int]] = {}  # engine request id -> (job, prompt index)
        self._ids = itertools.count()
        self.counters: collections.Counter[str] = collections.Counter()
        self._thread = threading.Thread(target=self._main, name="engine-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=30)

    @property
    def in_flight(self) -> int:
        return len(self._jobs)

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> Future:
        fut: Future = Future()
        self._q.put(("gen", (prompts, params), fut))
        return fut

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn()`` in the engine thread once in-flight generations are done (a barrier)."""
        fut: Future = Future()
        self._q.put(("call", fn, fut))
        return fut

    def _main(self) -> None:
        t0 = time.perf_counter()
        try:
            self.engine = self._load()
        except Exception as e:  # noqa: BLE001 - reported through /health and the exit code
            self.status, self.error = "failed", f"{type(e).__name__}: {e}"
            log.error("loading the engine failed: %s", self.error)
            if self.on_fatal is not None:
                self.on_fatal(self.error)
            return
        self.status = "ok"
        log.info("engine %s loaded in %.1f s", self.engine.info.kind, time.perf_counter() - t0)
        collect = 0.0 if self.engine.info.continuous_batching else self.max_wait_s
        waiting: collections.deque = collections.deque()
        try:
            while True:
                items = []
                if not self.engine.has_unfinished() and not waiting:
                    items.append(self._q.get())  # idle: block
                    if collect and items[0] is not None and items[0][0] == "gen":
                        time.sleep(collect)  # let concurrent requests join this batch
                while True:
                    try:
                        items.append(self._q.get_nowait())
                    except queue.Empty:
                        break
                if any(item is None for item in items):
                    raise _Stop
                waiting.extend(items)
                while waiting:
                    kind, payload, fut = waiting[0]
                    if kind == "gen":
                        waiting.popleft()
                        self._admit(payload, fut)
                    elif self.engine.has_unfinished():
                        break  # barrier: let the running generations finish first
                    else:
                        waiting.popleft()
                        self._run_call(payload, fut)
                if self.engine.has_unfinished():
                    self._step()
        except _Stop:
            pass
        except _Fatal as fatal:
            self.status, self.error = "failed", str(fatal)
            log.error("the engine died: %s; failing every request and stopping the server", self.error)
            if self.on_fatal is not None:
                self.on_fatal(self.error)
        finally:
            err = RuntimeError("the generation server is shutting down" if self.status == "ok" else f"the engine died: {self.error}")
            for job, _ in list(self._jobs.values()):
                _resolve(job.future, exc=err)
            for _, _, fut in waiting:
                _resolve(fut, exc=err)
            self.engine.close()

    def _admit(self, payload: tuple[list[list[int]], list[SamplingParams]], fut: Future) -> None:
        prompts, params = payload
        if fut.done():
            return
        if self.asleep:
            _resolve(fut, exc=HTTPError(409, "the engine is asleep; POST /wake first"))
            return
        job = _GenJob(prompts, params, [None] * len(prompts), len(prompts), fut)
        try:
            self._submit(job, range(len(prompts)))
        except Exception as e:  # noqa: BLE001 - requests already submitted finish and are dropped
            _resolve(fut, exc=e)
            if is_fatal(e):
                raise _Fatal(f"{type(e).__name__}: {e}") from e
        self.counters["prompts"] += len(prompts)

    def _submit(self, job: _GenJob, indices) -> None:
        n = next(self._ids)
        for i in indices:
            rid = f"g{n}-{i}"  # fresh ids on a re-run: the engine may still know the old ones
            self.engine.submit(rid, job.prompts[i], job.params[i])
            self._jobs[rid] = (job, i)

    def _collect(self, finished: list[tuple[str, GenerationOutput]]) -> None:
        self.counters["steps"] += 1
        for rid, out in finished:
            job, i = self._jobs.pop(rid, (None, 0))
            if job is None:
                continue
            self.counters["tokens"] += len(out.token_ids)
            job.outputs[i] = out
            job.remaining -= 1
            if job.remaining == 0:
                _resolve(job.future, job.outputs)

    def _step(self) -> None:
        try:
            finished = self.engine.step()
        except Exception as e:  # noqa: BLE001 - isolate the request that broke it
            if is_fatal(e):
                raise _Fatal(f"{type(e).__name__}: {e}") from e
            self._rerun_alone(e)
            return
        self._collect(finished)

    def _abort(self, request_ids: list[str]) -> None:
        abort = getattr(self.engine, "abort", None)
        if abort is not None and request_ids:
            try:
                abort(request_ids)
            except Exception:  # noqa: BLE001 - an engine that cannot abort finishes them unseen
                log.warning("could not abort %d engine requests", len(request_ids), exc_info=True)

    def _rerun_alone(self, error: Exception) -> None:
        """A step failed: run each request that was in it again on its own; fail only those that fail alone."""
        in_step = dict(self._jobs)
        self._jobs.clear()
        self._abort(list(in_step))
        jobs: dict[int, _GenJob] = {}
        for job, _ in in_step.values():
            jobs.setdefault(id(job), job)
        self.counters["failed_steps"] += 1
        if len(jobs) == 1:
            log.warning("engine step failed for one request: %s: %s", type(error).__name__, error)
            _resolve(next(iter(jobs.values())).future, exc=EngineStepError(f"engine step failed: {type(error).__name__}: {error}"))
            return
        log.warning("engine step failed with %d requests in it (%s: %s); running each alone", len(jobs), type(error).__name__, error)
        for job in jobs.values():
            pending = [i for rid, (j, i) in in_step.items() if j is job]
            try:
                self._submit(job, pending)
                while self.engine.has_unfinished():
                    self._collect(self.engine.step())
            except Exception as e:  # noqa: BLE001 - this request is the culprit
                if is_fatal(e):
                    raise _Fatal(f"{type(e).__name__}: {e}") from e
                mine = [rid for rid, (j, _) in self._jobs.items() if j is job]
                for rid in mine:
                    del self._jobs[rid]
                self._abort(mine)
                self.counters["failed_requests"] += 1
                _resolve(job.future, exc=EngineStepError(f"engine step failed: {type(e).__name__}: {e}"))

    def _run_call(self, fn: Callable[[], Any], fut: Future) -> None:
        if fut.done():
            return
        try:
            _resolve(fut, fn())
        except BaseException as e:  # noqa: BLE001 - handed to the request
            _resolve(fut, exc=e)
