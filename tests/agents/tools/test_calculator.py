"""The calculator: exact arithmetic from the syntax tree; code, huge powers and long input refused."""

from __future__ import annotations

import asyncio

import pytest

from posttrain.agents.tools import CalculatorTool, ToolError


@pytest.fixture(scope="module")
def calc() -> CalculatorTool:
    return CalculatorTool()


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("2 + 3 * 4", "14"),
        ("(2 + 3) * 4", "20"),
        ("123456789 * 987654321", "121932631112635269"),
        ("7 / 2", "3.5"),
        ("7 // 2", "3"),
        ("-7 // 2", "-4"),
        ("7 % 3", "1"),
        ("2 ** 10", "1024"),
        ("-2 ** 2", "-4"),
        ("+-3", "-3"),
        ("1.5 * 4", "6.0"),
        ("10 ** -2", "0.01"),
        ("2 ** 0.5", "1.4142135623730951"),
        ("1_000 + 1", "1001"),
        ("  42 ", "42"),
    ],
)
def test_arithmetic(calc: CalculatorTool, expression: str, value: str) -> None:
    assert asyncio.run(calc.call({"expression": expression}, {})) == value


def test_big_integers_are_exact(calc: CalculatorTool) -> None:
    a, b = 98765432109876543210, 12345678901234567890
    assert asyncio.run(calc.call({"expression": f"{a} * {b}"}, {})) == str(a * b)
    assert calc.evaluate("2 ** 1000") == 2**1000


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('echo hi')", "function calls are not allowed"),
        ("os", "names are not allowed ('os')"),
        ("(1).__class__", "attributes are not allowed"),
        ("[1, 2]", "List is not allowed"),
        ("1 if 1 else 2", "IfExp is not allowed"),
        ("1 < 2", "operator not allowed"),
        ("lambda: 1", "Lambda is not allowed"),
        ("'a' * 3", "only numbers are allowed"),
        ("True + 1", "only numbers are allowed"),
        ("1j * 2", "only numbers are allowed"),
        ("2 ^ 3", "write **"),
        ("1,000 + 1", "commas are not allowed"),
        ("1 << 10", "operator not allowed"),
        ("1 +", "invalid expression"),
        ("", "empty expression"),
        ("x = 1", "invalid expression"),
    ],
)
def test_everything_but_arithmetic_is_refused(calc: CalculatorTool, expression: str, message: str) -> None:
    with pytest.raises(ToolError) as info:
        calc.evaluate(expression)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("9 ** 9 ** 9", "exponent too large"),
        ("10 ** 5000", "result too large (about 5001 digits > 1000)"),
        ("(10 ** 600) * (10 ** 600)", "result too large (more than 1000 digits)"),
        ("2.0 ** 5000", "float overflow"),
        ("1e308 * 10", "float overflow"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("(-8) ** (1 / 3)", "not a real number"),
    ],
)
def test_limits_and_arithmetic_errors(calc: CalculatorTool, expression: str, message: str) -> None:
    with pytest.raises(ToolError, match=None) as info:
        calc.evaluate(expression)
    assert message in str(info.value)


def test_expression_length_and_nesting_limits() -> None:
    calc = CalculatorTool(max_expression_chars=50)
    with pytest.raises(ToolError, match="expression too long"):
        calc.evaluate("1+" * 30 + "1")
    deep = CalculatorTool(max_expression_chars=100_000)
    with pytest.raises(ToolError, match="nested"):
        deep.evaluate("(" * 1000 + "1" + ")" * 1000)


def test_schema_asks_for_one_string() -> None:
    fn = CalculatorTool().schema()["function"]
    assert fn["name"] == "calculator"
    assert fn["parameters"]["required"] == ["expression"]
    assert fn["parameters"]["properties"]["expression"]["type"] == "string"
