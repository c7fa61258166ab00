"""A calculator that evaluates arithmetic safely: the expression is parsed with `ast` and only numeric
literals, + - * / // % **, unary signs, parentheses and a whitelist of math functions and constants
are evaluated, by walking the tree. Nothing is ever passed to eval, and sizes are bounded so that
`9**9**9` or `factorial(10**6)` is refused instead of hanging the server."""
from __future__ import annotations

import ast
import math
import operator
from typing import Any, Callable

from infercept.tools.base import Tool, string_argument, string_parameter

MAX_EXPRESSION_CHARS = 500
MAX_NODES = 200
MAX_INT_BITS = 4096  # about 1233 decimal digits
MAX_FACTORIAL = 500

BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
CONSTANTS = {"pi": math.pi, "e": math.e, "tau": math.tau}


def _factorial(n):
    if not isinstance(n, int) or not 0 <= n <= MAX_FACTORIAL:
        raise CalculationError(f"factorial takes an integer from 0 to {MAX_FACTORIAL}")
    return math.factorial(n)


FUNCTIONS: dict[str, Callable[..., Any]] = {
    "abs": abs, "round": round, "min": min, "max": max, "sqrt": math.sqrt, "exp": math.exp,
    "log": math.log, "log10": math.log10, "log2": math.log2, "sin": math.sin, "cos": math.cos,
    "tan": math.tan, "asin": math.asin, "acos": math.acos, "atan": math.atan, "atan2": math.atan2,
    "hypot": math.hypot, "floor": math.floor, "ceil": math.ceil, "degrees": math.degrees,
    "radians": math.radians, "factorial": _factorial}


class CalculationError(ValueError):
    """The expression is not allowed arithmetic, or its evaluation failed."""


def evaluate(expression: str) -> int | float:
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculationError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculationError(f"not an arithmetic expression: {expression!r}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalculationError(f"expression has more than {MAX_NODES} parts")
    try:
        return _eval(tree.body)
    except (ArithmeticError, ValueError, TypeError) as e:  # 1/0, sqrt(-1), float overflow, bad arity
        if isinstance(e, CalculationError):
            raise
        raise CalculationError(f"{type(e).__name__}: {e}") from None


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        # bool is an int subclass and complex is a number, but neither is arithmetic input here
        if type(node.value) not in (int, float):
            raise CalculationError(f"only numbers are allowed, not {node.value!r}")
        return _bounded(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _bounded(BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.Name) and node.id in CONSTANTS:
        return CONSTANTS[node.id]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS
            and not node.keywords):
        return _bounded(FUNCTIONS[node.func.id](*(_eval(a) for a in node.args)))
    raise CalculationError(f"not allowed in a calculation: {ast.unparse(node)!r}")


def _check_power(base, exponent) -> None:
    """Refuse a power whose integer result would exceed MAX_INT_BITS before computing it."""
    if isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1 and exponent > 0:
        if exponent * math.log2(abs(base)) > MAX_INT_BITS:
            raise CalculationError(f"{base}**{exponent} is too large")


def _bounded(value):
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise CalculationError("result is too large")
    if isinstance(value, complex):  # (-8) ** (1/3)
        raise CalculationError("result is not a real number")
    return value


def format_number(value: int | float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.12g}"


class Calculator(Tool):
    name = "calculator"
    description = ("Evaluate an arithmetic expression, e.g. 24*9/5+32 or sqrt(2)*pi. Supports + - * / // % **, "
                   "parentheses, pi, e and functions such as sqrt, log, sin, round, min, max.")
    parameters = string_parameter("expression", "the arithmetic expression")

    async def run(self, arguments: dict[str, Any]) -> str:
        try:
            return format_number(evaluate(string_argument(arguments, "expression")))
        except CalculationError as e:  # the model reads the reason and can correct its expression
            return f"Error: {e}"
