"""What tools are: the calls a parser finds in a model's text, the `Tool` protocol, what a call returns.

    @function_tool
    def add(a: int, b: int) -> int:
        '''Add two integers.

        Args:
            a: the first summand
            b: the second summand
        '''
        return a + b

A tool has a name, an OpenAI-style JSON schema (shown to the model through the chat template's `tools`) and
an async `call(arguments, row_kwargs)`; it raises `ToolError` (or any exception) when the call fails, and the
runner (`runner.py`) turns that into an error message for the model. `row_kwargs` are the dataset row's
`extra_info.tools_kwargs[tool name]` (verl's convention: e.g. `{"create_kwargs": {"ground_truth": ...}}`).
Imports only posttrain.errors and this package.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from posttrain.agents.tools.schema import check_arguments, function_schema
from posttrain.errors import PosttrainError


class ToolError(PosttrainError):
    """A tool call failed in a way the model should be told about (its message goes back as the tool
    message, prefixed with "Error: ")."""


class ToolFailed(ToolError):
    """A call that ran and failed: a program that exited with an error or was killed at its limits. `text`
    goes back to the model as it is (the program's output and why it ended); the call counts as failed (no
    tool-use bonus, `tool_errors`), and as timed out when `timed_out` (`agent.end_on_tool_timeout`)."""

    def __init__(self, text: str, timed_out: bool = False) -> None:
        super().__init__(text)
        self.text, self.timed_out = text, timed_out


@dataclass(frozen=True)
class ToolCall:
    """One well-formed call parsed from the model's text."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedResponse:
    """What a parser makes of one assistant turn: the text outside the tool-call blocks, the well-formed
    calls in order, and one readable message per malformed call."""

    content: str
    calls: list[ToolCall]
    errors: list[str]


class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedResponse: ...


@runtime_checkable
class Tool(Protocol):
    name: str

    def schema(self) -> dict[str, Any]:
        """OpenAI style: {"type": "function", "function": {"name", "description", "parameters"}}."""
        ...

    async def call(self, arguments: dict[str, Any], row_kwargs: Mapping[str, Any]) -> str:
        """The tool's answer as text; raises ToolError (or any exception) on failure."""
        ...


@dataclass(frozen=True)
class ToolOutput:
    """One call's result as the runner returns it. `text` goes back to the model as the tool message
    (already truncated); `ok` is False for an unknown tool, invalid arguments, an exception or a timeout."""

    text: str
    ok: bool
    timed_out: bool = False
    seconds: float = 0.0
    truncated: bool = False


def result_text(result: Any) -> str:
    """A tool function's return value as the text the model reads (JSON for structures)."""
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(result)


def row_value(row_kwargs: Mapping[str, Any], key: str) -> tuple[bool, Any]:
    """(found, value) of `key` in a row's tool kwargs: at the top level or in verl's `create_kwargs` /
    `execute_kwargs`."""
    if key in row_kwargs:
        return True, row_kwargs[key]
    for section in ("create_kwargs", "execute_kwargs"):
        inner = row_kwargs.get(section)
        if isinstance(inner, Mapping) and key in inner:
            return True, inner[key]
    return False, None


async def run_in_thread(fn: Callable[..., Any], kwargs: Mapping[str, Any], name: str) -> Any:
    """`fn(**kwargs)` in a daemon thread of its own, awaited without blocking the event loop.

    Not the loop's default executor: a hung function would keep one of its few workers forever and, after a
    few timeouts, stall every later call. Python cannot kill a thread, so a hung function's thread keeps
    running after the runner's timeout (the caller is answered; the thread is leaked, as a daemon)."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)

    def target() -> None:
        try:
            value, error = fn(**kwargs), None
        except BaseException as exc:  # handed to the awaiting coroutine
            value, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the loop closed while the function ran: nobody is waiting
            pass

    threading.Thread(target=target, name=f"tool-{name}", daemon=True).start()
    return await future


class FunctionTool:
    """A plain typed Python function (sync or async) as a `Tool`.

    The schema comes from the signature and docstring (`schema.py`); arguments are checked against it
    before the call. `row_args` are parameters filled from the row's tool kwargs instead of by the model
    (left out of the schema), e.g. a ground truth. Sync functions run in a thread of their own so that a slow
    one never blocks the event loop (`run_in_thread`)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        row_args: Sequence[str] = (),
    ) -> None:
        self.fn = fn
        self.name = name or fn.__name__
        self.row_args = tuple(row_args)
        self._schema = function_schema(fn, self.name, description=description, exclude=self.row_args)
        self._defaults = {
            p.name: p.default for p in inspect.signature(fn).parameters.values() if p.default is not p.empty
        }
        self._is_async = inspect.iscoroutinefunction(fn)

    def schema(self) -> dict[str, Any]:
        return copy.deepcopy(self._schema)

    async def call(self, arguments: dict[str, Any], row_kwargs: Mapping[str, Any]) -> str:
        if not isinstance(arguments, Mapping):
            raise ToolError(f"invalid arguments for {self.name}: expected a JSON object")
        kwargs, problems = check_arguments(self._schema["function"]["parameters"], arguments)
        if problems:
            raise ToolError(f"invalid arguments for {self.name}: " + "; ".join(problems))
        for key in self.row_args:
            found, value = row_value(row_kwargs, key)
            if found:
                kwargs[key] = value
            elif key not in self._defaults:
                raise ToolError(
                    f"{self.name} needs {key!r} from the row's extra_info.tools_kwargs; it has none"
                )
        if self._is_async:
            result = await self.fn(**kwargs)
        else:
            result = await run_in_thread(self.fn, kwargs, self.name)
        return result_text(result)

    def __repr__(self) -> str:
        return f"FunctionTool({self.name!r})"


def function_tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    row_args: Sequence[str] = (),
) -> Any:
    """`@function_tool`, `@function_tool(name="add")` or `function_tool(fn)`: a typed function as a Tool."""
    if fn is None:
        return lambda f: FunctionTool(f, name=name, description=description, row_args=row_args)
    return FunctionTool(fn, name=name, description=description, row_args=row_args)
