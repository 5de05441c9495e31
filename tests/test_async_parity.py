"""``studies/async_parity.py``'s verdict: the paired-by-seed difference and its 95 % Student-t interval."""

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
        spec = importlib.util.spec_from_file_location("async_parity", ROOT / "studies" / "async_parity.py")
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


def test_plot_from_a_report(tmp_path):
    """The PNG is drawn from the JSON alone (``--replot``): curves per s and seed, the paired intervals."""
    parity = _parity()
    rewards = {0: [[0.5, 0.7, 0.9], [0.4, 0.6, 0.8]], 1: [[0.5, 0.6, 0.85], [0.4, 0.65, 0.8]]}
    report = {"staleness": [0, 1], "seeds": [0, 1], "last_k": 2, "steps": 3, "behavior_correction": "tis",
              "runs": {f"s{s}_seed{seed}": {"reward": r} for s, per_seed in rewards.items() for seed, r in enumerate(per_seed)},
              "paired_vs_s0": {"s1": parity.paired_difference([0.725, 0.725], [0.8, 0.7])}}
    png = parity.plot_parity(report, tmp_path / "parity.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
