"""Exact arithmetic on an expression from the model, without eval: the expression is parsed with :mod:`ast` and only
numbers, ``+ - * / // % **``, unary minus / plus and parentheses are evaluated, on :class:`fractions.Fraction`.

Integers stay exact at any size up to MAX_BITS; a decimal literal is taken as written (``0.1`` is 1/10, not the
binary float); ``/`` gives an exact fraction; ``//`` and ``%`` follow Python (floor division). Sizes are checked
before each power and after each operation, so ``9**9**9`` is refused at once instead of hanging the caller.
"""

from __future__ import annotations

import ast
import math
from fractions import Fraction

__all__ = ["MAX_BITS", "MAX_CHARS", "CalculatorError", "calculate", "format_value"]

MAX_BITS = 1 << 14
"""Largest numerator or denominator, in bits (about 4900 decimal digits)."""
MAX_CHARS = 1000
"""Longest expression accepted."""

_BINOPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: Fraction(a // b),
    ast.Mod: lambda a, b: a % b,
}
_SYMBOLS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**"}
_ALLOWED = "only numbers, + - * / // % **, unary minus and parentheses are allowed"


class CalculatorError(ValueError):
    """The expression is refused or cannot be evaluated; the message is meant for the model to read."""


def _check_size(value: Fraction) -> Fraction:
    if max(value.numerator.bit_length(), value.denominator.bit_length()) > MAX_BITS:
        raise CalculatorError(f"a number in the calculation exceeds {MAX_BITS} bits")
    return value


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise CalculatorError("only integer exponents are exact; got a fractional exponent")
    e = exponent.numerator
    if base == 0 and e < 0:
        raise CalculatorError("division by zero (0 to a negative power)")
    if base in (0, 1) or e == 0:
        return Fraction(1) if e == 0 else base
    if base == -1:
        return Fraction(-1 if e % 2 else 1)
    bits = max(base.numerator.bit_length(), base.denominator.bit_length())
    if abs(e) * max(1, bits - 1) > MAX_BITS:  # (2^(bits-1))^|e| <= the result's size: refuse before computing it
        raise CalculatorError(f"the power is too large (more than {MAX_BITS} bits)")
    return _check_size(base**e)


def _literal(node: ast.Constant, text: str) -> Fraction:
    value = node.value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CalculatorError(f"{_ALLOWED}; found the literal {ast.get_source_segment(text, node)!r}")
    if isinstance(value, int):
        return _check_size(Fraction(value))
    source = (ast.get_source_segment(text, node) or repr(value)).replace("_", "")
    mantissa, _, exp = source.lower().partition("e")
    if exp and abs(int(exp)) > MAX_BITS // 3:  # Fraction("1e999999999") would build 10**999999999 first
        raise CalculatorError(f"the number {source!r} exceeds {MAX_BITS} bits")
    try:
        exact = Fraction(source)  # as written: 0.1 is 1/10
    except (ValueError, ZeroDivisionError):  # not a plain decimal literal (cannot happen for ast's floats)
        if not math.isfinite(value):
            raise CalculatorError(f"the number {source!r} is too large") from None
        exact = Fraction(value)
    return _check_size(exact)


def _eval(node: ast.AST, text: str) -> Fraction:
    if isinstance(node, ast.Expression):
        return _eval(node.body, text)
    if isinstance(node, ast.Constant):
        return _literal(node, text)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand, text)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _SYMBOLS:
        left = _eval(node.left, text)
        right = _eval(node.right, text)
        if isinstance(node.op, ast.Pow):
            return _power(left, right)
        if right == 0 and isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
            raise CalculatorError(f"division by zero ({_SYMBOLS[type(node.op)]} 0)")
        return _check_size(_BINOPS[type(node.op)](left, right))
    what = {
        ast.Name: "a name",
        ast.Call: "a function call",
        ast.Attribute: "an attribute",
        ast.Subscript: "a subscript",
        ast.Compare: "a comparison",
    }.get(type(node), f"a {type(node).__name__} expression")
    segment = ast.get_source_segment(text, node) or ""
    raise CalculatorError(f"{_ALLOWED}; found {what}: {segment[:60]!r}")


def calculate(expression: str) -> Fraction:
    """The exact value of ``expression``; raises CalculatorError with a readable reason."""
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be a string, got {type(expression).__name__}")
    text = expression.strip()
    if not text:
        raise CalculatorError("the expression is empty")
    if len(text) > MAX_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"not a valid expression: {e.msg}") from None
    except (ValueError, RecursionError, MemoryError) as e:
        raise CalculatorError(f"not a valid expression: {type(e).__name__}") from None
    try:
        return _eval(tree, text)
    except RecursionError:
        raise CalculatorError("the expression is nested too deeply") from None


def format_value(value: Fraction) -> str:
    """An integer as itself; a fraction whose decimal expansion ends as an exact decimal (``0.125``); else
    ``p/q`` with a 12-digit decimal approximation."""
    if value.denominator == 1:
        return str(value.numerator)
    den, twos, fives = value.denominator, 0, 0
    while den % 2 == 0:
        den //= 2
        twos += 1
    while den % 5 == 0:
        den //= 5
        fives += 1
    if den == 1:
        places = max(twos, fives)
        scaled = abs(value.numerator) * 10**places // value.denominator
        digits = str(scaled).rjust(places + 1, "0")
        return ("-" if value < 0 else "") + digits[:-places] + "." + digits[-places:]
    try:
        approx = f" (about {float(value):.12g})"
    except OverflowError:
        approx = ""
    return f"{value.numerator}/{value.denominator}{approx}"
