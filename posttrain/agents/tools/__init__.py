"""Tools for agents: schemas, call parsers, a bounded runner, the built-in calculator and Python sandbox.

`base.py` (ToolCall, ParsedResponse, the Tool protocol, ToolOutput, function_tool), `schema.py` (schemas
from typed functions, argument checks), `parsers.py` (tool calls from text: `hermes`), `runner.py`
(ToolRunner: concurrency bound, timeouts, truncation), `calculator.py`, `python_sandbox.py`, `config.py`
(verl's tool YAML, built-in tools by name). Imports posttrain.errors only, besides this package.
"""

from posttrain.agents.tools.base import (
    FunctionTool,
    ParsedResponse,
    Tool,
    ToolCall,
    ToolCallParser,
    ToolError,
    ToolOutput,
    function_tool,
)
from posttrain.agents.tools.calculator import CalculatorTool
from posttrain.agents.tools.config import BUILTIN_TOOLS, build_tools, load_tool_config, tools_from_config
from posttrain.agents.tools.parsers import HermesToolParser, get_parser, parser_names, register_parser
from posttrain.agents.tools.python_sandbox import PythonSandboxTool
from posttrain.agents.tools.runner import ToolRunner, truncate

__all__ = [
    "BUILTIN_TOOLS",
    "CalculatorTool",
    "FunctionTool",
    "HermesToolParser",
    "ParsedResponse",
    "PythonSandboxTool",
    "Tool",
    "ToolCall",
    "ToolCallParser",
    "ToolError",
    "ToolOutput",
    "ToolRunner",
    "build_tools",
    "function_tool",
    "get_parser",
    "load_tool_config",
    "parser_names",
    "register_parser",
    "tools_from_config",
    "truncate",
]
