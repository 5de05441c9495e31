"""The seed-level (hierarchical) bootstrap: its replicates against the exact two-level resampling distribution
(enumerated), one seed a side equal to the paired bootstrap, and the known cases (seeds that agree, seeds that do not)."""

import itertools

import numpy as np
import pytest

from eval.significance import hierarchical_bootstrap, hierarchical_bootstrap_means, paired_bootstrap


def _exact_hierarchical(a, b):
    """Every equally likely replicate (a's seeds, b's seeds, then the questions, all drawn with replacement) and its
    mean(b) - mean(a): the distribution the bootstrap samples from, by enumeration."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    n = a.shape[1]
    values = []
    for sa in itertools.product(range(len(a)), repeat=len(a)):
        for sb in itertools.product(range(len(b)), repeat=len(b)):
            diff = b[list(sb)].mean(axis=0) - a[list(sa)].mean(axis=0)
            for q in itertools.product(range(n), repeat=n):
                values.append(diff[list(q)].mean())
    return np.array(values)


def test_replicates_match_the_exact_two_level_distribution():
    a = [[0.0, 1.0, 0.0]]  # a starter scored once
    b = [[1.0, 1.0, 0.0], [0.0, 1.0, 1.0], [0.0, 0.0, 0.0]]  # 3 seeds: 27 seed draws x 27 question draws
    exact = _exact_hierarchical(a, b)
    sampled = hierarchical_bootstrap_means(a, b, resamples=200_000, seed=2)
    assert sampled.mean() == pytest.approx(exact.mean(), abs=3e-3)
    assert sampled.var() == pytest.approx(exact.var(), rel=3e-2)
    values, counts = np.unique(np.round(exact, 9), return_counts=True)  # attainable means are multiples of 1/9
    for v, c in zip(values, counts):
        assert np.mean(np.isclose(sampled, v)) == pytest.approx(c / len(exact), abs=4e-3)


def test_both_sides_resampled_by_seed():
    a = [[0.0, 1.0], [1.0, 1.0]]
    b = [[1.0, 0.0], [1.0, 1.0]]
    exact = _exact_hierarchical(a, b)
    sampled = hierarchical_bootstrap_means(a, b, resamples=200_000, seed=5)
    assert sampled.var() == pytest.approx(exact.var(), rel=3e-2)
    assert sampled.mean() == pytest.approx(exact.mean(), abs=3e-3)


def test_one_seed_a_side_is_the_paired_bootstrap():
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 2, 40).astype(float), rng.integers(0, 2, 40).astype(float)
    seed_level = hierarchical_bootstrap([a], [b], resamples=5_000, seed=7)
    paired = paired_bootstrap(a, b, resamples=5_000, seed=7)
    assert (seed_level.mean, seed_level.low, seed_level.high) == pytest.approx((paired.mean, paired.low, paired.high), abs=1e-12)
    assert seed_level.seed_means == pytest.approx([paired.mean])


def _starter_and_seeds(effects, noise, n=200, seed=0):
    """A starter's per-question scores and, per seed, the starter + that seed's effect + per-question noise."""
    rng = np.random.default_rng(seed)
    start = rng.uniform(0, 100, n)
    return [start], [start + e + noise * rng.standard_normal(n) for e in effects], start


def test_seeds_that_agree_give_about_the_per_question_interval():
    rng = np.random.default_rng(1)
    start = rng.uniform(0, 100, 200)
    per_question = rng.normal(5, 10, 200)
    rows = [start + per_question for _ in range(3)]  # zero spread between seeds
    seed_level = hierarchical_bootstrap([start], rows, seed=3)
    paired = paired_bootstrap(start, np.mean(rows, axis=0), seed=3)
    assert seed_level.mean == pytest.approx(paired.mean)
    width, paired_width = seed_level.high - seed_level.low, paired.high - paired.low
    assert width == pytest.approx(paired_width, rel=0.1)


def test_seeds_that_disagree_widen_the_interval():
    a, b, start = _starter_and_seeds([10.0, -10.0, 10.0], noise=0.1)
    seed_level = hierarchical_bootstrap(a, b, seed=0)
    paired = paired_bootstrap(start, np.mean(b, axis=0), seed=0)
    assert seed_level.mean == pytest.approx(10 / 3, abs=0.05) and paired.mean == pytest.approx(seed_level.mean)
    assert paired.high - paired.low < 0.1  # the questions alone: a tight interval around +3.3
    assert seed_level.low < -5 and seed_level.high > 9  # the seeds: anywhere from -10 (mostly) to +10
    assert seed_level.seed_means == pytest.approx([10, -10, 10], abs=0.05)
    assert (seed_level.seeds_a, seed_level.seeds_b, seed_level.n) == (1, 3, 200)


def test_deterministic_under_a_fixed_seed_and_different_across_seeds():
    a, b, _ = _starter_and_seeds([3.0, 1.0, 5.0, 2.0], noise=5.0)
    one, two = hierarchical_bootstrap(a, b, seed=11), hierarchical_bootstrap(a, b, seed=11)
    assert one == two
    assert hierarchical_bootstrap(a, b, seed=12) != one


@pytest.mark.parametrize("a, b, message", [
    ([[1.0, 0.0]], [[1.0]], "same questions"),
    ([], [[1.0]], "at least one seed"),
    ([[1.0]], [[]], "at least one seed"),
])
def test_bad_tables_are_refused(a, b, message):
    with pytest.raises(ValueError, match=message):
        hierarchical_bootstrap(a, b)
