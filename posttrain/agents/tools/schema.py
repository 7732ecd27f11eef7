"""JSON schemas from typed Python functions, and a model's arguments checked against them.

`function_schema(fn)` derives the OpenAI-style schema of a plain typed function: parameter types from the
annotations (int, float, str, bool, list[...], dict[str, ...], Literal[...], Optional[...]), descriptions
from a Google-style docstring (`Args:` section), parameters with defaults not required.
`check_arguments(parameters, arguments)` checks what a model sent against such a schema and returns the
arguments (ints given for floats become floats) and a list of problems, one readable line each, so that the
model can be told what was wrong. Pure functions: no tool objects here (those are in `base.py`).
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from posttrain.errors import ConfigError

_JSON_TYPES: dict[type, str] = {int: "integer", float: "number", str: "string", bool: "boolean"}
_SECTIONS = frozenset(
    ("args", "arguments", "parameters", "returns", "return", "raises", "yields", "example", "examples")
    + ("note", "notes", "see also", "attributes")
)


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(summary, {parameter: description}) from a Google-style docstring.

    The summary is the text before the first section header; parameter lines are `name: text` or
    `name (type): text` under `Args:`, with more-indented continuation lines joined to them."""
    lines = inspect.cleandoc(doc or "").splitlines()
    summary: list[str] = []
    params: dict[str, str] = {}
    section: str | None = None
    current: str | None = None
    base_indent: int | None = None
    for line in lines:
        stripped = line.strip()
        header = stripped[:-1].lower() if stripped.endswith(":") else None
        if header in _SECTIONS and not line.startswith((" ", "\t")):
            section, current, base_indent = header, None, None
            continue
        if section is None:
            summary.append(line)
            continue
        if section not in ("args", "arguments", "parameters") or not stripped:
            continue
        indent = len(line) - len(line.lstrip())
        match = re.match(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", stripped)
        if match and (base_indent is None or indent <= base_indent):
            base_indent = indent
            current = match.group(1)
            params[current] = match.group(2).strip()
        elif current is not None:
            params[current] = f"{params[current]} {stripped}".strip()
    return " ".join(" ".join(summary).split()), params


def type_schema(annotation: Any, where: str) -> dict[str, Any]:
    """The JSON schema of one annotation; `where` names the parameter in errors."""
    if annotation in _JSON_TYPES:
        return {"type": _JSON_TYPES[annotation]}
    if annotation is Any:
        return {}
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        kinds = {_JSON_TYPES.get(type(v)) for v in args}
        if None in kinds:
            raise ConfigError(f"{where}: Literal values must be int, float, str or bool, got {args!r}")
        schema: dict[str, Any] = {"enum": list(args)}
        if len(kinds) == 1:
            schema["type"] = kinds.pop()
        return schema
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        if len(members) != 1 or len(args) != 2:
            raise ConfigError(f"{where}: only Optional[X] unions are supported, got {annotation!r}")
        inner = type_schema(members[0], where)
        if "type" in inner:
            inner["type"] = [inner["type"], "null"]
        if "enum" in inner:
            inner["enum"] = [*inner["enum"], None]
        return inner
    if annotation is list or origin in (list, Sequence, typing.Sequence):
        return {"type": "array", "items": type_schema(args[0], where)} if args else {"type": "array"}
    if annotation is dict or origin in (dict, Mapping, typing.Mapping):
        if args and args[0] is not str:
            raise ConfigError(f"{where}: dict keys must be str (JSON objects), got {annotation!r}")
        return (
            {"type": "object", "additionalProperties": type_schema(args[1], where)}
            if args
            else {"type": "object"}
        )
    raise ConfigError(
        f"{where}: type {annotation!r} has no JSON schema; use int, float, str, bool, list[...], "
        "dict[str, ...], Literal[...] or Optional[...]"
    )


def function_schema(
    fn: Callable[..., Any], name: str, *, description: str | None = None, exclude: Sequence[str] = ()
) -> dict[str, Any]:
    """The OpenAI-style schema of a typed function (`exclude`: parameters the model does not fill)."""
    signature = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn)
    except (NameError, TypeError) as exc:
        raise ConfigError(f"tool {name!r}: cannot resolve the type annotations of {fn!r}: {exc}") from None
    summary, docs = parse_docstring(inspect.getdoc(fn))
    properties: dict[str, Any] = {}
    required: list[str] = []
    for pname, param in signature.parameters.items():
        where = f"tool {name!r}, parameter {pname!r}"
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise ConfigError(
                f"{where}: *args, **kwargs and positional-only parameters cannot be tool arguments"
            )
        if pname in exclude:
            continue
        if pname not in hints:
            raise ConfigError(f"{where}: has no type annotation (the schema is derived from it)")
        prop = type_schema(hints[pname], where)
        if pname in docs:
            prop["description"] = docs[pname]
        properties[pname] = prop
        if param.default is param.empty:
            required.append(pname)
    missing = [p for p in exclude if p not in signature.parameters]
    if missing:
        raise ConfigError(f"tool {name!r}: row arguments {missing} are not parameters of {fn.__name__}")
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description if description is not None else summary,
            "parameters": {"type": "object", "properties": properties, "required": required},
        },
    }


