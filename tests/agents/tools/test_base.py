"""Schemas derived from typed functions and docstrings; arguments checked against them; function tools."""

from __future__ import annotations

import asyncio
import time
from typing import Literal

import pytest

from posttrain.agents.tools import FunctionTool, ToolError, function_tool
from posttrain.agents.tools.schema import check_arguments, parse_docstring
from posttrain.errors import ConfigError


def search(
    query: str,
    top_k: int = 3,
    mode: Literal["fast", "exact"] = "fast",
    weights: list[float] | None = None,
    strict: bool = False,
) -> list[str]:
    """Search the notes.

    Longer explanation that is part of the summary.

    Args:
        query: what to look for
        top_k (int): how many results to return,
            at most 10
        mode: the search mode
        weights: optional per-field weights
        strict: exact matches only

    Returns:
        the matching notes
    """
    return [f"{query}:{top_k}:{mode}:{weights}:{strict}"]


def test_schema_from_signature_and_docstring() -> None:
    schema = function_tool(search).schema()
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "search"
    assert fn["description"] == "Search the notes. Longer explanation that is part of the summary."
    params = fn["parameters"]
    assert params["type"] == "object"
    assert params["required"] == ["query"]  # defaults -> not required
    props = params["properties"]
    assert props["query"] == {"type": "string", "description": "what to look for"}
    assert props["top_k"] == {"type": "integer", "description": "how many results to return, at most 10"}
    assert props["mode"] == {"enum": ["fast", "exact"], "type": "string", "description": "the search mode"}
    assert props["weights"]["type"] == ["array", "null"] and props["weights"]["items"] == {"type": "number"}
    assert props["strict"]["type"] == "boolean"


def test_decorator_with_a_name() -> None:
    @function_tool(name="add_numbers")
    def add(a: int, b: int) -> int:
        """Add."""
        return a + b

    assert add.name == "add_numbers" and add.schema()["function"]["name"] == "add_numbers"
    assert asyncio.run(add.call({"a": 2, "b": 3}, {})) == "5"


def test_docstring_sections_stop_the_summary() -> None:
    summary, params = parse_docstring("Do it.\n\nArgs:\n    x: the x\n\nRaises:\n    ValueError: never\n")
    assert summary == "Do it." and params == {"x": "the x"}


@pytest.mark.parametrize(
    ("arguments", "problem"),
    [
        ({}, "missing required argument 'query'"),
        (
            {"query": "a", "limit": 3},
            "unknown argument 'limit' (expected: query, top_k, mode, weights, strict)",
        ),
        ({"query": 5}, "argument 'query' must be a string, got 5"),
        ({"query": "a", "top_k": "3"}, "argument 'top_k' must be an integer, got \"3\""),
        ({"query": "a", "top_k": True}, "argument 'top_k' must be an integer, got True"),
        ({"query": "a", "top_k": 2.5}, "argument 'top_k' must be an integer, got 2.5"),
        ({"query": "a", "mode": "slow"}, 'argument \'mode\' must be one of "fast", "exact", got "slow"'),
        ({"query": "a", "weights": [1, "x"]}, "argument 'weights'[1] must be a number, got \"x\""),
        ({"query": "a", "strict": "yes"}, "argument 'strict' must be true or false"),
    ],
)
def test_invalid_arguments_are_named(arguments: dict, problem: str) -> None:
    params = function_tool(search).schema()["function"]["parameters"]
    _, problems = check_arguments(params, arguments)
    assert len(problems) == 1 and problems[0].startswith(problem), problems


def test_valid_arguments_pass_ints_become_floats_and_none_is_allowed_for_optional() -> None:
    params = function_tool(search).schema()["function"]["parameters"]
    checked, problems = check_arguments(params, {"query": "a", "weights": [1, 2.5]})
    assert problems == [] and checked["weights"] == [1.0, 2.5] and isinstance(checked["weights"][0], float)
    assert check_arguments(params, {"query": "a", "weights": None})[1] == []


def test_call_with_invalid_arguments_raises_a_tool_error_listing_all_problems() -> None:
    tool = function_tool(search)
    with pytest.raises(
        ToolError, match="invalid arguments for search: missing required argument 'query'; unknown"
    ):
        asyncio.run(tool.call({"q": "x"}, {}))


def test_sync_and_async_functions_and_structured_results() -> None:
    async def slow_double(x: int) -> dict[str, int]:
        """Double."""
        await asyncio.sleep(0)
        return {"double": 2 * x}

    assert asyncio.run(function_tool(slow_double).call({"x": 4}, {})) == '{"double": 8}'
    assert asyncio.run(function_tool(search).call({"query": "q"}, {})) == '["q:3:fast:None:False"]'


def test_sync_function_runs_off_the_event_loop() -> None:
    def blocking(seconds: float) -> str:
        """Block."""
        time.sleep(seconds)
        return "done"

    tool = function_tool(blocking)

    async def main() -> float:
        start = time.monotonic()
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        assert await tool.call({"seconds": 0.3}, {}) == "done"
        task.cancel()
        assert ticks >= 10  # the loop kept running while the function slept
        return time.monotonic() - start

    assert asyncio.run(main()) < 1.0


def test_row_args_come_from_the_rows_tools_kwargs_not_the_model() -> None:
    def check_answer(answer: str, ground_truth: str) -> str:
        """Check an answer.

        Args:
            answer: the final answer
        """
        return "correct" if answer == ground_truth else "wrong"

    tool = FunctionTool(check_answer, row_args=("ground_truth",))
    assert list(tool.schema()["function"]["parameters"]["properties"]) == ["answer"]
    verl_row = {"create_kwargs": {"ground_truth": "42"}}
    assert asyncio.run(tool.call({"answer": "42"}, verl_row)) == "correct"
    assert asyncio.run(tool.call({"answer": "41"}, {"ground_truth": "42"})) == "wrong"
    with pytest.raises(ToolError, match="needs 'ground_truth' from the row"):
        asyncio.run(tool.call({"answer": "42"}, {}))
    with pytest.raises(ToolError, match="unknown argument 'ground_truth'"):  # the model cannot set it
        asyncio.run(tool.call({"answer": "42", "ground_truth": "42"}, {"ground_truth": "1"}))


def test_untyped_or_unsupported_signatures_are_config_errors() -> None:
    def untyped(x):
        return x

    def variadic(*args: int) -> int:
        return 0

    def complex_type(x: set[int]) -> int:
        return 0

    with pytest.raises(ConfigError, match="parameter 'x': has no type annotation"):
        function_tool(untyped)
    with pytest.raises(ConfigError, match=r"\*args"):
        function_tool(variadic)
    with pytest.raises(ConfigError, match="has no JSON schema"):
        function_tool(complex_type)
