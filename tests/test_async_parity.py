"""``benchmarks/async_parity.py``'s verdict: the paired-by-seed difference and its 95 % Student-t interval."""

from __future__ import annotations

import importlib.util
import math
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _parity():
    if "async_parity" not in sys.modules:
        spec = importlib.util.spec_from_file_location("async_parity", ROOT / "benchmarks" / "async_parity.py")
        sys.modules["async_parity"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules["async_parity"]


def test_paired_interval_by_hand():
    # differences 0.1, -0.05, 0.0: mean 1/60, sd 0.076376, t(0.975, 2) = 4.303
    d = _parity().paired_difference([0.9, 0.8, 0.7], [0.8, 0.85, 0.7])
    assert d["differences"] == pytest.approx([0.1, -0.05, 0.0])
    assert d["mean_difference"] == pytest.approx(1 / 60)
    half = 4.303 * statistics.stdev([0.1, -0.05, 0.0]) / math.sqrt(3)
    assert d["ci95"] == pytest.approx([1 / 60 - half, 1 / 60 + half]) and d["ci95_half_width"] == pytest.approx(half)
    assert d["verdict"] == "within noise"


def test_verdicts_and_bad_input():
    parity = _parity()
    assert parity.paired_difference([0.5, 0.52, 0.49], [0.8, 0.81, 0.8])["verdict"] == "lower"
    assert parity.paired_difference([0.9, 0.91, 0.9], [0.5, 0.52, 0.49])["verdict"] == "higher"
    assert parity.t975(2) == 4.303 and parity.t975(11) == 2.228 and parity.t975(100) == 1.96
    with pytest.raises(ValueError, match="at least 2"):
        parity.paired_difference([0.5], [0.4])
