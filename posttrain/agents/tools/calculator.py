"""The `calculator` tool: arithmetic on ints and floats, evaluated from the syntax tree, never by `eval`.

Only numbers, `+ - * / // % **`, unary signs and parentheses are allowed; names, calls, attributes and
anything else are refused with a message saying what is allowed. Limits keep one call cheap whatever the
model writes: expression length, exponent size and the digits of every intermediate result (checked before a
power is computed, so `9**9**9` is refused at once instead of computed).
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable

from posttrain.agents.tools.base import FunctionTool, ToolError
from posttrain.errors import ConfigError

Number = int | float

_BINARY: dict[type[ast.operator], tuple[str, Callable[[Number, Number], Number]]] = {
    ast.Add: ("+", operator.add),
    ast.Sub: ("-", operator.sub),
    ast.Mult: ("*", operator.mul),
    ast.Div: ("/", operator.truediv),
    ast.FloorDiv: ("//", operator.floordiv),
    ast.Mod: ("%", operator.mod),
    ast.Pow: ("**", operator.pow),
}
_UNARY: dict[type[ast.unaryop], Callable[[Number], Number]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_ALLOWED = "numbers, + - * / // % **, unary minus and parentheses"
_LOG10_2 = math.log10(2)


def _digits(value: int) -> int:
    """Decimal digits of an int, estimated from its bit length (no string conversion)."""
    return int(abs(value).bit_length() * _LOG10_2) + 1


class CalculatorTool(FunctionTool):
    """`calculator(expression)`: the value of an arithmetic expression, as text."""

    def __init__(
        self, *, max_expression_chars: int = 256, max_exponent: int = 10_000, max_result_digits: int = 1000
    ):
        for key, value in (
            ("max_expression_chars", max_expression_chars),
            ("max_exponent", max_exponent),
            ("max_result_digits", max_result_digits),
        ):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"calculator: {key} must be a positive integer, got {value!r}")
        self.max_expression_chars = max_expression_chars
        self.max_exponent = max_exponent
        self.max_result_digits = max_result_digits
        super().__init__(self.calculator, name="calculator")

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression exactly (integers of any size up to the digit limit, or floats).

        Args:
            expression: the expression, e.g. "(12 + 7) * 345" or "2 ** 10 / 3"; only numbers, + - * / // % **
                and parentheses
        """
        value = self.evaluate(expression)
        if isinstance(value, float):
            return repr(value)
        return str(value)

    def evaluate(self, expression: str) -> Number:
        """The expression's value; ToolError with a readable reason when it is refused or fails."""
        if len(expression) > self.max_expression_chars:
            raise ToolError(
                f"expression too long ({len(expression)} > {self.max_expression_chars} characters)"
            )
        if not expression.strip():
            raise ToolError("empty expression")
        try:
            tree = ast.parse(expression.strip(), mode="eval")
        except SyntaxError as exc:
            raise ToolError(f"invalid expression: {exc.msg}; allowed: {_ALLOWED}") from None
        except (RecursionError, MemoryError, ValueError):
            raise ToolError(f"invalid expression (too deeply nested); allowed: {_ALLOWED}") from None
        try:
            return self._eval(tree.body)
        except RecursionError:
            raise ToolError("expression too deeply nested") from None

    def _eval(self, node: ast.expr) -> Number:
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, int | float):
                raise ToolError(f"only numbers are allowed, got {node.value!r}; allowed: {_ALLOWED}")
            return self._checked(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._eval(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            symbol, fn = _BINARY[type(node.op)]
            left, right = self._eval(node.left), self._eval(node.right)
            if symbol == "**":
                self._check_power(left, right)
            try:
                return self._checked(fn(left, right))
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
            except OverflowError:
                raise ToolError("result too large (float overflow)") from None
        raise ToolError(_refusal(node))

    def _check_power(self, base: Number, exponent: Number) -> None:
        if abs(exponent) > self.max_exponent:
            raise ToolError(f"exponent too large ({exponent} > {self.max_exponent})")
        if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
            estimated = exponent * math.log10(abs(base))
            if estimated > self.max_result_digits:
                raise ToolError(
                    f"result too large (about {int(estimated) + 1} digits > {self.max_result_digits})"
                )
        if base == 0 and exponent < 0:
            raise ToolError("division by zero (0 to a negative power)")

    def _checked(self, value: Number) -> Number:
        if isinstance(value, complex):
            raise ToolError("the result is not a real number (a negative number to a fractional power)")
        if isinstance(value, float) and not math.isfinite(value):
            raise ToolError("result too large (float overflow)")
        if isinstance(value, int) and _digits(value) > self.max_result_digits + 1:
            raise ToolError(f"result too large (more than {self.max_result_digits} digits)")
        return value


def _refusal(node: ast.expr) -> str:
    """Why a syntax node is refused, in words a model can act on."""
    if isinstance(node, ast.Name):
        return f"names are not allowed ({node.id!r}); allowed: {_ALLOWED}"
    if isinstance(node, ast.Call):
        return f"function calls are not allowed; allowed: {_ALLOWED}"
    if isinstance(node, ast.Attribute):
        return f"attributes are not allowed; allowed: {_ALLOWED}"
    if isinstance(node, ast.Tuple):
        return f"commas are not allowed (write numbers without thousands separators); allowed: {_ALLOWED}"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        return "^ is not a power here: write ** (e.g. 2 ** 10)"
    if isinstance(node, ast.BinOp | ast.UnaryOp | ast.Compare | ast.BoolOp):
        return f"operator not allowed; allowed: {_ALLOWED}"
    return f"{type(node).__name__} is not allowed; allowed: {_ALLOWED}"
