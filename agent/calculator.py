"""The bundled calculator tool: arithmetic in a sandbox, served over MCP (``rollout.tools=[search, calculator]``).

``python -m agent.calculator`` is a stdio MCP server with one tool, ``calculate(expression)``, which the rollout
launches for the ``calculator`` tool source (agent/tools.py). An expression is arithmetic only -- numbers, ``+ - * /
// % **``, parentheses, comparisons, and the functions and constants in :data:`FUNCTIONS` / :data:`CONSTANTS` --
read by a whitelist over Python's ``ast`` (no ``eval``, no names, attributes, calls of anything else, subscripts,
comprehensions, lambdas or strings), so a file or a socket cannot be reached and no loop can be written: ``open(...)``,
``__import__('socket')``, ``().__class__`` are refused with a message that says what is allowed.

What the whitelist cannot bound -- ``9 ** 9 ** 9`` is two operators -- the sandbox does: each expression is evaluated
in a forked child with a CPU limit (``RLIMIT_CPU``, :data:`CPU_SECONDS`), an address-space limit (``RLIMIT_AS``,
:data:`MEMORY_BYTES`), no file writes (``RLIMIT_FSIZE`` 0), no new files or sockets (``RLIMIT_NOFILE`` at the
descriptors already open), and a wall-clock deadline (:data:`WALL_SECONDS`) after which it is killed. Every refusal
is an answer the model reads (``Error: ...``), never an exception of the server.
"""

from __future__ import annotations

import ast
import math
import operator
import os
import signal
import time
from typing import Any

__all__ = ["CONSTANTS", "FUNCTIONS", "CalculatorError", "evaluate", "calculate", "main"]

CPU_SECONDS = 2
WALL_SECONDS = 3.0
MEMORY_BYTES = 512 << 20
MAX_EXPRESSION_CHARS = 1000
MAX_RESULT_CHARS = 200

FUNCTIONS: dict[str, Any] = {
    "sqrt": math.sqrt, "log": math.log, "log10": math.log10, "log2": math.log2, "exp": math.exp, "sin": math.sin,
    "cos": math.cos, "tan": math.tan, "abs": abs, "round": round, "min": min, "max": max, "floor": math.floor,
    "ceil": math.ceil, "factorial": math.factorial,
}  # fmt: skip
CONSTANTS = {"pi": math.pi, "e": math.e}
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}  # fmt: skip
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_COMPARE = {ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Eq: operator.eq,
            ast.NotEq: operator.ne}  # fmt: skip
ALLOWED = ("numbers, + - * / // % **, parentheses, comparisons, " + ", ".join(sorted(FUNCTIONS)) + " and "
           + ", ".join(sorted(CONSTANTS)))  # fmt: skip


class CalculatorError(ValueError):
    """An expression the calculator refuses, with the message the model reads."""


