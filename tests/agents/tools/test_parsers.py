"""The hermes parser on well-formed, several, malformed and partial calls; the parser registry."""

from __future__ import annotations

import pytest

from posttrain.agents.tools import HermesToolParser, ToolCall, get_parser
from posttrain.errors import ConfigError


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


def test_one_well_formed_call_and_the_text_around_it() -> None:
    text = "Let me compute.\n" + block('{"name": "calculator", "arguments": {"expression": "12*34"}}')
    parsed = HermesToolParser().parse(text)
    assert parsed.calls == [ToolCall("calculator", {"expression": "12*34"})]
    assert parsed.errors == []
    assert parsed.content == "Let me compute."


def test_several_calls_in_order() -> None:
    text = (
        block('{"name": "a", "arguments": {"x": 1}}')
        + "\n"
        + block('{"name": "b", "arguments": {"y": [1, 2]}}')
        + block('{"name": "a", "arguments": {}}')
    )
    parsed = get_parser("hermes").parse(text)
    assert [c.name for c in parsed.calls] == ["a", "b", "a"]
    assert parsed.calls[1].arguments == {"y": [1, 2]}
    assert parsed.errors == [] and parsed.content == ""


def test_no_call_is_plain_content() -> None:
    parsed = HermesToolParser().parse("The answer is 42.")
    assert (parsed.content, parsed.calls, parsed.errors) == ("The answer is 42.", [], [])


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('{"name": "calculator", "arguments": {"expression": "1+1"}', "invalid JSON"),
        ('{"arguments": {"x": 1}}', 'missing "name"'),
        ('{"name": "", "arguments": {}}', 'missing "name"'),
        ('{"name": "calculator", "arguments": [1, 2]}', '"arguments" must be a JSON object'),
        ('{"name": "calculator", "arguments": "not json"}', "not a JSON object"),
        ('["calculator", {"x": 1}]', "expected a JSON object"),
        # json raises more than JSONDecodeError: a repetition loop inside a call used to crash the step
        ("[" * 5000 + "]" * 5000, "invalid JSON (RecursionError"),
        ('{"name": "calculator", "arguments": {"x": ' + "9" * 5000 + "}}", "invalid JSON (ValueError"),
        ('{"name": "calculator", "arguments": "' + "[" * 5000 + '"}', "not a JSON object"),
    ],
)
def test_malformed_call_is_an_error_message_not_a_crash(body: str, message: str) -> None:
    good = block('{"name": "ok", "arguments": {}}')
    parsed = HermesToolParser().parse(good + block(body))
    assert parsed.calls == [ToolCall("ok", {})]  # the good call is kept
    assert len(parsed.errors) == 1
    assert parsed.errors[0].startswith("tool call 2") and message in parsed.errors[0]


def test_arguments_as_a_json_string_and_missing_arguments_are_accepted() -> None:
    parsed = HermesToolParser().parse(
        block('{"name": "f", "arguments": "{\\"x\\": 3}"}') + block('{"name": "g"}')
    )
    assert parsed.calls == [ToolCall("f", {"x": 3}), ToolCall("g", {})]
    assert parsed.errors == []


def test_partial_call_cut_off_by_the_token_budget_is_an_error() -> None:
    text = 'I will call it.\n<tool_call>\n{"name": "calculator", "argum'
    parsed = HermesToolParser().parse(text)
    assert parsed.calls == []
    assert parsed.errors == ["tool call 1: <tool_call> is not closed by </tool_call>"]
    assert parsed.content == "I will call it."  # the unfinished call is not content


def test_unclosed_call_followed_by_a_good_one() -> None:
    text = '<tool_call>{"name": "a"' + block('{"name": "b", "arguments": {}}') + " done"
    parsed = HermesToolParser().parse(text)
    assert parsed.calls == [ToolCall("b", {})]
    assert len(parsed.errors) == 1 and "tool call 1" in parsed.errors[0] and "not closed" in parsed.errors[0]
    assert parsed.content == "done"


def test_stray_closing_tag_is_an_error() -> None:
    parsed = HermesToolParser().parse('{"name": "a"}</tool_call> text')
    assert parsed.calls == [] and "without an opening" in parsed.errors[0]
    assert "</tool_call>" not in parsed.content


def test_unknown_parser_lists_the_valid_names() -> None:
    with pytest.raises(ConfigError, match="unknown tool-call parser 'qwen9'.*hermes"):
        get_parser("qwen9")
