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
descriptors already open), and a wall-clock deadline after which it is killed. The server's :class:`Sandbox` runs
every call's child at once and gives runaways a budget (a few slots, a bounded wait), so however many runaways a
round sends, its good calls answer in milliseconds. Every refusal is an answer the model reads (``Error: ...``),
never an exception of the server.
"""

from __future__ import annotations

import ast
import math
import operator
import os
import signal
import time
from typing import Any

__all__ = ["CONSTANTS", "FUNCTIONS", "CalculatorError", "Sandbox", "evaluate", "calculate", "main"]

CPU_SECONDS = 2
WALL_SECONDS = 3.0
QUICK_SECONDS = 0.5  # wall-clock time every expression gets at once, however many run (Sandbox)
LONG_SLOTS = 2  # expressions past QUICK_SECONDS that may run at a time; the others wait, stopped
LONG_WAIT_SECONDS = 10.0  # how long a stopped expression waits for a slot before it is refused
MAX_CHILDREN = 256
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


class Sandbox:
    """Expressions evaluated in sandboxed children (module docstring), many at once, with a budget for runaways.

    Every expression starts at once in its own child (no queue: a good one takes milliseconds of CPU, which the OS
    gives it however many others run) and has :data:`QUICK_SECONDS` of wall-clock time. One still running then is a
    *runaway* candidate: it is stopped (``SIGSTOP``: it neither computes nor grows) and waits for one of
    :data:`LONG_SLOTS` slots, in which it runs on (continued) until :data:`WALL_SECONDS` more have passed. One that
    waits :data:`LONG_WAIT_SECONDS` for a slot is refused. So 64 runaways in a round cost the machine at most
    ``LONG_SLOTS`` busy children, cannot delay a good expression behind them, and are all answered within
    ``QUICK_SECONDS + LONG_WAIT_SECONDS + WALL_SECONDS``. At most :data:`MAX_CHILDREN` children exist at a time;
    an expression beyond that is refused at once."""

    def __init__(self) -> None:
        import asyncio

        self._long = asyncio.Semaphore(LONG_SLOTS)
        self.children = 0

    async def calculate(self, expression: str) -> str:
        """The value of ``expression`` (``Error: ...`` when refused, stopped or out of budget)."""
        import asyncio

        if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION_CHARS:
            return f"Error: the expression must be text of at most {MAX_EXPRESSION_CHARS} characters"
        if self.children >= MAX_CHILDREN:
            return f"Error: the calculator is evaluating {self.children} expressions at once; retry shortly"
        self.children += 1
        child = _Child(expression)
        try:
            if await child.wait(QUICK_SECONDS):
                return child.answer()
            child.signal(signal.SIGSTOP)
            try:
                await asyncio.wait_for(self._long.acquire(), LONG_WAIT_SECONDS)
            except asyncio.TimeoutError:
                return (f"Error: the expression ran for more than {QUICK_SECONDS:g} s and the calculator is busy with other "
                        "long expressions; it was stopped. Simplify it")
            try:
                child.signal(signal.SIGCONT)
                if await child.wait(WALL_SECONDS):
                    return child.answer()
                return f"Error: the expression ran for more than {QUICK_SECONDS + WALL_SECONDS:g} s and was stopped"
            finally:
                self._long.release()
        finally:
            child.close()
            self.children -= 1


class _Child:
    """One expression's forked, limited child (:func:`_child`) and the pipe it answers on."""

    def __init__(self, expression: str) -> None:
        self.read_fd, write_fd = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - the child
            os.close(self.read_fd)
            _child(expression, write_fd)
        os.close(write_fd)
        self.status: int | None = None

    async def wait(self, seconds: float) -> bool:
        """Whether the child ended within ``seconds`` of wall-clock time (polled; the event loop stays free)."""
        import asyncio

        deadline = time.monotonic() + seconds
        while True:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.status = status
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.005)

    def signal(self, sig: int) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def answer(self) -> str:
        answer = os.read(self.read_fd, 8192).decode("utf-8", "replace")
        if answer.startswith("ok:"):
            return answer[3:]
        if answer.startswith("err:"):
            return f"Error: {answer[4:]}"
        status = self.status
        if status is not None and os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGXCPU, signal.SIGKILL):
            return f"Error: the expression used more than {CPU_SECONDS} s of CPU and was stopped"
        return "Error: the expression exceeded the calculator's limits (CPU, memory) and was stopped"

    def close(self) -> None:
        """Kill the child if it still runs (a stopped one too), reap it, close the pipe."""
        if self.status is None:
            self.signal(signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self.status = -1
        os.close(self.read_fd)


def calculate(expression: str) -> str:
    """The value of ``expression``, evaluated in a sandboxed child (module docstring); ``Error: ...`` when refused.
    One expression, in this thread (the server's tool uses a shared :class:`Sandbox`)."""
    import asyncio

    return asyncio.run(Sandbox().calculate(expression))


def main() -> None:
    """The stdio MCP server (``python -m agent.calculator``)."""
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    server = MCPServer("ema-pg-calculator", log_level="ERROR")
    sandbox = Sandbox()

    async def calculate_tool(expression: str) -> str:
        answer = await sandbox.calculate(expression)
        if answer.startswith("Error: "):
            raise ToolError(answer[len("Error: "):])
        return answer

    server.add_tool(calculate_tool, name="calculate",
                    description=f"Evaluate an arithmetic expression, e.g. (1969 - 1903) * 2. Allowed: {ALLOWED}.")
    server.run("stdio")


if __name__ == "__main__":
    main()
