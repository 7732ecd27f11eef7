"""Tools from a config file in verl's YAML shape, and the built-in tools by name.

    tools:
      - class_name: calculator            # or posttrain.agents.tools.calculator.CalculatorTool, my_pkg.mod.MyTool
        config: {type: native, max_result_digits: 200}
        tool_schema:                      # optional: renames the tool, replaces its descriptions
          type: function
          function: {name: calc, description: "...", parameters: {properties: {expression: {description: "..."}}}}

`class_name` must resolve to a posttrain tool: a built-in short name, or a dotted path to a class (made with
`config` as keyword arguments), a Tool instance or a plain typed function (made into a FunctionTool). verl's
own classes (`verl.tools.*`) are refused with the posttrain tool to use instead. `config` keys the tool does
not take are errors naming the key; verl's `type: native` is accepted and ignored.
"""

from __future__ import annotations

import copy
import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from posttrain.agents.tools.base import FunctionTool, Tool
from posttrain.agents.tools.calculator import CalculatorTool
from posttrain.agents.tools.python_sandbox import PythonSandboxTool
from posttrain.errors import ConfigError

BUILTIN_TOOLS: dict[str, Callable[..., Tool]] = {"calculator": CalculatorTool, "python": PythonSandboxTool}

# verl's tool classes -> what to use in posttrain
_VERL_REPLACEMENTS = {
    "gsm8k_tool": "score the final answer with the row's data_source scorer (reward_model.ground_truth) and "
    "give the model `calculator` for the arithmetic",
    "geo3k_tool": "score the final answer with the row's data_source scorer (reward_model.ground_truth)",
    "sandbox_fusion_tools": "`python` (posttrain's local sandbox: a subprocess without network)",
    "search_tool": "a function tool of your own calling your retriever (posttrain.agents.tools.function_tool)",
    "mcp_search_tool": "a function tool of your own (posttrain.agents.tools.function_tool); MCP is not supported",
    "mcp_base_tool": "a function tool of your own (posttrain.agents.tools.function_tool); MCP is not supported",
    "image_zoom_in_tool": "a function tool of your own (posttrain.agents.tools.function_tool)",
}
_ENTRY_KEYS = ("class_name", "config", "tool_schema")


def refuse_verl(class_name: str, where: str) -> None:
    """ConfigError for one of verl's own tool classes, saying what to use instead."""
    parts = class_name.split(".")
    module = parts[2] if len(parts) > 2 else ""
    instead = _VERL_REPLACEMENTS.get(
        module, f"one of posttrain's tools ({', '.join(BUILTIN_TOOLS)}) or a function tool of your own"
    )
    raise ConfigError(
        f"{where}: {class_name} is one of verl's tool classes; posttrain does not run verl's tools. "
        f"Use instead: {instead}. class_name may be a built-in name ({', '.join(BUILTIN_TOOLS)}) or the "
        "dotted path of a posttrain Tool class or typed function."
    )


def resolve_class(class_name: str, where: str) -> Any:
    """What a `class_name` names: a built-in tool class, or the object at a dotted `module.attr` path."""
    if class_name in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[class_name]
    if class_name == "verl" or class_name.startswith("verl."):
        refuse_verl(class_name, where)
    module_name, _, attr = class_name.rpartition(".")
    if not module_name:
        raise ConfigError(
            f"{where}: class_name {class_name!r} is neither a built-in tool ({', '.join(BUILTIN_TOOLS)}) nor a "
            "dotted path module.Class"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{where}: cannot import module {module_name!r} of class_name {class_name!r}: {exc}"
        ) from None
    if not hasattr(module, attr):
        raise ConfigError(f"{where}: module {module_name!r} has no {attr!r} (class_name {class_name!r})")
    return getattr(module, attr)