def _check(tree: ast.AST) -> None:
    """Refuse anything but arithmetic (module docstring), before anything is evaluated."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Expression, ast.Load, ast.operator, ast.unaryop, ast.cmpop, ast.BinOp, ast.UnaryOp, ast.Compare)):
            if isinstance(node, ast.BinOp) and type(node.op) not in _BINARY:
                raise CalculatorError(f"the operator {type(node.op).__name__} is not allowed; use {ALLOWED}")
            if isinstance(node, ast.UnaryOp) and type(node.op) not in _UNARY:
                raise CalculatorError(f"the operator {type(node.op).__name__} is not allowed; use {ALLOWED}")
            continue
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
                raise CalculatorError(f"only numbers are allowed, not {node.value!r}; use {ALLOWED}")
            continue
        if isinstance(node, ast.Name):
            if node.id not in FUNCTIONS and node.id not in CONSTANTS:
                raise CalculatorError(f"{node.id!r} is not allowed (no files, network or Python here); use {ALLOWED}")
            continue
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS or node.keywords:
                what = node.func.id if isinstance(node.func, ast.Name) else ast.unparse(node.func)[:40]
                raise CalculatorError(f"calling {what!r} is not allowed; use {ALLOWED}")
            continue
        raise CalculatorError(f"{type(node).__name__} is not allowed in an expression (only arithmetic); use {ALLOWED}")


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return CONSTANTS[node.id]
    if isinstance(node, ast.BinOp):
        return _BINARY[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.Compare):
        left, ok = _eval(node.left), True
        for op, right_node in zip(node.ops, node.comparators):
            right = _eval(right_node)
            ok = ok and _COMPARE[type(op)](left, right)
            left = right
        return ok
    if isinstance(node, ast.Call):
        return FUNCTIONS[node.func.id](*(_eval(a) for a in node.args))
    raise CalculatorError(f"{type(node).__name__} is not allowed")  # _check refused it already


def evaluate(expression: str) -> str:
    """The value of ``expression`` as text, in this process (no limits but the whitelist: use :func:`calculate`)."""
    if not isinstance(expression, str) or not expression.strip():
        raise CalculatorError("the expression is empty; write arithmetic such as 3 * (4 + 5)")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression has {len(expression)} characters, more than {MAX_EXPRESSION_CHARS}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"not an arithmetic expression ({e.msg}); use {ALLOWED}") from None
    _check(tree)
    try:
        value = _eval(tree)
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except (OverflowError, MemoryError):
        raise CalculatorError("the result is too large") from None
    except (ValueError, TypeError) as e:
        raise CalculatorError(str(e)[:200]) from None
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    try:
        text = repr(value) if isinstance(value, float) else str(value)
    except ValueError:  # an int past Python's digit limit for str()
        raise CalculatorError("the result is too large") from None
    if len(text) > MAX_RESULT_CHARS:
        raise CalculatorError(f"the result has {len(text)} digits, more than {MAX_RESULT_CHARS}")
    return text


def _child(expression: str, write_fd: int) -> None:  # pragma: no cover - runs in the forked child
    import resource

    code = 0
    try:
        resource.setrlimit(resource.RLIMIT_CPU, (CPU_SECONDS, CPU_SECONDS))
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NOFILE, (write_fd + 1, write_fd + 1))
        try:
            out = "ok:" + evaluate(expression)
        except CalculatorError as e:
            out = "err:" + str(e)
        except MemoryError:
            out = "err:the result is too large (memory limit)"
        os.write(write_fd, out.encode("utf-8", "replace")[:4096])
    except BaseException:  # noqa: BLE001 - the parent reports an empty answer
        code = 1
    finally:
        os._exit(code)


def calculate(expression: str) -> str:
    """The value of ``expression``, evaluated in a sandboxed child (module docstring); ``Error: ...`` when refused."""
    if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION_CHARS:
        return f"Error: the expression must be text of at most {MAX_EXPRESSION_CHARS} characters"
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read_fd)
        _child(expression, write_fd)
    os.close(write_fd)
    deadline = time.monotonic() + WALL_SECONDS
    status = None
    try:
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.005)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return f"Error: the expression ran for more than {WALL_SECONDS:g} s and was stopped"
        answer = os.read(read_fd, 8192).decode("utf-8", "replace")
    finally:
        os.close(read_fd)
    if answer.startswith("ok:"):
        return answer[3:]
    if answer.startswith("err:"):
        return f"Error: {answer[4:]}"
    if status is not None and os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGXCPU, signal.SIGKILL):
        return f"Error: the expression used more than {CPU_SECONDS} s of CPU and was stopped"
    return "Error: the expression exceeded the calculator's limits (CPU, memory) and was stopped"


def main() -> None:
    """The stdio MCP server (``python -m agent.calculator``)."""
    import asyncio

    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    server = MCPServer("ema-pg-calculator", log_level="ERROR")

    async def calculate_tool(expression: str) -> str:
        answer = await asyncio.to_thread(calculate, expression)
        if answer.startswith("Error: "):
            raise ToolError(answer[len("Error: "):])
        return answer

    server.add_tool(calculate_tool, name="calculate",
                    description=f"Evaluate an arithmetic expression, e.g. (1969 - 1903) * 2. Allowed: {ALLOWED}.")
    server.run("stdio")


if __name__ == "__main__":
    main()
