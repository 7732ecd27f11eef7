"""The runner: failures become messages, a hung tool times out without stalling the others, bounded
concurrency, truncation on the configured side."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from posttrain.agents.tools import CalculatorTool, ToolCall, ToolError, ToolRunner, function_tool, truncate
from posttrain.errors import ConfigError


def make_tools() -> list:
    @function_tool
    async def hang(seconds: float = 60.0) -> str:
        """Never answers in time."""
        await asyncio.sleep(seconds)
        return "late"

    @function_tool
    def hang_sync(seconds: float = 60.0) -> str:
        """A sync function that blocks (runs in its own thread)."""
        threading.Event().wait(seconds)
        return "late"

    @function_tool
    async def echo(text: str) -> str:
        """Echo."""
        return text

    @function_tool
    def broken() -> str:
        """Raises."""
        raise KeyError("boom")

    @function_tool
    def refuses() -> str:
        """Raises a ToolError."""
        raise ToolError("no such file")

    return [hang, hang_sync, echo, broken, refuses, CalculatorTool()]


def test_hung_tools_time_out_while_other_calls_complete_promptly() -> None:
    runner = ToolRunner(make_tools(), max_concurrency=4, timeout_s=0.5)

    async def main() -> tuple[list, float, float]:
        start = time.monotonic()
        hung = asyncio.gather(runner.run(ToolCall("hang", {})), runner.run(ToolCall("hang_sync", {})))
        quick = await runner.run_all([ToolCall("echo", {"text": str(i)}) for i in range(3)])
        quick_s = time.monotonic() - start
        hung_out = await hung
        return [*hung_out, *quick], quick_s, time.monotonic() - start

    outputs, quick_s, total_s = asyncio.run(main())
    assert quick_s < 0.2, quick_s  # the quick calls did not wait for the hung ones
    assert total_s < 1.5, total_s  # the hung ones were abandoned at the timeout
    for out in outputs[:2]:
        assert out.timed_out and not out.ok and "timed out after 0.5 s" in out.text
        assert 0.45 < out.seconds < 1.0
    assert [o.text for o in outputs[2:]] == ["0", "1", "2"] and all(o.ok for o in outputs[2:])


def test_timed_out_calls_free_their_slot() -> None:
    runner = ToolRunner(make_tools(), max_concurrency=1, timeout_s=0.2)

    async def main() -> list:
        return await runner.run_all(
            [ToolCall("hang_sync", {}), ToolCall("hang", {}), ToolCall("echo", {"text": "x"})]
        )

    start = time.monotonic()
    outputs = asyncio.run(main())
    assert [o.timed_out for o in outputs] == [True, True, False] and outputs[2].text == "x"
    assert time.monotonic() - start < 1.0


def test_concurrency_is_bounded() -> None:
    active, peak = 0, 0

    @function_tool
    async def busy() -> str:
        """Counts concurrent calls."""
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(0.05)
        active -= 1
        return "ok"

    runner = ToolRunner([busy], max_concurrency=2)
    outputs = asyncio.run(runner.run_all([ToolCall("busy", {})] * 6))
    assert all(o.ok for o in outputs) and peak == 2


def test_failures_are_messages_never_exceptions() -> None:
    runner = ToolRunner(make_tools())
    calls = [
        ToolCall("nope", {}),
        ToolCall("broken", {}),
        ToolCall("refuses", {}),
        ToolCall("echo", {"txt": "a"}),
        ToolCall("calculator", {"expression": "1/0"}),
    ]
    outputs = asyncio.run(runner.run_all(calls))
    assert not any(o.ok or o.timed_out for o in outputs)
    texts = [o.text for o in outputs]
    assert texts[0].startswith("Error: unknown tool 'nope'; available tools: hang, hang_sync, echo")
    assert texts[1] == "Error: broken failed: KeyError: 'boom'"
    assert texts[2] == "Error: no such file"
    assert texts[3].startswith("Error: invalid arguments for echo: missing required argument 'text'; unknown")
    assert texts[4] == "Error: division by zero"


def test_row_kwargs_are_given_per_tool() -> None:
    class Whoami:
        name = "whoami"

        def schema(self) -> dict:
            return {"type": "function", "function": {"name": "whoami", "parameters": {}}}

        async def call(self, arguments: dict, row_kwargs: dict) -> str:
            return str(row_kwargs.get("create_kwargs", {}).get("user", "nobody"))

    runner = ToolRunner([Whoami(), CalculatorTool()])
    own = {"create_kwargs": {"user": "ada"}}
    assert asyncio.run(runner.run(ToolCall("whoami", {}), own)).text == "ada"  # run: that tool's own kwargs
    assert asyncio.run(runner.run(ToolCall("whoami", {}))).text == "nobody"
    tools_kwargs = {"whoami": {"create_kwargs": {"user": "bob"}}, "calculator": {}}  # run_all: the row's all
    calls = [ToolCall("whoami", {}), ToolCall("calculator", {"expression": "1+1"}), ToolCall("whoami", {})]
    assert [o.text for o in asyncio.run(runner.run_all(calls, tools_kwargs))] == ["bob", "2", "bob"]
    assert runner.schemas()[0] == Whoami().schema()


@pytest.mark.parametrize("side", ["left", "right", "middle"])
def test_long_answers_are_truncated_on_the_configured_side(side: str) -> None:
    text = "".join(str(i % 10) for i in range(1000))
    runner = ToolRunner(make_tools(), max_response_chars=100, truncate_side=side)  # type: ignore[arg-type]
    out = asyncio.run(runner.run(ToolCall("echo", {"text": text})))
    assert out.ok and out.truncated and len(out.text) <= 100
    assert "chars truncated" in out.text
    if side == "right":
        assert out.text.startswith("0123456789")
    elif side == "left":
        assert out.text.endswith("0123456789")
    else:
        assert out.text.startswith("0123") and out.text.endswith("6789")
    dropped = int(out.text.split("...(")[1].split(" chars")[0])
    kept = len(out.text) - len(f"...({dropped} chars truncated)...")
    assert kept + dropped == len(text)


def test_truncate_leaves_short_text_alone() -> None:
    assert truncate("abc", 10) == ("abc", False)
    assert truncate("abcdefghij", 5, "left") == ("fghij", True)  # too short for the marker


def test_runner_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="max_concurrency"):
        ToolRunner([], max_concurrency=0)
    with pytest.raises(ConfigError, match="truncate_side"):
        ToolRunner([], truncate_side="top")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="two tools are named 'calculator'"):
        ToolRunner([CalculatorTool(), CalculatorTool()])