def make_tool(target: Any, config: Mapping[str, Any], where: str) -> Tool:
    """A Tool from what class_name resolved to, with `config` as the class's keyword arguments."""
    if isinstance(target, Tool) and not inspect.isclass(target):
        if config:
            raise ConfigError(f"{where}: config {sorted(config)} given for a tool instance, which takes none")
        return target
    if inspect.isclass(target):
        params = inspect.signature(target).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        allowed = [n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
        for key in config:
            if key not in allowed and not takes_any:
                raise ConfigError(
                    f"{where}.config: unknown key {key!r} for {target.__name__}; allowed: {', '.join(allowed) or 'none'}"
                )
        try:
            tool = target(**config)
        except TypeError as exc:
            raise ConfigError(f"{where}.config: {target.__name__}: {exc}") from None
        if not isinstance(tool, Tool):
            raise ConfigError(
                f"{where}: {target.__name__} is not a posttrain tool (it needs `name`, `schema()` and an async "
                "`call(arguments, row_kwargs)`; see posttrain.agents.tools.base.Tool)"
            )
        return tool
    if callable(target):
        if config:
            raise ConfigError(f"{where}: config {sorted(config)} given for a function tool, which takes none")
        return FunctionTool(target)
    raise ConfigError(f"{where}: {target!r} is not a tool class, tool instance or function")


class SchemaOverride:
    """A tool shown to the model under another name and/or with other descriptions (verl's `tool_schema`)."""

    def __init__(self, tool: Tool, tool_schema: Mapping[str, Any], where: str) -> None:
        self.tool = tool
        function = tool_schema.get("function", tool_schema)
        if not isinstance(function, Mapping):
            raise ConfigError(f"{where}.tool_schema.function must be a mapping")
        schema = tool.schema()
        own = schema["function"]
        self.name = str(function.get("name") or tool.name)
        own["name"] = self.name
        if function.get("description"):
            own["description"] = str(function["description"])
        parameters = function.get("parameters") or {}
        given = parameters.get("properties") or {} if isinstance(parameters, Mapping) else None
        if not isinstance(given, Mapping):
            raise ConfigError(f"{where}.tool_schema.function.parameters(.properties) must be a mapping")
        known = own.get("parameters", {}).get("properties", {})
        unknown = [p for p in given if p not in known]
        if unknown:
            raise ConfigError(
                f"{where}.tool_schema: parameters {unknown} are not arguments of {tool.name} "
                f"(its arguments: {', '.join(known) or 'none'})"
            )
        for pname, spec in given.items():
            if isinstance(spec, Mapping) and spec.get("description"):
                known[pname]["description"] = str(spec["description"])
        self._schema = schema

    def schema(self) -> dict[str, Any]:
        return copy.deepcopy(self._schema)

    async def call(self, arguments: dict[str, Any], row_kwargs: Mapping[str, Any]) -> str:
        return await self.tool.call(arguments, row_kwargs)

    async def close(self) -> None:
        closer = getattr(self.tool, "close", None)
        if closer is not None:
            result = closer()
            if inspect.isawaitable(result):
                await result


def tools_from_config(data: Any, source: str = "tool config") -> list[Tool]:
    """Tools from a parsed tool config (`{"tools": [...]}` in verl's shape)."""
    if not isinstance(data, Mapping) or not isinstance(data.get("tools"), list):
        raise ConfigError(f"{source}: expected a mapping with a `tools` list (verl's tool config shape)")
    extra = [k for k in data if k != "tools"]
    if extra:
        raise ConfigError(f"{source}: unknown top-level key {extra[0]!r}; allowed: tools")
    tools: list[Tool] = []
    for i, entry in enumerate(data["tools"]):
        where = f"{source}: tools[{i}]"
        if not isinstance(entry, Mapping) or not isinstance(entry.get("class_name"), str):
            raise ConfigError(f"{where}: each tool needs a class_name (string)")
        for key in entry:
            if key not in _ENTRY_KEYS:
                raise ConfigError(f"{where}: unknown key {key!r}; allowed: {', '.join(_ENTRY_KEYS)}")
        if not isinstance(entry.get("config") or {}, Mapping):
            raise ConfigError(f"{where}.config must be a mapping of the tool's keyword arguments")
        config = dict(entry.get("config") or {})
        kind = config.pop("type", "native")
        if kind != "native":
            raise ConfigError(f"{where}.config.type: {kind!r} is not supported; posttrain tools are `native`")
        tool = make_tool(resolve_class(entry["class_name"], where), config, where)
        if entry.get("tool_schema"):
            if not isinstance(entry["tool_schema"], Mapping):
                raise ConfigError(f"{where}.tool_schema must be a mapping")
            tool = SchemaOverride(tool, entry["tool_schema"], where)
        tools.append(tool)
    _check_unique(tools, source)
    return tools


def load_tool_config(path: str | Path) -> list[Tool]:
    """Tools from a YAML file in verl's tool config shape."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"tool config {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"tool config {str(path)!r} is not valid YAML: {exc}") from None
    return tools_from_config(data, str(path))


def build_tools(names: Sequence[str], config_path: str | None = None) -> list[Tool]:
    """The built-in tools named (default settings) and those of a tool config file, names unique."""
    tools: list[Tool] = []
    for name in names:
        if name not in BUILTIN_TOOLS:
            raise ConfigError(f"unknown tool {name!r}; built-in tools: {', '.join(BUILTIN_TOOLS)}")
        tools.append(BUILTIN_TOOLS[name]())
    if config_path:
        tools.extend(load_tool_config(config_path))
    _check_unique(tools, "tools")
    return tools


def _check_unique(tools: Sequence[Tool], source: str) -> None:
    seen: set[str] = set()
    for tool in tools:
        if tool.name in seen:
            raise ConfigError(f"{source}: two tools are named {tool.name!r}")
        seen.add(tool.name)
