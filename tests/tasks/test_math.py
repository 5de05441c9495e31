"""Math extraction and grading: boxes, </think>, gold unwrapping, mathd, timeouts in workers."""

import time

import pytest

from tasks.math import (
    GradeResult,
    GraderPool,
    extract_math_answer,
    grade_many,
    last_boxed,
    math_reward,
    mathd_normalize,
    split_after_think,
    unwrap_gold,
)


def test_split_after_think():
    assert split_after_think("a</think>b") == "b"
    assert split_after_think("no think") == "no think"
    assert split_after_think("a</think>b</think>c") == "a</think>b</think>c"  # two: grade all


@pytest.mark.parametrize(
    "text, boxed",
    [
        ("\\boxed{1} and then \\boxed{\\frac{a}{b}}", "\\frac{a}{b}"),
        ("\\boxed{\\left\\{1, 2\\right\\}}", "\\left\\{1, 2\\right\\}"),  # escaped braces balance
        ("$\\boxed 42$ done", "42"),
        ("\\boxed 7\nmore", "7"),
        ("\\fbox{x^2}", "x^2"),
        ("<|begin_of_box|>3\\pi<|end_of_box|>", "3\\pi"),
        ("\\boxed{1} <|begin_of_box|>2<|end_of_box|>", "2"),
        ("<|begin_of_box|>2<|end_of_box|> \\boxed{1}", "1"),
        ("\\boxed{unbalanced", None),
        ("\\boxed{ok} \\boxed{unbalanced", "ok"),
        ("\\boxedx", None),
        ("no box", None),
        ("\\boxed{}", ""),
    ],
)
def test_last_boxed(text, boxed):
    assert last_boxed(text) == boxed


def test_extract_after_single_think():
    assert extract_math_answer("<think>\\boxed{1}</think> so \\boxed{2}") == "2"
    assert extract_math_answer("<think>\\boxed{1}</think> no final box") is None
    assert extract_math_answer("\\boxed{1}</think>x</think>\\boxed{3}") == "3"


def test_unwrap_gold():
    assert unwrap_gold("\\boxed{5}") == ["5"]
    assert unwrap_gold(142.0) == ["142.0"]
    assert unwrap_gold(["1", "\\boxed{2}"]) == ["1", "2"]
    with pytest.raises(ValueError):
        unwrap_gold([])
    with pytest.raises(ValueError):
        unwrap_gold("  ")


@pytest.mark.parametrize(
    "a, b",
    [
        ("\\dfrac{1}{2}", "\\frac12"),
        ("0.5", "1/2"),
        ("x = 3", "3"),
        ("10\\%", "10"),
        ("90^\\circ", "90"),
        ("\\$5", "5"),
        ("5 \\text{ cm}", "5"),
        ("\\sqrt3", "\\sqrt{3}"),
        ("142.0", "142"),
        ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
        ("\\text{Devon}", "Devon"),
    ],
)
def test_mathd_normalize_equivalences(a, b):
    assert mathd_normalize(a) == mathd_normalize(b)


def test_mathd_normalize_keeps_differences():
    assert mathd_normalize("1/3") != mathd_normalize("2/6")  # unreduced fractions must match exactly
    assert mathd_normalize("12") != mathd_normalize("1.2")


def test_grade_many_reasons_and_graders():
    preds = [
        "<think>...</think> The answer is \\boxed{\\frac{1}{2}}.",
        "\\boxed{0.5}",
        "I give up",
        "\\boxed{3}",
        "\\boxed{2\\text{ cm}}",
    ]
    golds = ["\\frac12", "\\boxed{1/2}", "1", ["4", "5"], "2"]
    res = grade_many(preds, golds, workers=2)
    assert [r.correct for r in res] == [True, True, False, False, True]
    assert res[2] == GradeResult(False, None, "no_answer")
    assert res[3].reason == "mismatch" and res[3].extracted == "3"
    both = grade_many(preds, golds, workers=2, grader="mathd_or_math_verify")
    assert [r.correct for r in both] == [True, True, False, False, True]
    assert both[4].reason == "mathd"
    assert math_reward("so \\boxed{204}", "204") == 1.0
    assert math_reward("so \\boxed{205}", "204") == 0.0
    with pytest.raises(ValueError, match="predictions"):
        grade_many(["a"], ["1", "2"])
    with pytest.raises(ValueError, match="unknown grader"):
        grade_many(["a"], ["1"], grader="sympy")


def sleepy_task(seconds: float, value: int) -> int:
    """A worker task that can be told to hang (module-level, so workers can import it)."""
    time.sleep(seconds)
    return value


def crashing_task(code: int) -> int:
    import os

    os._exit(code)


def test_pool_kills_and_replaces_stuck_workers():
    with GraderPool(workers=2, task=sleepy_task) as pool:
        out = pool.map([(0.0, 1), (60.0, 2), (0.0, 3), (60.0, 4), (0.0, 5)], timeout=1.0)
        assert out == [("ok", 1), ("timeout", None), ("ok", 3), ("timeout", None), ("ok", 5)]
        assert pool.timeouts == 2 and pool.restarts == 2
        # the pool keeps working after the replacements
        assert pool.map([(0.0, 7)], timeout=5.0) == [("ok", 7)]


def test_pool_survives_a_dying_worker():
    with GraderPool(workers=1, task=crashing_task) as pool:
        out = pool.map([(3,), (4,)], timeout=30.0)
    assert out == [("error", "worker died (exit code 3)"), ("error", "worker died (exit code 4)")]


def test_pathological_input_times_out_not_crashes():
    # a power tower math-verify tries to evaluate: counted as a timeout, the batch goes on
    with GraderPool(workers=1) as pool:
        res = grade_many(["\\boxed{9^{9^{9^{9^{9^{9}}}}}}", "\\boxed{2}"], ["1", "2"], timeout=1.0, pool=pool)
        assert res[0] == GradeResult(False, "9^{9^{9^{9^{9^{9}}}}}", "timeout")
        assert res[1].correct
        assert pool.timeouts == 1


def test_pool_rejects_bad_arguments():
    with pytest.raises(ValueError):
        GraderPool(workers=0)
    with pytest.raises(ValueError, match="module-level"):
        GraderPool(task=lambda: 1)
    with GraderPool(workers=1, task=sleepy_task) as pool:
        with pytest.raises(ValueError):
            pool.map([(0.0, 1)], timeout=0)


def test_one_default_grader_for_training_evaluation_and_grade_many():
    """Regression: grade_many defaulted to math_verify while training and evaluation used mathd_or_math_verify."""
    import inspect

    from eval.protocols import EvalProtocol
    from tasks.math import DEFAULT_GRADER, grade_answer
    from tasks.task import MATH, Grading
    from trainer.config import RewardConfig

    assert DEFAULT_GRADER == "mathd_or_math_verify" == RewardConfig().math_grader == EvalProtocol().grader == Grading().grader
    assert inspect.signature(MATH.grade).parameters["grading"].default == Grading()  # the training reward's grading
    for func, param in ((grade_many, "grader"), (grade_answer, "grader"), (math_reward, "grader")):
        assert inspect.signature(func).parameters[param].default == DEFAULT_GRADER, func.__name__
    # and it is the grader that runs: only the mathd check accepts a unit on one side
    (res,) = grade_many(["so \\boxed{2\\text{ cm}}"], ["2"], workers=1)
    assert res.correct and res.reason == "mathd"
