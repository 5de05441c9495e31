"""studies/same_seed_twice.py: where two trajectories of the same seed first differ, on real Trajectory objects."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from agent.rollout import Trajectory  # noqa: E402
from studies.same_seed_twice import compare, first_difference  # noqa: E402


def _traj(queries: list[str], retrieved: list[list[str]], response: list[int], sample: int = 0) -> Trajectory:
    return Trajectory(uid=f"u{sample}", group_id="g", prompt_index=0, sample_index=sample, question="q", example_id="e",
                      prompt_ids=[1, 2], response_ids=response, loss_mask=[1] * len(response),
                      sampling_logprobs=[-0.5] * len(response), queries=queries, retrieved_ids=retrieved,
                      num_searches=len(queries))


def test_first_difference_kinds():
    a = _traj(["x", "y"], [["d1", "d2"], ["d3"]], [5, 6, 7])
    assert first_difference(a, replace(a)) is None
    # the same first query got other passages: retrieval, whatever follows
    assert first_difference(a, _traj(["x", "z"], [["d1", "d9"], ["d4"]], [5, 6, 8])) == "retrieval"
    # the same passages, then another second query: generation
    assert first_difference(a, _traj(["x", "z"], [["d1", "d2"], ["d4"]], [5, 6, 8])) == "generation"
    # one search fewer after identical passages: generation
    assert first_difference(a, _traj(["x"], [["d1", "d2"]], [5, 6])) == "generation"
    # the same searches and passages, another answer: generation
    assert first_difference(a, _traj(["x", "y"], [["d1", "d2"], ["d3"]], [5, 6, 9])) == "generation"


def test_compare_pairs_by_prompt_and_sample():
    first = [_traj(["x"], [["d1"]], [1], sample=0), _traj(["x"], [["d1"]], [1], sample=1)]
    second = [_traj(["x"], [["d2"]], [1], sample=1), _traj(["x"], [["d1"]], [1], sample=0)]  # another order
    row = compare(first, second)
    assert row["trajectories"] == 2 and row["identical"] == 1 and row["first_difference_retrieval"] == 1
    assert row["identical_max_abs_logprob_diff"] == 0.0 and row["searches_per_trajectory"] == 1.0
