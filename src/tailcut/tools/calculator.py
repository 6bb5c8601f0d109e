"""The ``calculator`` tool: safe evaluation of an arithmetic expression.

The expression is parsed with :mod:`ast` and walked node by node; only number literals,
``+ - * / // % **``, unary ``+``/``-`` and parentheses are accepted. Nothing is ever passed
to ``eval``. Sizes are bounded so that a hostile expression cannot hang the process:
the text length, the nesting depth, the exponent and the magnitude of every intermediate
value. Every rejection is a :class:`CalculatorError` whose message says what is wrong and
where (the column in the expression).
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tailcut.tools.base import ToolResult

TOOL_NAME = "calculator"

MAX_EXPRESSION_CHARS = 200
MAX_DEPTH = 32
MAX_EXPONENT = 64
MAX_ABS_VALUE = 10**18
"""Largest magnitude of any intermediate or final value."""

Number = int | float


class CalculatorError(ValueError):
    """An expression the calculator refuses; the message is shown to the model."""


@dataclass(frozen=True, slots=True)
class _Limits:
    max_chars: int = MAX_EXPRESSION_CHARS
    max_depth: int = MAX_DEPTH
    max_exponent: int = MAX_EXPONENT
    max_abs: int = MAX_ABS_VALUE


def _div(a: Number, b: Number) -> Number:
    if b == 0:
        raise ZeroDivisionError
    if isinstance(a, int) and isinstance(b, int) and a % b == 0:
        return a // b
    return a / b


_BINARY: dict[type[ast.operator], Callable[[Any, Any], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: _div,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_SYMBOL = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
}


class _Evaluator:
    def __init__(self, text: str, limits: _Limits):
        self.text = text
        self.limits = limits

    def fail(self, node: ast.AST, message: str) -> CalculatorError:
        col = getattr(node, "col_offset", None)
        where = f" at column {col + 1}" if isinstance(col, int) else ""
        return CalculatorError(f"{message}{where} in {self.text!r}")

    def check(self, node: ast.AST, value: Number) -> Number:
        if isinstance(value, float) and not math.isfinite(value):
            raise self.fail(node, "result is not a finite number")
        if abs(value) > self.limits.max_abs:
            raise self.fail(node, f"value exceeds the limit of {self.limits.max_abs:.0e}")
        return value

    def eval(self, node: ast.AST, depth: int = 0) -> Number:
        if depth > self.limits.max_depth:
            raise self.fail(node, f"expression nested deeper than {self.limits.max_depth} levels")
        if isinstance(node, ast.Constant):
            value = node.value
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise self.fail(node, f"only numbers are allowed, got {value!r}")
            return self.check(node, value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
            operand = self.eval(node.operand, depth + 1)
            return -operand if isinstance(node.op, ast.USub) else operand
        if isinstance(node, ast.BinOp):
            return self.binary(node, depth)
        raise self.fail(node, f"unsupported syntax ({type(node).__name__})")

    def binary(self, node: ast.BinOp, depth: int) -> Number:
        # A flat chain (1 + 2 + ... + n) parses left-deep: its left side is not nesting.
        left = self.eval(node.left, depth if isinstance(node.left, ast.BinOp) else depth + 1)
        right = self.eval(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            return self.power(node, left, right)
        fn = _BINARY.get(type(node.op))
        if fn is None:
            raise self.fail(node, f"unsupported operator {type(node.op).__name__}")
        try:
            value = fn(left, right)
        except ZeroDivisionError:
            raise self.fail(node, f"division by zero ({_SYMBOL[type(node.op)]})") from None
        return self.check(node, value)

    def _too_big(self, base: Number, exponent: Number) -> bool:
        if not (isinstance(base, int) and isinstance(exponent, int)) or exponent < 0:
            return False
        return base not in (-1, 0, 1) and exponent * math.log2(abs(base)) > math.log2(
            self.limits.max_abs
        )

    def power(self, node: ast.BinOp, base: Number, exponent: Number) -> Number:
        if abs(exponent) > self.limits.max_exponent:
            raise self.fail(node, f"exponent {exponent} is larger than {self.limits.max_exponent}")
        if base == 0 and exponent < 0:
            raise self.fail(node, "division by zero (0 to a negative power)")
        if base < 0 and isinstance(exponent, float) and not exponent.is_integer():
            raise self.fail(node, "negative number to a fractional power")
        # Bound the size before computing: |base|**exponent must stay under max_abs.
        if self._too_big(base, exponent):
            raise self.fail(node, f"value exceeds the limit of {self.limits.max_abs:.0e}")
        try:
            value = base**exponent
        except OverflowError:
            raise self.fail(node, f"value exceeds the limit of {self.limits.max_abs:.0e}") from None
        return self.check(node, value)


def evaluate(expression: str, *, limits: _Limits | None = None) -> Number:
    """The value of an arithmetic expression; :class:`CalculatorError` if it is refused.

    ``^`` is read as a power (as people type it), ``×`` / ``÷`` as ``*`` / ``/``, and ``,``
    thousands separators between digits are removed.
    """
    lim = limits or _Limits()
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    text = expression.strip()
    if not text:
        raise CalculatorError("expression is empty")
    if len(text) > lim.max_chars:
        raise CalculatorError(
            f"expression has {len(text)} characters; the limit is {lim.max_chars}"
        )
    normalized = _normalize(text)
    try:
        tree = ast.parse(normalized, mode="eval")
    except SyntaxError as exc:
        col = f" at column {exc.offset}" if exc.offset else ""
        raise CalculatorError(f"cannot parse {text!r}{col}: {exc.msg}") from None
    except (ValueError, RecursionError, MemoryError):
        raise CalculatorError(f"cannot parse {text!r}") from None
    return _Evaluator(text, lim).eval(tree.body)


def _normalize(text: str) -> str:
    out = text.replace("^", "**").replace("×", "*").replace("÷", "/")
    chars = list(out)
    for i, ch in enumerate(chars):
        if (
            ch == ","
            and 0 < i < len(chars) - 1
            and chars[i - 1].isdigit()
            and chars[i + 1].isdigit()
        ):
            chars[i] = ""
    return "".join(chars)


def format_number(value: Number) -> str:
    """How the tool writes a value: integers exactly, other values with up to 6 decimals."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer():
        return str(int(value))
    text = f"{value:.6f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "For example: 12 + 7"},
            },
            "required": ["expression"],
        },
    },
}


class CalculatorTool:
    """The ``calculator`` tool (stateless; gives no reward of its own)."""

    name = TOOL_NAME

    def __init__(self) -> None:
        self.instances: set[str] = set()

    def schema(self) -> dict[str, Any]:
        return SCHEMA

    async def create(self, instance_id: str, **create_kwargs: Any) -> None:
        self.instances.add(instance_id)

    async def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        unknown = sorted(set(arguments) - {"expression"})
        if "expression" not in arguments or unknown:
            detail = f"unknown argument(s) {unknown}" if unknown else "missing 'expression'"
            return ToolResult(
                f'Error: {detail}; call calculator with {{"expression": "..."}}.', "bad_arguments"
            )
        try:
            value = evaluate(arguments["expression"])
        except CalculatorError as exc:
            return ToolResult(f"Error: {exc}", "error")
        return ToolResult(format_number(value))

    async def calc_reward(self, instance_id: str) -> float:
        return 0.0

    async def release(self, instance_id: str) -> None:
        self.instances.discard(instance_id)
