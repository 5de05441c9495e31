"""The collapse-rate contrasts docs/training.md binds (``toy.contrasts`` of stability_beta1.json) are what
``scripts/stability_contrasts.py`` computes from the file's own collapse counts with ``studies.stability.newcombe``."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("stability_contrasts", REPO / "scripts" / "stability_contrasts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


script = _script()


@pytest.mark.parametrize("name", sorted(script.CONTRASTS))
def test_the_recorded_contrasts_are_recomputed_from_the_counts(name):
    data = json.loads((script.RESULTS / f"{name}.json").read_text())
    assert data["toy"]["contrasts"] == script.contrasts(data, script.CONTRASTS[name])
    assert script.main(["--check"]) == 0


def test_a_contrast_pools_the_arms_counts():
    toy = {"a": {"collapsed": 2, "seeds": [0, 1, 2, 3, 4]}, "b": {"collapsed": 3, "seeds": [0, 1, 2, 3, 4]},
           "c": {"collapsed": 0, "seeds": [0, 1, 2, 3, 4]}}
    c = script.contrast(toy, ("a", "b"), ("c",))
    assert (c["collapsed_left"], c["runs_left"], c["collapsed_right"], c["runs_right"]) == (5, 10, 0, 5)
    assert c["difference"] == pytest.approx(0.5)
    low, high = c["newcombe"]
    assert low < 0.5 < high and low < 0  # 5/10 against 0/5: the interval still reaches below zero (n = 5)
    wide = script.contrast({**toy, "d": {"collapsed": 0, "seeds": list(range(10))}}, ("a", "b"), ("d",))
    assert wide["newcombe"][0] > 0  # against 0/10 it clears zero
