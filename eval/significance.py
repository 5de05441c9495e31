"""Is a difference between two evaluations of the same questions more than noise?

:func:`paired_bootstrap`: the two runs scored the *same* questions, so the question-level
differences d_i = b_i − a_i are resampled with replacement (the pairing removes the between-question
variance that an unpaired comparison would carry); the interval is the percentile interval of the
resampled mean differences.

:func:`hierarchical_bootstrap`: several training seeds each scored the same questions; the seeds are resampled, then
the questions, so the interval carries the spread between seeds as well as between questions (the seed-level interval a
claim about a training recipe needs; the per-question interval above describes these seeds only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class PairedDifference:
    """Mean of ``b - a`` over questions and its bootstrap percentile interval (same unit as the scores)."""

    mean: float
    low: float
    high: float
    n: int
    confidence: float
    resamples: int

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def bootstrap_means(diffs: np.ndarray, *, resamples: int, seed: int) -> np.ndarray:
    """``(resamples,)`` means of ``diffs`` ``(n,)`` resampled with replacement (seeded, chunked for memory)."""
    rng = np.random.default_rng(seed)
    n = len(diffs)
    out = np.empty(resamples)
    chunk = max(1, 2_000_000 // max(n, 1))
    for start in range(0, resamples, chunk):
        size = min(chunk, resamples - start)
        out[start : start + size] = diffs[rng.integers(0, n, size=(size, n))].mean(axis=1)
    return out


def paired_bootstrap(a: Sequence[float], b: Sequence[float], *, confidence: float = 0.95, resamples: int = 10_000,
                     seed: int = 0) -> PairedDifference:
    """Paired bootstrap of mean(b) − mean(a) over questions; ``a[i]`` and ``b[i]`` score the same question."""
    if len(a) != len(b):
        raise ValueError(f"paired scores need equal lengths, got {len(a)} and {len(b)}")
    if not len(a):
        raise ValueError("no questions to compare")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    diffs = np.asarray(b, dtype=np.float64) - np.asarray(a, dtype=np.float64)
    means = bootstrap_means(diffs, resamples=resamples, seed=seed)
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return PairedDifference(float(diffs.mean()), float(low), float(high), len(diffs), confidence, resamples)


@dataclass(frozen=True)
class SeedLevelDifference:
    """Mean of ``b - a`` over seeds and questions and its hierarchical bootstrap percentile interval (seeds, then
    questions, resampled); ``seed_means``: each of ``b``'s seeds' mean minus ``a``'s mean over its seeds."""

    mean: float
    low: float
    high: float
    n: int
    seeds_a: int
    seeds_b: int
    seed_means: list[float]
    confidence: float
    resamples: int

    def to_dict(self) -> dict[str, float | int | list[float]]:
        return asdict(self)


def _seed_rows(rows: Sequence[Sequence[float]], name: str) -> np.ndarray:
    m = np.asarray(rows, dtype=np.float64)
    if m.ndim != 2 or m.shape[0] == 0 or m.shape[1] == 0:
        raise ValueError(f"{name} must be a (seeds, questions) table with at least one seed and one question, got shape {m.shape}")
    return m


def _seed_average(rng: np.random.Generator, m: np.ndarray, size: int) -> np.ndarray:
    """``(size, questions)``: per resample, the per-question mean over ``m``'s seeds ``(seeds, questions)`` drawn with
    replacement (the weights are the draw counts, so no ``(size, seeds, questions)`` tensor is built)."""
    seeds = m.shape[0]
    if seeds == 1:
        return np.broadcast_to(m[0], (size, m.shape[1]))
    drawn = rng.integers(0, seeds, size=(size, seeds))
    weights = (drawn[:, :, None] == np.arange(seeds)).sum(axis=1) / seeds  # (size, seeds)
    return weights @ m


def hierarchical_bootstrap_means(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]], *, resamples: int,
                                 seed: int) -> np.ndarray:
    """``(resamples,)`` replicates of mean(b) − mean(a): each draws ``a``'s seeds and ``b``'s seeds with replacement
    (independently), then the questions with replacement, and takes the mean over the drawn questions of the drawn seeds'
    average. ``a`` ``(seeds_a, n)`` and ``b`` ``(seeds_b, n)`` score the same ``n`` questions in the same order.

    The questions are drawn once per replicate for every seed: the seeds score the *same* questions (a crossed design),
    so a question hard for one seed is hard for all; drawing them anew for each seed would shrink the question variance
    by the number of seeds when the seeds agree. The question draws use the generator and chunking of
    :func:`bootstrap_means`, so one seed on each side gives exactly :func:`paired_bootstrap`'s replicates."""
    ma, mb = _seed_rows(a, "a"), _seed_rows(b, "b")
    if ma.shape[1] != mb.shape[1]:
        raise ValueError(f"both sides must score the same questions, got {ma.shape[1]} and {mb.shape[1]}")
    n = ma.shape[1]
    question_rng, seed_rng = np.random.default_rng(seed), np.random.default_rng([seed, 1])
    out = np.empty(resamples)
    chunk = max(1, 2_000_000 // max(n, 1))
    for start in range(0, resamples, chunk):
        size = min(chunk, resamples - start)
        questions = question_rng.integers(0, n, size=(size, n))
        diffs = _seed_average(seed_rng, mb, size) - _seed_average(seed_rng, ma, size)  # (size, n)
        out[start : start + size] = np.take_along_axis(diffs, questions, axis=1).mean(axis=1)
    return out


def hierarchical_bootstrap(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]], *, confidence: float = 0.95,
                           resamples: int = 10_000, seed: int = 0) -> SeedLevelDifference:
    """The seed-level interval of mean(b) − mean(a): a hierarchical bootstrap that resamples seeds, then questions
    (:func:`hierarchical_bootstrap_means`), percentile interval. ``a[s][i]``/``b[s][i]``: seed ``s``'s score of question
    ``i`` (``a`` may be one row: a starter scored once). Unlike :func:`paired_bootstrap` on the seed-averaged scores, the
    interval widens when the seeds disagree: it is what a claim about a training recipe (not about these seeds) needs."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    ma, mb = _seed_rows(a, "a"), _seed_rows(b, "b")
    means = hierarchical_bootstrap_means(ma, mb, resamples=resamples, seed=seed)
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    base = float(ma.mean())
    return SeedLevelDifference(float(mb.mean() - base), float(low), float(high), ma.shape[1], ma.shape[0], mb.shape[0],
                               [float(row.mean() - base) for row in mb], confidence, resamples)