def _type_names(schema: Mapping[str, Any]) -> list[str]:
    kind = schema.get("type")
    return [] if kind is None else [kind] if isinstance(kind, str) else list(kind)


def _matches(value: Any, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "array":
        return isinstance(value, list)
    if kind == "object":
        return isinstance(value, dict)
    if kind == "null":
        return value is None
    return True


_ARTICLE = {"integer": "an integer", "number": "a number", "string": "a string", "boolean": "true or false"}
_ARTICLE |= {"array": "a list", "object": "an object", "null": "null"}


def _describe(value: Any) -> str:
    text = repr(value) if not isinstance(value, str) else f'"{value}"'
    return text if len(text) <= 40 else text[:37] + "..."


def _check_value(value: Any, schema: Mapping[str, Any], where: str, problems: list[str]) -> Any:
    kinds = _type_names(schema)
    if kinds and not any(_matches(value, k) for k in kinds):
        wanted = " or ".join(_ARTICLE.get(k, k) for k in kinds)
        problems.append(f"{where} must be {wanted}, got {_describe(value)}")
        return value
    if "enum" in schema and value not in schema["enum"]:
        allowed = ", ".join(_describe(v) for v in schema["enum"])
        problems.append(f"{where} must be one of {allowed}, got {_describe(value)}")
        return value
    if (
        isinstance(value, int)
        and not isinstance(value, bool)
        and "number" in kinds
        and "integer" not in kinds
    ):
        return float(value)
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return [_check_value(v, schema["items"], f"{where}[{i}]", problems) for i, v in enumerate(value)]
    if isinstance(value, dict) and isinstance(schema.get("additionalProperties"), Mapping):
        extra = schema["additionalProperties"]
        return {k: _check_value(v, extra, f"{where}[{k!r}]", problems) for k, v in value.items()}
    return value


def check_arguments(
    parameters: Mapping[str, Any], arguments: Mapping[str, Any]
) -> tuple[dict[str, Any], list[str]]:
    """(checked arguments, problems) for a model's `arguments` against a function's `parameters` schema.

    Missing required, unknown and wrongly typed arguments are each one problem line; an empty list means the
    arguments are valid."""
    properties: Mapping[str, Any] = parameters.get("properties", {})
    problems: list[str] = []
    checked: dict[str, Any] = {}
    for name in parameters.get("required", []):
        if name not in arguments:
            problems.append(f"missing required argument {name!r}")
    for name, value in arguments.items():
        if name not in properties:
            expected = ", ".join(properties) or "none"
            problems.append(f"unknown argument {name!r} (expected: {expected})")
            continue
        checked[name] = _check_value(value, properties[name], f"argument {name!r}", problems)
    return checked, problems
