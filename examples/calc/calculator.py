"""The `calculator` tool: safe evaluation of an arithmetic expression by walking its AST (no `eval`).

Numbers, `+ - * / // % **`, unary signs and parentheses; nothing else (no names, calls,
attributes). Every input is bounded: the text's length, the tree's depth, exponents and the size of
every intermediate result, so a model cannot make the harness spin or run out of memory. Values are
exact `Fraction`s, so `0.1 + 0.2` is `0.3`, and the symbolic checks of the data builder use the
same walker.
"""

from __future__ import annotations

import ast
import json
import operator
from collections.abc import Callable
from fractions import Fraction
from typing import Any

MAX_CHARS = 200
MAX_DEPTH = 32
MAX_EXPONENT = 64
MAX_MAGNITUDE = Fraction(10) ** 30

TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression (numbers, + - * / // % ** and parentheses).",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "for example (12 + 3) * 4 / 5"}},
            "required": ["expression"],
        },
    },
}

_BINARY: dict[type[ast.operator], Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: lambda a, b: Fraction(a // b),
    ast.Mod: operator.mod,
}


class CalcError(ValueError):
    """The expression is not allowed or cannot be computed; the message says why (shown to the model)."""


def _bounded(value: Fraction) -> Fraction:
    if abs(value) > MAX_MAGNITUDE:
        raise CalcError("result too large")
    return value


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1 or abs(exponent) > MAX_EXPONENT:
        raise CalcError(f"exponents must be whole numbers up to {MAX_EXPONENT}")
    if base == 0 and exponent < 0:
        raise CalcError("division by zero")
    return _bounded(base ** int(exponent))


def _walk(node: ast.AST, depth: int) -> Fraction:
    if depth > MAX_DEPTH:
        raise CalcError("expression nested too deeply")
    match node:
        case ast.Constant(value=bool()):
            raise CalcError("only numbers are allowed")
        case ast.Constant(value=int() | float() as number):
            return _bounded(Fraction(str(number)) if isinstance(number, float) else Fraction(number))
        case ast.UnaryOp(op=ast.USub(), operand=operand):
            return -_walk(operand, depth + 1)
        case ast.UnaryOp(op=ast.UAdd(), operand=operand):
            return _walk(operand, depth + 1)
        case ast.BinOp(left=left, op=ast.Pow(), right=right):
            return _power(_walk(left, depth + 1), _walk(right, depth + 1))
        case ast.BinOp(left=left, op=op, right=right) if type(op) in _BINARY:
            a, b = _walk(left, depth + 1), _walk(right, depth + 1)
            if b == 0 and not isinstance(op, ast.Add | ast.Sub | ast.Mult):
                raise CalcError("division by zero")
            return _bounded(_BINARY[type(op)](a, b))
    raise CalcError(f"{type(node).__name__} is not allowed; use numbers, + - * / // % ** and parentheses")


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression; `CalcError` for anything else."""
    if len(expression) > MAX_CHARS:
        raise CalcError(f"expression longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.replace("^", "**").replace("×", "*").replace("÷", "/"), mode="eval")
    except SyntaxError:
        raise CalcError("not a valid expression") from None
    return _walk(tree.body, 0)


def format_number(value: Fraction) -> str:
    """An exact integer as is, anything else to 6 decimals without trailing zeros."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.6f}".rstrip("0").rstrip(".")


def run_tool(name: str, arguments: str) -> str:
    """What a tool call returns to the model: the result, or `error: ...` it can read."""
    if name != "calculator":
        return f"error: no tool named {name[:40]}"
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return "error: arguments are not JSON"
    expression = parsed.get("expression") if isinstance(parsed, dict) else None
    if not isinstance(expression, str):
        return 'error: pass {"expression": "..."}'
    try:
        return format_number(evaluate(expression))
    except CalcError as exc:
        return f"error: {exc}"
