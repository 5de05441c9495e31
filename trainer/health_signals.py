"""Text signals of a collapsing policy, as pure functions of the model's own text (issue #42).

A search agent that collapses usually degrades in its text before the reward shows it: it loops
(repeated n-grams), emits token soup (non-text words), stops answering (avoidance), or its length
drifts away from where the run started. Each function below reads one response (``Trajectory.model_text``:
the model's turns only, never retrieved passages); :func:`health_sums` adds them up over a rollout
batch as :class:`trainer.metrics.MetricSums` names, and :func:`trainer.metrics.rollout_metrics` turns
them into ``response/repeated_ngram_share``, ``response/non_text_share`` and ``response/no_answer_rate``.
:class:`LengthDrift` keeps the run's starting length for ``response/length_drift``; :func:`probe_metrics`
compares two greedy passes over a fixed probe set (``logging.probe_size``) for ``probe/*``.

Markup tags (``<search>``, ``</answer>``, ...) are removed before anything is counted: a healthy agent
repeats them every turn.
"""

from __future__ import annotations

import re
import string
from typing import Sequence

from tasks.qa import normalize_answer

__all__ = ["words", "repeated_ngram_share", "non_text_share", "avoids_answer", "health_sums", "LengthDrift",
           "probe_metrics", "REFUSALS", "MAX_WORD_CHARS"]

_TAG_RE = re.compile(r"</?[A-Za-z_][\w\-]*>")
# a word's surrounding punctuation (ASCII and the usual typographic marks) is not part of it
_EDGE = string.punctuation + "“”‘’–—…«»¿¡"
_UNIT = r"(?:[^\W\d_]+|\d+[^\W\d_]{0,2})"  # letters (any script), or a number with a short suffix (3rd, 1990s)
_WORD_RE = re.compile(rf"{_UNIT}(?:['’\-./:,]{_UNIT})*")
#: words longer than this are not text (no word of a natural-language answer is; token soup without spaces is)
MAX_WORD_CHARS = 30
#: answers that avoid answering, compared after SQuAD normalisation (lower case, no punctuation or articles)
REFUSALS = frozenset(normalize_answer(a) for a in (
    "unknown", "I don't know", "I do not know", "no answer", "not sure", "n/a", "cannot answer", "can't answer",
    "cannot be determined", "not enough information", "insufficient information", "no information"))


def words(text: str) -> list[str]:
    """The whitespace-separated words of ``text`` with markup tags removed."""
    return _TAG_RE.sub(" ", text).split()


def repeated_ngram_share(text: str, n: int = 4) -> float:
    """The share of the word ``n``-grams of ``text`` that repeat an earlier one: 1 - distinct/total
    (case-folded; 0 when the text has fewer than ``n`` words). A loop of period p over L words tends to 1 - p/L."""
    if n < 1:
        raise ValueError("n must be >= 1")
    w = [x.casefold() for x in words(text)]
    grams = [tuple(w[i:i + n]) for i in range(len(w) - n + 1)]
    return (len(grams) - len(set(grams))) / len(grams) if grams else 0.0


def _is_text_word(word: str) -> bool:
    return len(word) <= MAX_WORD_CHARS and _WORD_RE.fullmatch(word) is not None


def non_text_share(text: str) -> float:
    """The share of the words of ``text`` that are not text: after stripping their surrounding punctuation,
    a text word is letters (any script) and numbers (a number may carry a 2-letter suffix), joined by
    ``' - . / : ,``, at most :data:`MAX_WORD_CHARS` long. Words of punctuation only are not counted
    (``...``, ``—``) unless longer than :data:`MAX_WORD_CHARS` (a symbol loop such as ``<<<<<<…``, the form a
    collapsed distillation run took on 2026-12-06: no word, no n-gram, yet nothing but noise); 0 when no word is
    left. ``Paris``, ``COVID-19``, ``3rd``, ``U.S.``, ``"well,"`` are text; ``a1b2``, ``ĠĊx9q``, ``foo_bar``,
    ``x#@$y`` are not."""
    counted = [w or x for w, x in ((x.strip(_EDGE), x) for x in words(text)) if w or len(x) > MAX_WORD_CHARS]
    return sum(not _is_text_word(w) for w in counted) / len(counted) if counted else 0.0


def avoids_answer(answer: str | None) -> bool:
    """Whether a graded answer (``tasks.task.Outcome.answer``) avoids answering: none was found, it is
    empty after normalisation, or it is one of :data:`REFUSALS`."""
    if answer is None:
        return True
    norm = normalize_answer(answer)
    return not norm or norm in REFUSALS


def health_sums(texts: Sequence[str], answers: Sequence[str | None], *, ngram: int = 4) -> dict[str, float]:
    """The batch's sums of the per-response signals (``texts``: the model's text of each trajectory,
    ``answers``: each one's graded answer), named for :class:`trainer.metrics.MetricSums`."""
    if len(texts) != len(answers):
        raise ValueError(f"{len(texts)} texts but {len(answers)} answers")
    return {"health/responses": float(len(texts)),
            "health/repeated_ngram_sum": sum(repeated_ngram_share(t, ngram) for t in texts),
            "health/non_text_sum": sum(non_text_share(t) for t in texts),
            "health/no_answer": float(sum(avoids_answer(a) for a in answers))}


class LengthDrift:
    """``response/length_drift``: the step's mean response length relative to the run's start,
    ``length / start - 1`` (0: unchanged, 1: doubled, -0.5: halved), where ``start`` is the mean over
    the first ``steps`` steps of the run (while fewer have been seen, over those seen)."""

    def __init__(self, steps: int = 3) -> None:
        if steps < 1:
            raise ValueError("steps must be >= 1")
        self.steps = steps
        self.first: list[float] = []

    def __call__(self, length: float) -> float:
        if len(self.first) < self.steps:
            self.first.append(float(length))
        start = sum(self.first) / len(self.first)
        return length / start - 1.0 if start > 0 else 0.0

    def state_dict(self) -> dict:
        return {"first": list(self.first)}

    def load_state_dict(self, state: dict) -> None:
        self.first = [float(x) for x in state.get("first", [])][: self.steps]



def probe_metrics(previous: Sequence[tuple[str | None, bool]] | None,
                  now: Sequence[tuple[str | None, bool]]) -> dict[str, float]:
    """``probe/*`` of a greedy pass over the fixed probe questions: ``now`` (and the previous pass) holds each
    question's (graded answer, correct). ``probe/accuracy`` always; against a previous pass, the shares of
    questions whose answer changed (``probe/flip_rate``; compared after SQuAD normalisation, no answer is
    an answer of its own), that went from right to wrong (``probe/lost_rate``) and from wrong to right
    (``probe/gained_rate``)."""
    if not now:
        return {}
    n = len(now)
    out = {"probe/accuracy": sum(c for _, c in now) / n}
    if previous is not None:
        if len(previous) != n:
            raise ValueError(f"the probe set changed size: {len(previous)} -> {n}")

        def norm(a: str | None) -> str | None:
            return None if a is None else normalize_answer(a)

        out["probe/flip_rate"] = sum(norm(a) != norm(b) for (a, _), (b, _) in zip(previous, now)) / n
        out["probe/lost_rate"] = sum(c0 and not c1 for (_, c0), (_, c1) in zip(previous, now)) / n
        out["probe/gained_rate"] = sum(c1 and not c0 for (_, c0), (_, c1) in zip(previous, now)) / n
    return out
