"""studies/same_run_twice.py: which stage of which step first differs between two runs' records (real safetensors
checkpoints, real samples.jsonl/metrics.jsonl rows)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from studies.same_run_twice import compare_runs  # noqa: E402


def _run(folder: Path, responses: list[str], losses: list[float], weights: list[float]) -> Path:
    """A run folder with one trajectory and one metrics row per step and a checkpoint after each step."""
    folder.mkdir(parents=True)
    rows = [{"step": s + 1, "group_id": "g0", "reward": 1.0, "response": r, "queries": ["q"], "retrieved_ids": [["d"]],
             "answer": "a", "response_tokens": 3} for s, r in enumerate(responses)]
    (folder / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": s + 1, "loss": x, "time/step": 10.0 + s * folder.name.count("b")}) + "\n"
                                                  for s, x in enumerate(losses)))
    for s, w in enumerate(weights):
        (folder / f"step_{s + 1}" / "policy").mkdir(parents=True)
        save_file({"w": torch.full((2, 2), w), "b": torch.zeros(2)}, str(folder / f"step_{s + 1}" / "policy" / "model.safetensors"))
    return folder


def test_identical_runs_have_no_first_difference_and_timings_are_ignored(tmp_path):
    a = _run(tmp_path / "a", ["x", "y"], [0.5, 0.25], [1.0, 2.0])
    b = _run(tmp_path / "bb", ["x", "y"], [0.5, 0.25], [1.0, 2.0])  # other step times
    out = compare_runs(a, b, 2)
    assert out["first_difference"] is None
    assert all(r["batch_identical"] and r["metrics_identical"] and r["weights_identical"] for r in out["steps"])


def test_the_first_differing_stage_is_named(tmp_path):
    a = _run(tmp_path / "a", ["x", "y"], [0.5, 0.25], [1.0, 2.0])
    b = _run(tmp_path / "c", ["x", "z"], [0.5, 0.3], [1.0, 2.0 + 2**-20])
    out = compare_runs(a, b, 2)
    assert out["first_difference"] == {"step": 2, "stage": "batch"}
    assert out["steps"][0]["weights_identical"] and not out["steps"][1]["weights_identical"]
    assert out["steps"][1]["weights"]["tensors_differ"] == 1 and out["steps"][1]["weights"]["max_abs_diff"] == 2**-20
    # the same batches, another loss at step 1: the update
    c = _run(tmp_path / "d", ["x", "y"], [0.5000001, 0.25], [1.0, 2.0])
    assert compare_runs(a, c, 2)["first_difference"] == {"step": 1, "stage": "update (metrics)"}
    # the same batches and metrics, other weights after step 1
    d = _run(tmp_path / "e", ["x", "y"], [0.5, 0.25], [1.5, 2.0])
    out = compare_runs(a, d, 2)
    assert out["first_difference"] == {"step": 1, "stage": "weights after an identical update's metrics"}
    assert out["steps"][0]["metrics_differ"] == [] and out["steps"][1]["weights_identical"]
