"""The math task: answer extraction and grading (the math reward *and* the math benchmarks' metric).

Extraction follows the paper's grader (rllm ``math_reward.py``, ALGORITHM.md §5):

1. If the response contains exactly one ``</think>``, only the text after it is graded;
   otherwise the whole response is (the format reward is off).
2. The answer is the last ``\\boxed{…}`` / ``\\fbox{…}`` (balanced braces), ``\\boxed x``
   (brace-less, up to ``$`` or end of line) or ``<|begin_of_box|>…<|end_of_box|>``, whichever
   starts last. No box: incorrect, reason ``no_answer``.
3. Gold answers may be a string or a list (any one matching counts); a ``\\boxed`` in a gold
   answer is unwrapped.

Grading departs from the paper, which used ``grade_answer_mathd`` OR rllm's own sympy check:

* ``grader="mathd_or_math_verify"`` (:data:`DEFAULT_GRADER`, the default everywhere: training
  reward, ``grade_many``, evaluation): a MATH-style string normaliser (:func:`mathd_normalize`)
  first, then math-verify. This is the closest to the paper's grader; it accepts a few
  answers math-verify rejects (for instance a trailing ``\\text{ cm}`` unit on one side).
* ``grader="math_verify"``: HF math-verify ``parse``/``verify`` on both sides, the stricter
  common choice.

The grader used is recorded in every results file, because published numbers move by a point
or more between graders (ALGORITHM.md §5).

math-verify's own timeouts use ``signal.alarm`` and fail outside the main thread, so they
are disabled here; grading runs instead in worker *processes* (:class:`GraderPool`, a
:class:`emapg.workers.WorkerPool`) and the parent enforces a per-item deadline: a stuck worker
is killed and replaced, and the item counts as incorrect with reason ``timeout``.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from emapg.workers import WorkerPool

__all__ = [
    "Grader",
    "GRADERS",
    "DEFAULT_GRADER",
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
#: The one default of every grading entry point, the training reward's and evaluation's alike: the
#: check closest to the paper's (ALGORITHM.md §5).
DEFAULT_GRADER: Grader = "mathd_or_math_verify"


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


def grade_answer(extracted: str, golds: Sequence[str], grader: Grader = DEFAULT_GRADER) -> tuple[bool, str]:
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


class GraderPool(WorkerPool):
    """A :class:`emapg.workers.WorkerPool` whose workers grade (math-verify imported before the first item).

    ``task`` may be any module-level function (the pool is generic); it defaults to :func:`grade_answer`.
    """

    what = "grader worker"

    def __init__(self, workers: int = 2, task: Callable[..., Any] = grade_answer, startup_timeout: float = 120.0) -> None:
        super().__init__(workers, task, warmup=_load_math_verify if task is grade_answer else None,
                         startup_timeout=startup_timeout)


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
    grader: Grader = DEFAULT_GRADER,
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


def math_reward(response_text: str, gold: str | float | Sequence[str], grader: Grader = DEFAULT_GRADER) -> float:
    """The math-task reward: 1.0 if the response's final boxed answer is correct, else 0.0."""
    return float(grade_many([response_text], [gold], grader=grader)[0].correct)
