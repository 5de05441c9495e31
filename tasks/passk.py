"""Unbiased pass@k (Chen et al. 2021, the "Codex" estimator), as the paper's math eval uses.

For a problem with ``n`` samples of which ``c`` are correct,

    pass@k = 1 - C(n - c, k) / C(n, k)

is the probability that a uniformly random size-``k`` subset of the samples holds at least
one correct sample. Binomials of n = 32 overflow nothing, but the ratio is evaluated in the
product form 1 - prod_{i = n-c+1}^{n} (1 - k / i), which stays accurate for any n.
Aggregates are unweighted means over problems; pass@1 equals the mean per-problem accuracy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["pass_at_k", "mean_pass_at_k", "pass_at_k_curve", "default_ks"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with ``n`` samples, ``c`` of them correct."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:  # every size-k subset contains a correct sample
        return 1.0
    i = np.arange(n - c + 1, n + 1, dtype=np.float64)
    return float(1.0 - np.prod(1.0 - k / i))


def mean_pass_at_k(correct_counts: Sequence[int], n: int | Sequence[int], k: int) -> float:
    """Mean pass@k over problems. ``n`` is one sample count or one per problem."""
    counts = list(correct_counts)
    if not counts:
        raise ValueError("no problems to average over")
    ns = [n] * len(counts) if isinstance(n, int) else list(n)
    if len(ns) != len(counts):
        raise ValueError(f"{len(counts)} correct counts but {len(ns)} sample counts")
    return float(np.mean([pass_at_k(ni, ci, k) for ni, ci in zip(ns, counts)]))


def default_ks(n: int) -> list[int]:
    """1, 2, 4, … up to n (n itself included): the usual x-axis of a pass@k curve."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def pass_at_k_curve(correct_counts: Sequence[int], n: int, ks: Sequence[int] | None = None) -> dict[int, float]:
    """``{k: mean pass@k}`` for each ``k`` in ``ks`` (default :func:`default_ks`)."""
    return {k: mean_pass_at_k(correct_counts, n, k) for k in (ks or default_ks(n))}
