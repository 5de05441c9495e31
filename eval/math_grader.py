"""Math answer extraction and grading (the math reward and the math benchmarks).

Extraction follows the paper's grader (rllm ``math_reward.py``, ALGORITHM.md §5):

1. If the response contains exactly one ``</think>``, only the text after it is graded;
   otherwise the whole response is (the format reward is off).
2. The answer is the last ``\\boxed{…}`` / ``\\fbox{…}`` (balanced braces), ``\\boxed x``
   (brace-less, up to ``$`` or end of line) or ``<|begin_of_box|>…<|end_of_box|>``, whichever
   starts last. No box: incorrect, reason ``no_answer``.
3. Gold answers may be a string or a list (any one matching counts); a ``\\boxed`` in a gold
   answer is unwrapped.

Grading departs from the paper, which used ``grade_answer_mathd`` OR rllm's own sympy check:

* ``grader="math_verify"`` (default): HF math-verify ``parse``/``verify`` on both sides.
* ``grader="mathd_or_math_verify"``: a MATH-style string normaliser (:func:`mathd_normalize`)
  first, then math-verify. This is the closest to the paper's grader; it accepts a few
  answers math-verify rejects (for instance a trailing ``\\text{ cm}`` unit on one side).

The grader used is recorded in every results file, because published numbers move by a point
or more between graders (PRIOR_ART.md §5 item 7).

math-verify's own timeouts use ``signal.alarm`` and fail outside the main thread, so they
are disabled here; grading runs instead in worker *processes* (:class:`GraderPool`) and the
parent enforces a per-item deadline: a stuck worker is killed and replaced, and the item counts as incorrect
with reason ``timeout``.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Literal

__all__ = [
    "Grader",
    "GRADERS",
    "GradeResult",
    "GraderPool",
    "split_after_think",
    "last_boxed",
    "extract_math_answer",
    "unwrap_gold",
    "mathd_normalize",
    "grade_answer",
    "grade_many",
    "math_reward",
    "default_workers",
    "shutdown_shared_pool",
]

Grader = Literal["math_verify", "mathd_or_math_verify"]
GRADERS: tuple[str, ...] = ("math_verify", "mathd_or_math_verify")


@dataclass(frozen=True)
class GradeResult:
    """Outcome for one prediction.

    ``reason`` is one of ``math_verify`` / ``mathd`` (correct, and which check accepted it),
    ``mismatch``, ``no_answer`` (nothing boxed), ``timeout`` or ``error: <message>``.
    """

    correct: bool
    extracted: str | None
    reason: str


# --------------------------------------------------------------------------- extraction

_BOX_OPENERS = ("\\boxed", "\\fbox")
_BEGIN_BOX, _END_BOX = "<|begin_of_box|>", "<|end_of_box|>"


def split_after_think(response: str) -> str:
    """The graded part of a response: after the ``</think>`` if there is exactly one."""
    parts = response.split("</think>")
    return parts[1] if len(parts) == 2 else response


def _braced(text: str, start: int) -> str | None:
    """Content of the brace group opening at ``text[start] == "{"`` (None if unbalanced)."""
    depth = 0
    for i in range(start, len(text)):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
    return None


def _box_at(text: str, pos: int, opener: str) -> str | None:
    """Parse the box whose command ``opener`` starts at ``pos``."""
    i = pos + len(opener)
    if i < len(text) and text[i] == "{":
        return _braced(text, i)
    if i < len(text) and text[i] == " ":  # "\boxed 5": up to "$" or the end of the line
        rest = re.split(r"[$\n]", text[i + 1 :], maxsplit=1)[0].strip()
        return rest or None
    return None  # "\boxedx" or a trailing "\boxed" is not a box


def last_boxed(text: str) -> str | None:
    """Content of the last well-formed box in ``text`` (see the module docstring)."""
    candidates: list[tuple[int, str]] = []
    for opener in _BOX_OPENERS:
        for m in re.finditer(re.escape(opener), text):
            content = _box_at(text, m.start(), opener)
            if content is not None:
                candidates.append((m.start(), content))
    start = text.rfind(_BEGIN_BOX)
    if start >= 0:
        end = text.find(_END_BOX, start)
        if end >= 0:
            candidates.append((start, text[start + len(_BEGIN_BOX) : end]))
    if not candidates:
        return None
    return max(candidates, key=lambda c: c[0])[1].strip()


def extract_math_answer(response: str) -> str | None:
    """The answer the grader sees: last box of the post-``</think>`` text, or None."""
    return last_boxed(split_after_think(response))


def unwrap_gold(gold: str | float | int | Sequence[str | float | int]) -> list[str]:
    """Gold answer(s) as a non-empty list of strings with any ``\\boxed{}`` removed."""
    items = [gold] if isinstance(gold, (str, int, float)) else list(gold)
    out = []
    for g in items:
        g = str(g).strip()
        boxed = last_boxed(g) if any(o in g for o in _BOX_OPENERS) else None
        out.append(boxed if boxed is not None else g)
    if not out or not any(out):
        raise ValueError(f"empty gold answer: {gold!r}")
    return out


# --------------------------------------------------------------------------- mathd normaliser


def _fix_fracs(s: str) -> str:
    # "\frac12" -> "\frac{1}{2}", "\frac1{2}" -> "\frac{1}{2}", "\frac{1}2" -> "\frac{1}{2}"
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    return re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)


def mathd_normalize(answer: str) -> str:
    """MATH-style string normalisation (Hendrycks et al.'s ``is_equiv``, as in the paper's
    ``grade_answer_mathd``), written independently.

    Removes spacing commands, ``\\left``/``\\right``, degrees, dollars, percent signs and a
    trailing ``\\text{ unit}``; writes ``tfrac``/``dfrac`` as ``frac``; adds the leading zero
    to ``.5``; drops a short left-hand side (``x = 3`` → ``3``); braces ``\\sqrt3`` and
    ``\\frac12``; removes spaces; maps ``0.5`` and integer ``a/b`` to ``\\frac``. Addition:
    integer-valued decimals (``142.0``, AMC's stored format) become integers.
    """
    s = answer.strip()
    whole_text = re.fullmatch(r"\\text\{(.*)\}", s)
    if whole_text:
        s = whole_text.group(1)
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "")
    if "\\text{ " in s:  # a unit written as "5 \text{ cm}"
        s = s.split("\\text{ ")[0]
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    if s.count("=") == 1:
        lhs, rhs = s.split("=")
        if len(lhs.strip()) <= 2:
            s = rhs
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    m = re.fullmatch(r"(-?\d+)/(\d+)", s)
    if m:
        s = f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}"
    if re.fullmatch(r"-?\d+\.0+", s):
        s = s.split(".")[0]
    return s


# --------------------------------------------------------------------------- grading (worker side)

_MV_READY = False


def _load_math_verify() -> None:
    global _MV_READY
    if not _MV_READY:
        import math_verify  # noqa: F401  (heavy: sympy, latex2sympy2)

        # We disable math-verify's signal timeouts on purpose (the parent enforces them);
        # silence its one-time warning about that.
        logging.getLogger("math_verify").setLevel(logging.ERROR)
        _MV_READY = True


@functools.lru_cache(maxsize=4096)
def _parse_boxed(text: str) -> tuple:
    """math-verify's parse of ``\\boxed{text}``, cached per worker: a gold answer is graded
    against every sample of its problem (n = 32 in the paper's protocol), and parsing is about
    half the cost of a grading."""
    from math_verify import parse

    _load_math_verify()
    # Wrapping in \boxed{} makes math-verify parse exactly this string (its boxed extractor)
    # instead of hunting for "the answer is" patterns. Parsed sympy objects are immutable.
    return tuple(parse(f"\\boxed{{{text}}}", parsing_timeout=None))


def _math_verify_equal(pred: str, gold: str) -> bool:
    from math_verify import verify

    gold_parsed = list(_parse_boxed(gold))
    pred_parsed = list(_parse_boxed(pred))
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def grade_answer(extracted: str, golds: Sequence[str], grader: Grader = "math_verify") -> tuple[bool, str]:
    """Grade one extracted answer against unwrapped golds *in this process, without timeout*.

    Returns ``(correct, reason)``. Use :func:`grade_many` for untrusted model output.
    """
    if grader not in GRADERS:
        raise ValueError(f"unknown grader {grader!r}; choose from {', '.join(GRADERS)}")
    if grader == "mathd_or_math_verify":
        norm = mathd_normalize(extracted)
        if norm and any(norm == mathd_normalize(g) for g in golds):
            return True, "mathd"
    if any(_math_verify_equal(extracted, g) for g in golds):
        return True, "math_verify"
    return False, "mismatch"


# --------------------------------------------------------------------------- process pool

# Workers are plain ``python -c`` subprocesses talking over two pipes with
# multiprocessing's framed pickles. Unlike multiprocessing's spawn/forkserver children they
# never re-import the caller's ``__main__`` (which breaks scripts without a main guard and
# re-runs notebooks), and they inherit no CUDA or thread state from a training process.
_BOOT = (
    "import json, sys; sys.path[:0] = json.loads(sys.argv[1]); "
    "from eval.math_grader import _worker_entry; _worker_entry(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])"
)


def _task_name(task: Callable[..., Any]) -> str:
    name = f"{task.__module__}:{task.__qualname__}"
    if "<" in name or task.__module__ == "__main__":
        raise ValueError(f"task must be a module-level function importable by workers, got {name}")
    return name


def _worker_entry(read_fd: int, write_fd: int, task_name: str) -> None:
    """Worker loop: import the task, announce readiness, run ``task(*args)`` until None."""
    import importlib

    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    module, qualname = task_name.split(":")
    task: Any = importlib.import_module(module)
    for part in qualname.split("."):
        task = getattr(task, part)
    if task is grade_answer:
        _load_math_verify()
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
    inbox: Connection  # parent reads results here
    outbox: Connection  # parent sends tasks here
    ready: bool = False
    job: int | None = None
    deadline: float = 0.0


class GraderPool:
    """Worker processes running ``task(*args)`` with a per-item deadline enforced here.

    ``map(items, timeout)`` returns, per item, ``("ok", value)``, ``("error", message)`` or
    ``("timeout", None)``. A worker that overruns its deadline or dies is killed and replaced,
    so one pathological input costs one item, never the batch. Thread-safe (one map at a time).

    Args:
        workers: number of worker processes (started on first use, kept until ``close``).
        task: a module-level function; workers import it by name.
        startup_timeout: seconds a new worker may take to import the task (math-verify and
            sympy take a few seconds on a busy machine).
    """

    def __init__(self, workers: int = 2, task: Callable[..., Any] = grade_answer, startup_timeout: float = 120.0) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self._task_name = _task_name(task)
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
                [sys.executable, "-c", _BOOT, json.dumps(sys.path), str(to_child_r), str(from_child_w), self._task_name],
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

    def map(self, items: Sequence[tuple], timeout: float) -> list[tuple[str, Any]]:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        with self._lock:
            if self._closed:
                raise RuntimeError("GraderPool is closed")
            while len(self._workers) < min(self._n, max(1, len(items))):
                self._workers.append(self._start_worker())
            return self._run(list(items), timeout)

    def _run(self, items: list[tuple], timeout: float) -> list[tuple[str, Any]]:
        results: list[tuple[str, Any] | None] = [None] * len(items)
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
                                f"grader worker for {self._task_name} exited with code {code} during startup; "
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
                        raise RuntimeError(f"grader worker did not start within {self._startup_timeout:.0f} s")
                    results[w.job] = ("timeout", None)
                    remaining -= 1
                    self.timeouts += 1
                    self._replace(w)
        return results  # type: ignore[return-value]

    def close(self) -> None:
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

    def __enter__(self) -> GraderPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_shared: dict[int, GraderPool] = {}
_shared_lock = threading.Lock()


def _shared_pool(workers: int) -> GraderPool:
    with _shared_lock:
        pool = _shared.get(workers)
        if pool is None:
            pool = _shared[workers] = GraderPool(workers)
        return pool


def shutdown_shared_pool() -> None:
    """Stop the module's shared worker pools (also done at interpreter exit)."""
    with _shared_lock:
        for pool in _shared.values():
            pool.close()
        _shared.clear()


atexit.register(shutdown_shared_pool)


def default_workers() -> int:
    return max(1, min(8, (os.cpu_count() or 2)))


def grade_many(
    preds: Sequence[str],
    golds: Sequence[str | float | Sequence[str]],
    timeout: float = 5.0,
    workers: int | None = None,
    grader: Grader = "math_verify",
    pool: GraderPool | None = None,
) -> list[GradeResult]:
    """Grade full responses ``preds`` against ``golds`` (one gold or gold list per pred).

    Extraction runs here; only answers that were found go to the worker pool (``pool``, or a
    shared pool of ``workers`` processes kept for the life of the interpreter).
    """
    if len(preds) != len(golds):
        raise ValueError(f"{len(preds)} predictions but {len(golds)} gold answers")
    if grader not in GRADERS:
        raise ValueError(f"unknown grader {grader!r}; choose from {', '.join(GRADERS)}")
    extracted = [extract_math_answer(p) for p in preds]
    todo = [i for i, e in enumerate(extracted) if e is not None]
    out: list[GradeResult] = [GradeResult(False, None, "no_answer")] * len(preds)
    if not todo:
        return out
    pool = pool or _shared_pool(workers or default_workers())
    raw = pool.map([(extracted[i], unwrap_gold(golds[i]), grader) for i in todo], timeout)
    for i, (kind, value) in zip(todo, raw):
        if kind == "ok":
            correct, reason = value
            out[i] = GradeResult(bool(correct), extracted[i], reason)
        elif kind == "timeout":
            out[i] = GradeResult(False, extracted[i], "timeout")
        else:
            out[i] = GradeResult(False, extracted[i], f"error: {value}")
    return out


def math_reward(response_text: str, gold: str | float | Sequence[str], grader: Grader = "math_verify") -> float:
    """The math-task reward: 1.0 if the response's final boxed answer is correct, else 0.0."""
    return float(grade_many([response_text], [gold], grader=grader)[0].correct)
