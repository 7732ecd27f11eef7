"""Tools from verl-shaped YAML: built-in, posttrain and user classes accepted; verl's classes refused with
what to use instead; unknown keys named; tool_schema renames and re-describes."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from posttrain.agents.tools import CalculatorTool, PythonSandboxTool, build_tools, load_tool_config
from posttrain.errors import ConfigError

from .sandbox_probe import needs_sandbox


class EchoTool:
    """A user's own tool class (resolved by its dotted path in the tests below)."""

    def __init__(self, *, prefix: str = "") -> None:
        self.name = "echo"
        self.prefix = prefix

    def schema(self) -> dict[str, Any]:
        props = {"text": {"type": "string", "description": "what to echo"}}
        params = {"type": "object", "properties": props, "required": ["text"]}
        return {
            "type": "function",
            "function": {"name": "echo", "description": "Echo.", "parameters": params},
        }

    async def call(self, arguments: dict[str, Any], row_kwargs: Mapping[str, Any]) -> str:
        return self.prefix + arguments["text"]


def shout(text: str) -> str:
    """Shout the text.

    Args:
        text: what to shout
    """
    return text.upper()


class NotATool:
    def __init__(self) -> None:
        pass


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tools.yaml"
    path.write_text(text)
    return path


GSM8K_STYLE = """
tools:
  - class_name: "calculator"
    config:
      type: native
      max_result_digits: 50
    tool_schema:
      type: "function"
      function:
        name: "calc"
        description: "A calculator for the arithmetic steps."
        parameters:
          type: "object"
          properties:
            expression:
              type: "string"
              description: "the arithmetic, e.g. 12*34"
          required: ["expression"]
  - class_name: posttrain.agents.tools.python_sandbox.PythonSandboxTool
    config: {timeout_s: 2, memory_mb: 256}
  - class_name: tests.agents.tools.test_config.EchoTool
    config: {prefix: ">"}
  - class_name: tests.agents.tools.test_config.shout
"""


@needs_sandbox
def test_verl_shaped_config_is_accepted(tmp_path: Path) -> None:
    tools = load_tool_config(write(tmp_path, GSM8K_STYLE))
    assert [t.name for t in tools] == ["calc", "python", "echo", "shout"]
    fn = tools[0].schema()["function"]
    assert fn["name"] == "calc" and fn["description"] == "A calculator for the arithmetic steps."
    assert fn["parameters"]["properties"]["expression"]["description"] == "the arithmetic, e.g. 12*34"
    assert asyncio.run(tools[0].call({"expression": "6*7"}, {})) == "42"
    assert isinstance(tools[1], PythonSandboxTool) and tools[1].timeout_s == 2.0
    assert asyncio.run(tools[2].call({"text": "hi"}, {})) == ">hi"
    assert asyncio.run(tools[3].call({"text": "hi"}, {})) == "HI"
    assert tools[3].schema()["function"]["description"] == "Shout the text."


@pytest.mark.parametrize(
    ("class_name", "instead"),
    [
        ("verl.tools.gsm8k_tool.Gsm8kTool", "data_source scorer"),
        ("verl.tools.sandbox_fusion_tools.SandboxFusionTool", "`python`"),
        ("verl.tools.search_tool.SearchTool", "function tool of your own"),
        ("verl.tools.some_new_tool.NewTool", "calculator, python"),
    ],
)
def test_verls_own_classes_are_refused_with_what_to_use(
    tmp_path: Path, class_name: str, instead: str
) -> None:
    path = write(tmp_path, f'tools:\n  - class_name: "{class_name}"\n    config:\n      type: native\n')
    with pytest.raises(ConfigError) as info:
        load_tool_config(path)
    message = str(info.value)
    assert "tools[0]" in message and "one of verl's tool classes" in message and instead in message


def test_verl_sandbox_fusion_config_is_refused_for_its_class_before_its_keys(tmp_path: Path) -> None:
    text = (
        "tools:\n  - class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool\n"
        "    config: {type: native, sandbox_fusion_url: 'http://x', num_workers: 10}\n"
    )
    with pytest.raises(ConfigError, match="Use instead: `python`"):
        load_tool_config(write(tmp_path, text))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "tools:\n  - class_name: calculator\n    config: {max_digits: 5}\n",
            "unknown key 'max_digits' for CalculatorTool",
        ),
        (
            "tools:\n  - class_name: python\n    config: {timeot_s: 5}\n",
            "unknown key 'timeot_s' for PythonSandboxTool",
        ),
        ("tools:\n  - class_name: calculator\n    confg: {}\n", "unknown key 'confg'; allowed: class_name"),
        ("tools:\n  - class_name: calculator\n    config: {type: mcp}\n", "'mcp' is not supported"),
        ("tools:\n  - class_name: nosuchtool\n", "neither a built-in tool (calculator, python)"),
        ("tools:\n  - class_name: no_such_pkg.mod.Tool\n", "cannot import module 'no_such_pkg.mod'"),
        ("tools:\n  - class_name: posttrain.agents.tools.calculator.Nope\n", "has no 'Nope'"),
        (
            "tools:\n  - class_name: tests.agents.tools.test_config.NotATool\n",
            "NotATool is not a posttrain tool",
        ),
        ("tools:\n  - config: {}\n", "needs a class_name"),
        (
            "tools:\n  - class_name: calculator\n    config: max_result_digits=200\n",
            "config must be a mapping",
        ),
        (
            "tools:\n  - class_name: calculator\n    tool_schema:\n      function:\n        parameters: [1]\n",
            "parameters(.properties) must be a mapping",
        ),
        ("tool:\n  - class_name: calculator\n", "expected a mapping with a `tools` list"),
        (
            "tools:\n  - class_name: calculator\n  - class_name: calculator\n",
            "two tools are named 'calculator'",
        ),
        (
            "tools:\n  - class_name: calculator\n    tool_schema:\n      function:\n        name: c\n"
            "        parameters: {properties: {expr: {type: string}}}\n",
            "parameters ['expr'] are not arguments of calculator",
        ),
    ],
)
def test_config_errors_name_the_problem(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_tool_config(write(tmp_path, text))
    assert message in str(info.value)


@needs_sandbox
def test_build_tools_by_name_and_from_a_file(tmp_path: Path) -> None:
    tools = build_tools(["calculator"], None)
    assert len(tools) == 1 and isinstance(tools[0], CalculatorTool)
    path = write(tmp_path, "tools:\n  - class_name: tests.agents.tools.test_config.EchoTool\n")
    assert [t.name for t in build_tools(["calculator", "python"], str(path))] == [
        "calculator",
        "python",
        "echo",
    ]
    with pytest.raises(ConfigError, match="unknown tool 'search'; built-in tools: calculator, python"):
        build_tools(["search"], None)
    with pytest.raises(ConfigError, match="does not exist"):
        build_tools([], str(tmp_path / "missing.yaml"))
