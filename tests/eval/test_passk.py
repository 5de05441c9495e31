"""pass@k: the product-form estimator against brute-force enumeration of subsets."""

import itertools
from math import comb

import pytest

from tasks.passk import default_ks, mean_pass_at_k, pass_at_k, pass_at_k_curve


def _brute(n: int, c: int, k: int) -> float:
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8, 10])
def test_pass_at_k_equals_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(_brute(n, c, k), abs=1e-12)


def test_large_n_matches_exact_binomials():
    for n, c, k in [(32, 3, 8), (32, 31, 1), (200, 7, 50), (1000, 1, 999)]:
        exact = 1 - comb(n - c, k) / comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12)


def test_pass_at_1_is_mean_accuracy():
    counts, n = [0, 3, 32, 17], 32
    assert mean_pass_at_k(counts, n, 1) == pytest.approx(sum(counts) / (n * len(counts)))
    assert mean_pass_at_k([1, 2], [2, 4], 1) == pytest.approx((1 / 2 + 2 / 4) / 2)


def test_curve_and_errors():
    assert default_ks(32) == [1, 2, 4, 8, 16, 32]
    assert default_ks(1) == [1]
    assert default_ks(6) == [1, 2, 4, 6]
    curve = pass_at_k_curve([1, 0, 4], 4)
    assert list(curve) == [1, 2, 4]
    assert curve[4] == pytest.approx(2 / 3)
    assert all(a <= b for a, b in zip(curve.values(), list(curve.values())[1:]))
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError):
        mean_pass_at_k([], 4, 1)
