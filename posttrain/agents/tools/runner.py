"""Tool calls run beside generation: bounded, timed out, never raising, answers truncated.

    runner = ToolRunner([CalculatorTool(), PythonSandboxTool()], max_concurrency=2, timeout_s=10)
    output = await runner.run(call, tools_kwargs.get(call.name, {}))   # one call, with its tool's row kwargs
    outputs = await runner.run_all(parsed.calls, tools_kwargs)        # a turn's calls (tool name -> kwargs)

Every failure (unknown tool, invalid arguments, an exception, a timeout) becomes a `ToolOutput` with
`ok=False` and a message for the model; a hung tool is abandoned after `timeout_s` while the other calls
and episodes go on. At most `max_concurrency` calls run at once across all episodes sharing the runner.

Sharing the CPU with generation: on a 2-core machine generation (the rollout engine's torch threads) needs
the cores most of the time; a tool call is mostly waiting (I/O, a subprocess starting) but the Python tool
is a process that may spin a core for its whole time limit. `max_concurrency` is therefore the number of
cores tools may take from generation at worst: the default 2 lets two calls overlap, 1 keeps a core for
generation. The Python sandbox also runs its code at a lower priority (`nice`), so generation wins a
contended core.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from posttrain.agents.tools.base import Tool, ToolCall, ToolError, ToolFailed, ToolOutput
from posttrain.errors import ConfigError

TruncateSide = Literal["left", "right", "middle"]


def truncate(text: str, max_chars: int, side: TruncateSide = "right") -> tuple[str, bool]:
    """(text of at most `max_chars` characters, whether it was cut). `right` keeps the beginning, `left` the
    end, `middle` both ends; a marker says how many characters were dropped."""
    if len(text) <= max_chars:
        return text, False
    dropped = len(text) - max_chars
    for _ in range(3):  # the marker's length depends on the count it shows
        marker = f"...({dropped} chars truncated)..."
        keep = max_chars - len(marker)
        if keep <= 0:
            return (text[-max_chars:] if side == "left" else text[:max_chars]), True
        if len(text) - keep == dropped:
            break
        dropped = len(text) - keep
    if side == "right":
        return text[:keep] + marker, True
    if side == "left":
        return marker + text[len(text) - keep :], True
    head = keep - keep // 2
    return text[:head] + marker + text[len(text) - (keep - head) :], True


class ToolRunner:
    """Runs parsed calls on a set of tools (by name), at most `max_concurrency` at once, each bounded by
    `timeout_s`; answers longer than `max_response_chars` are cut on `truncate_side`."""

    def __init__(
        self,
        tools: Sequence[Tool],
        *,
        max_concurrency: int = 2,
        timeout_s: float = 10.0,
        max_response_chars: int = 1024,
        truncate_side: TruncateSide = "right",
    ) -> None:
        if max_concurrency < 1:
            raise ConfigError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s must be > 0, got {timeout_s}")
        if max_response_chars < 1:
            raise ConfigError(f"max_response_chars must be >= 1, got {max_response_chars}")
        if truncate_side not in ("left", "right", "middle"):
            raise ConfigError(f"truncate_side must be one of left, right, middle; got {truncate_side!r}")
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            if tool.name in self.tools:
                raise ConfigError(f"two tools are named {tool.name!r}")
            self.tools[tool.name] = tool
        self.max_concurrency = max_concurrency
        self.timeout_s = timeout_s
        self.max_response_chars = max_response_chars
        self.truncate_side: TruncateSide = truncate_side
        self._semaphore: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def schemas(self) -> list[dict[str, Any]]:
        """The tools' schemas, for the chat template's `tools`."""
        return [tool.schema() for tool in self.tools.values()]

    def _slots(self) -> asyncio.Semaphore:
        # made in the running loop (a runner may outlive one asyncio.run and be used by the next)
        loop = asyncio.get_running_loop()
        if self._semaphore is None or self._loop is not loop:
            self._semaphore, self._loop = asyncio.Semaphore(self.max_concurrency), loop
        return self._semaphore

    def _output(self, text: str, ok: bool, seconds: float = 0.0, timed_out: bool = False) -> ToolOutput:
        text, cut = truncate(text, self.max_response_chars, self.truncate_side)
        return ToolOutput(text=text, ok=ok, timed_out=timed_out, seconds=seconds, truncated=cut)

    async def run(self, call: ToolCall, row_kwargs: Mapping[str, Any] | None = None) -> ToolOutput:
        """One call. `row_kwargs` are this tool's kwargs from the row (`extra_info.tools_kwargs[call.name]`,
        {} when absent), passed to the tool as they are. Never raises for a tool's failure."""
        tool = self.tools.get(call.name)
        if tool is None:
            known = ", ".join(self.tools) or "none"
            return self._output(f"Error: unknown tool {call.name!r}; available tools: {known}", ok=False)
        async with self._slots():
            start = time.monotonic()
            try:
                text = await asyncio.wait_for(
                    tool.call(dict(call.arguments), row_kwargs or {}), self.timeout_s
                )
                ok, timed_out = True, False
                if not isinstance(text, str):
                    text, ok = f"Error: tool {call.name!r} returned {type(text).__name__}, not text", False
            except TimeoutError:
                text, ok, timed_out = f"Error: {call.name} timed out after {self.timeout_s:g} s", False, True
            except ToolFailed as exc:  # ran and failed: its own output, not an "Error:" line
                text, ok, timed_out = exc.text, False, exc.timed_out
            except ToolError as exc:
                text, ok, timed_out = f"Error: {exc}", False, False
            except Exception as exc:  # a tool's bug is the model's error message, not the batch's crash
                text, ok, timed_out = f"Error: {call.name} failed: {type(exc).__name__}: {exc}", False, False
            seconds = time.monotonic() - start
        return self._output(text, ok, seconds, timed_out)

    async def run_all(
        self, calls: Sequence[ToolCall], tools_kwargs: Mapping[str, Mapping[str, Any]] | None = None
    ) -> list[ToolOutput]:
        """The calls of one turn, concurrently (within the runner's bound), answers in the calls' order.
        `tools_kwargs` is the row's whole `extra_info.tools_kwargs` (tool name -> kwargs): each call gets its
        own tool's entry."""
        kwargs = tools_kwargs or {}
        return list(await asyncio.gather(*(self.run(call, kwargs.get(call.name)) for call in calls)))

    async def close(self) -> None:
        """Closes the tools that hold resources (those with a `close` method, sync or async)."""
        for tool in self.tools.values():
            closer = getattr(tool, "close", None)
            if closer is not None:
                result = closer()
                if inspect.isawaitable(result):
                    await result
