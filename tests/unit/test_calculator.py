import asyncio

import pytest

from tailcut.tools.base import Tool, ToolSet
from tailcut.tools.calculator import (
    MAX_ABS_VALUE,
    CalculatorError,
    CalculatorTool,
    evaluate,
    format_number,
)


@pytest.mark.parametrize(
    ("expr", "value"),
    [
        ("12 + 7", 19),
        ("19 - 5", 14),
        ("6 * 7", 42),
        ("84 / 2", 42),
        ("7 / 2", 3.5),
        ("7 // 2", 3),
        ("7 % 3", 1),
        ("2 ** 10", 1024),
        ("2 ^ 10", 1024),
        ("-(3 + 4) * 2", -14),
        ("+5", 5),
        ("1,234 + 1", 1235),
        ("3 × 4 ÷ 2", 6),
        ("0.5 + 0.25", 0.75),
        ("  42  ", 42),
        ("((((1))))", 1),
    ],
)
def test_evaluates_arithmetic(expr, value):
    result = evaluate(expr)
    assert result == value
    assert type(result) is type(value)


@pytest.mark.parametrize(
    ("expr", "fragment"),
    [
        ("", "empty"),
        ("1 / 0", "division by zero"),
        ("5 // 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("2 ** 100000", "exponent"),
        ("9 ** 60", "exceeds the limit"),
        ("10 ** 18 * 10 ** 18", "exceeds the limit"),
        ("1e308 * 10", "exceeds the limit"),
        ("(-8) ** 0.5", "fractional power"),
        ("__import__('os')", "unsupported syntax"),
        ("x + 1", "unsupported syntax"),
        ("'a' * 3", "only numbers"),
        ("True + 1", "only numbers"),
        ("[1, 2]", "unsupported syntax"),
        ("1 < 2", "unsupported syntax"),
        ("1 +", "cannot parse"),
        ("1" * 300, "characters"),
        ("-" * 40 + "1", "nested deeper"),
    ],
)
def test_refuses_with_a_clear_error(expr, fragment):
    with pytest.raises(CalculatorError, match=fragment):
        evaluate(expr)


def test_error_names_the_column():
    with pytest.raises(CalculatorError) as info:
        evaluate("3 + 4 / 0")
    assert "column 5" in str(info.value)
    assert "'3 + 4 / 0'" in str(info.value)


def test_never_calls_eval(monkeypatch):
    import builtins

    def forbidden(*_args, **_kwargs):
        raise AssertionError("eval must not be called")

    monkeypatch.setattr(builtins, "eval", forbidden)
    assert evaluate("(2 + 3) * 4") == 20


def test_bound_holds_exactly_at_the_limit():
    assert evaluate(str(MAX_ABS_VALUE)) == MAX_ABS_VALUE
    with pytest.raises(CalculatorError):
        evaluate(f"{MAX_ABS_VALUE} + 1")


@pytest.mark.parametrize(
    ("value", "text"),
    [(19, "19"), (-3, "-3"), (3.5, "3.5"), (2.0, "2"), (1 / 3, "0.333333"), (-1e-9, "0")],
)
def test_format_number(value, text):
    assert format_number(value) == text


def test_tool_follows_the_protocol_and_answers_through_a_session():
    tool = CalculatorTool()
    assert isinstance(tool, Tool)
    assert tool.schema()["function"]["name"] == "calculator"
    assert tool.schema()["function"]["parameters"]["required"] == ["expression"]

    async def run():
        toolset = ToolSet({"calculator": tool})
        async with toolset.session("s1", {"calculator": {"ground_truth": "7"}}) as session:
            ok = await session.call("calculator", {"expression": "12 + 7"})
            bad = await session.call("calculator", {"expression": "12 / 0"})
            missing = await session.call("calculator", {"expr": "1"})
            assert tool.instances == {"s1"}
            reward = await session.rewards()
        return ok, bad, missing, reward

    ok, bad, missing, reward = asyncio.run(run())
    assert (ok.text, ok.status) == ("19", "ok")
    assert bad.status == "error" and bad.text.startswith("Error: division by zero")
    assert missing.status == "bad_arguments" and "expression" in missing.text
    assert reward == {"calculator": 0.0}
    assert tool.instances == set()


def test_a_flat_chain_of_operations_is_not_nesting():
    terms = range(1, 41)  # 40 terms, 110 characters: a left-deep tree of 39 additions
    assert evaluate("+".join(map(str, terms))) == sum(terms)
    assert evaluate("*".join(["1"] * 60)) == 1
    nested = "1+(" * 33 + "1" + ")" * 33  # a right side in parentheses still nests
    with pytest.raises(CalculatorError, match="nested deeper"):
        evaluate(nested)
