"""The math grader on the bundled benchmark answers: gold accepted, perturbed rejected.

Exceptions are printed (run with ``-s``): they are the grader's known gaps. The default run
grades a seeded sample of every set; the ``slow`` run grades every problem.
"""

import pytest

from tasks.datasets import MATH_DATASETS, load_dataset
from eval.grader_check import check_grader, format_exceptions, perturb_answer
from tasks.math import GraderPool


def test_perturb_answer():
    assert perturb_answer("204") == "205"
    assert perturb_answer("\\frac{1}{9}") == "\\frac{1}{0}"
    assert perturb_answer("\\text{Devon}") == "\\text{Devon}x"
    assert perturb_answer("0.01", ["0.01", "0.02"]) == "0.03"  # never another listed gold


def _check(limit, grader="math_verify"):
    sets = {ds: load_dataset(ds, limit=limit, seed=7) for ds in MATH_DATASETS}
    with GraderPool(workers=2) as pool:
        report = check_grader(sets, grader=grader, pool=pool)
    print("\n" + format_exceptions(report))
    for name, s in report["sets"].items():
        assert s["gold_accepted"] >= 0.99, f"{name}: {s['gold_rejected']}"
        assert s["perturbed_accepted"] <= 0.04, f"{name}: {s['perturbed_accepted_items']}"
    return report


def test_grader_on_sample_of_every_math_set():
    report = _check(limit=20)
    assert set(report["sets"]) == set(MATH_DATASETS)


def test_paper_like_grader_on_sample():
    _check(limit=15, grader="mathd_or_math_verify")


@pytest.mark.slow
def test_grader_on_every_problem():
    report = _check(limit=None)
    assert sum(s["n"] for s in report["sets"].values()) == 30 + 83 + 500 + 272 + 675
