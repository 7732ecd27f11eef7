"""Tool calls parsed from a model's text, in the chat template's format, by parser name.

`hermes` is the format of Qwen2.5/Qwen3 and Hermes templates: each call is a JSON object in its own block,

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12*34"}}
    </tool_call>

several per turn. A malformed block (bad JSON, no name, arguments not an object, a `<tool_call>` never
closed, a stray `</tool_call>`) is one error message, meant to be sent back to the model; it never raises.
Other formats register a parser class under their name:

    @register_parser("my_format")
    class MyParser: def parse(self, text: str) -> ParsedResponse: ...
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from posttrain.agents.tools.base import ParsedResponse, ToolCall, ToolCallParser
from posttrain.errors import ConfigError

_PARSERS: dict[str, Callable[[], ToolCallParser]] = {}


def register_parser(name: str) -> Callable[[Callable[[], ToolCallParser]], Callable[[], ToolCallParser]]:
    def add(factory: Callable[[], ToolCallParser]) -> Callable[[], ToolCallParser]:
        if name in _PARSERS:
            raise ConfigError(f"tool-call parser {name!r} is registered already")
        _PARSERS[name] = factory
        return factory

    return add


def parser_names() -> list[str]:
    return list(_PARSERS)


def get_parser(name: str) -> ToolCallParser:
    """A parser by name; an unknown name is an error listing the registered ones."""
    if name not in _PARSERS:
        raise ConfigError(f"unknown tool-call parser {name!r}; valid: {', '.join(parser_names())}")
    return _PARSERS[name]()


def call_from_json(body: str, index: int) -> ToolCall | str:
    """One `{"name": ..., "arguments": {...}}` object as a call, or the error message saying what is wrong.
    `arguments` may be missing (no arguments) or a JSON string holding an object (OpenAI's wire form)."""
    where = f"tool call {index}"
    try:
        obj: Any = json.loads(body)
    except json.JSONDecodeError as exc:
        return f"{where}: invalid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
    except (ValueError, RecursionError) as exc:  # an integer of >4300 digits; ~1000 nested brackets
        return f"{where}: invalid JSON ({type(exc).__name__}: {str(exc)[:200]})"
    if not isinstance(obj, dict):
        return (
            f'{where}: expected a JSON object {{"name": ..., "arguments": {{...}}}}, got {type(obj).__name__}'
        )
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return f'{where}: missing "name" (a non-empty string naming the tool)'
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):  # JSONDecodeError is a ValueError
            return f'{where} ({name}): "arguments" is a string that is not a JSON object'
    if not isinstance(arguments, dict):
        return f'{where} ({name}): "arguments" must be a JSON object, got {type(arguments).__name__}'
    return ToolCall(name=name.strip(), arguments=arguments)


@register_parser("hermes")
class HermesToolParser:
    """`<tool_call>{json}</tool_call>` blocks (Qwen2.5/Qwen3, Hermes)."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"

    def parse(self, text: str) -> ParsedResponse:
        content: list[str] = []
        calls: list[ToolCall] = []
        errors: list[str] = []
        pos, index = 0, 0
        while True:
            start = text.find(self.open_tag, pos)
            outside = text[pos:] if start < 0 else text[pos:start]
            if self.close_tag in outside:
                errors.append(f"{self.close_tag} without an opening {self.open_tag}")
                outside = outside.replace(self.close_tag, "")
            content.append(outside)
            if start < 0:
                break
            index += 1
            body_start = start + len(self.open_tag)
            end = text.find(self.close_tag, body_start)
            reopen = text.find(self.open_tag, body_start)
            if end < 0 or 0 <= reopen < end:
                # never closed: the rest (up to the next block, if any) is this call's unfinished text
                errors.append(f"tool call {index}: {self.open_tag} is not closed by {self.close_tag}")
                if reopen < 0:
                    break
                pos = reopen
                continue
            parsed = call_from_json(text[body_start:end].strip(), index)
            if isinstance(parsed, ToolCall):
                calls.append(parsed)
            else:
                errors.append(parsed)
            pos = end + len(self.close_tag)
        return ParsedResponse(content="".join(content).strip(), calls=calls, errors=errors)
