"""Is a difference between two evaluations of the same questions more than noise?

:func:`paired_bootstrap`: the two runs scored the *same* questions, so the question-level
differences d_i = b_i − a_i are resampled with replacement (the pairing removes the between-question
variance that an unpaired comparison would carry); the interval is the percentile interval of the
resampled mean differences.
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
