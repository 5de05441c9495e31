"""The bundled calculator tool (agent/calculator.py): arithmetic only, sandboxed, refusing files, network and runaways;
served over MCP as the ``calculator`` tool source (agent/tools.py)."""

from __future__ import annotations

import time

import pytest

from agent.calculator import CalculatorError, calculate, evaluate


@pytest.mark.parametrize("expression, value", [
    ("1 + 2 * 3", "7"), ("(1969 - 1903) * 2", "132"), ("7 / 2", "3.5"), ("7 // 2", "3"), ("2 ** 10", "1024"),
    ("sqrt(16)", "4"), ("max(3, 9, 4) - min(2, 5)", "7"), ("round(pi, 3)", "3.142"), ("-5 % 3", "1"), ("3 < 4", "True"),
])  # fmt: skip
def test_arithmetic(expression, value):
    assert evaluate(expression) == value == calculate(expression)


@pytest.mark.parametrize("expression, needle", [
    ("open('/etc/passwd').read()", "not allowed"),
    ("__import__('socket').socket()", "not allowed"),
    ("().__class__.__bases__", "not allowed"),
    ("[x for x in range(10)]", "not allowed"),
    ("(lambda: 1)()", "not allowed"),
    ("'a' * 3", "only numbers"),
    ("x = 1", "not an arithmetic expression"),
    ("1 / 0", "division by zero"),
    ("", "empty"),
])  # fmt: skip
def test_files_network_and_python_are_refused(expression, needle):
    with pytest.raises(CalculatorError, match=needle):
        evaluate(expression)
    answer = calculate(expression)
    assert answer.startswith("Error: ") and needle in answer


def test_runaway_expressions_are_stopped_by_the_sandbox():
    t0 = time.perf_counter()
    answer = calculate("9 ** 9 ** 9 ** 9")  # a few operators, an astronomically large power: CPU or memory limit
    assert answer.startswith("Error: ") and ("stopped" in answer or "too large" in answer), answer
    assert time.perf_counter() - t0 < 10
    answer = calculate("factorial(10 ** 7)")
    assert answer.startswith("Error: ") and time.perf_counter() - t0 < 20, answer
    assert calculate("2 ** 5000").startswith("Error: the result has")  # too many digits for the model


def test_the_calculator_source_serves_it_over_mcp():
    from agent.tools import ToolBox

    box = ToolBox(["calculator"], timeout_s=10, max_output_chars=1000)
    try:
        assert box.names() == ["calculate"]
        ok, refused, runaway = box.call_many([("calculate", {"expression": "(1969 - 1903) * 2"}),
                                              ("calculate", {"expression": "open('x')"}),
                                              ("calculate", {"expression": "9 ** 9 ** 9 ** 9"})])  # fmt: skip
        assert ok.text == "132" and ok.error is None
        assert refused.error == "tool error" and "not allowed" in refused.text
        assert runaway.error == "tool error" and runaway.text.startswith("Error")
    finally:
        box.close()
