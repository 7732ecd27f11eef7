"""The config reference: every key of a schema with its type, default and one-line meaning.

Generated from `posttrain/config/schema.py` itself: types from the annotations, defaults from the root
config's default instance (so a section's per-command defaults, e.g. SFT's `optim.lr`, are the real ones),
meanings from the comment beside a field or the comment lines right above it (read with `tokenize`/`ast`,
inherited fields from the class that declares them). There is no second table to keep in step: a field
without a comment has an empty meaning here, and the fix is a comment in the schema.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterator
from typing import Any

from posttrain.config.schema import DistillConfig, DPOConfig, RLConfig, RMConfig, SFTConfig

# command -> (schema, the YAML its config composes from)
COMMANDS: dict[str, tuple[type, str]] = {
    "train": (RLConfig, "rl"),
    "sft": (SFTConfig, "sft"),
    "dpo": (DPOConfig, "dpo"),
    "rm": (RMConfig, "rm"),
    "distill": (DistillConfig, "distill"),
}


@dataclasses.dataclass(frozen=True)
class KeyDoc:
    key: str  # full dotted key, as given on the command line
    type: str
    default: str
    meaning: str


def schema_of(command: str) -> tuple[type, str]:
    """(schema, config name) of a config-driven command; an unknown command names the valid ones."""
    from posttrain.errors import ConfigError

    if command not in COMMANDS:
        raise ConfigError(f"unknown command {command!r}; commands with a config: {', '.join(COMMANDS)}")
    return COMMANDS[command]


@functools.cache
def field_comments(cls: type) -> dict[str, str]:
    """{field name: its comment as one line} for the fields `cls` declares itself (not inherited)."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    lines = source.splitlines()
    out: dict[str, str] = {}
    (node,) = ast.parse(source).body
    assert isinstance(node, ast.ClassDef)
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        end = stmt.end_lineno or stmt.lineno
        text = [comments[n] for n in range(stmt.lineno, end + 1) if n in comments]
        if not text:  # the comment-only lines right above the field
            above = []
            n = stmt.lineno - 1
            while n >= 1 and lines[n - 1].strip().startswith("#"):
                above.insert(0, comments[n])
                n -= 1
            text = above
        out[stmt.target.id] = " ".join(text)
    return out


def meaning(cls: type, name: str) -> str:
    """The comment of field `name` of `cls`, from the class in its MRO that declares it."""
    for klass in cls.__mro__:
        if name in getattr(klass, "__annotations__", {}):
            return field_comments(klass).get(name, "")
    return ""


def type_name(tp: Any) -> str:
    """A config type as a user writes values of it: `int`, `a | b` for a choice, `list[str]`, `float | null`."""
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return " | ".join('""' if a == "" else str(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join("null" if a is type(None) else type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list[{type_name(args[0])}]"
        return f"[{', '.join(type_name(a) for a in args)}]"
    if origin is dict:
        return f"mapping of name to {type_name(typing.get_args(tp)[1])}"
    return getattr(tp, "__name__", str(tp))


def format_value(value: Any) -> str:
    """A default as it would be written in an override (YAML flow style)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return '""' if value == "" else value
    if isinstance(value, tuple | list):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{}" if not value else str(value)
    return str(value)


def iter_keys(schema: type, instance: Any = None, prefix: str = "") -> Iterator[KeyDoc]:
    """Every leaf key of `schema` (depth first, in declaration order) with its default from `instance`
    (the schema's default instance when None). A mapping of sections (`resources.pools`) lists the keys of
    one entry under `<name>`."""
    instance = schema() if instance is None else instance
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        tp, key = hints[f.name], f"{prefix}{f.name}"
        value = getattr(instance, f.name)
        if dataclasses.is_dataclass(tp):
            yield from iter_keys(tp, value, f"{key}.")  # type: ignore[arg-type]
            continue
        value_type = typing.get_args(tp)[1] if typing.get_origin(tp) is dict else None
        if value_type is not None and dataclasses.is_dataclass(value_type):
            yield KeyDoc(key, type_name(tp), format_value(value), meaning(schema, f.name))
            yield from iter_keys(value_type, None, f"{key}.<name>.")  # type: ignore[arg-type]
            continue
        yield KeyDoc(key, type_name(tp), format_value(value), meaning(schema, f.name))


def section_docs(schema: type) -> dict[str, str]:
    """{top-level section: the first paragraph of its class docstring} (empty for undocumented ones)."""
    hints = typing.get_type_hints(schema)
    out = {}
    for f in dataclasses.fields(schema):
        tp = hints[f.name]
        doc = inspect.getdoc(tp) if dataclasses.is_dataclass(tp) else None
        generated = doc is not None and doc.startswith(f"{tp.__name__}(")  # dataclass's signature stub
        out[f.name] = "" if doc is None or generated else " ".join(doc.split("\n\n")[0].split())
    return out


def markdown(commands: list[str]) -> str:
    """The reference of `commands` as Markdown: one table per command, a heading per section."""
    parts = [
        "# Configuration reference",
        "",
        "Generated from `posttrain/config/schema.py` by `posttrain config reference` (do not edit; a test "
        "checks this file against the schema). Set a key as `key=value` on the command line "
        "(`posttrain train actor.optim.lr=1e-6`); `posttrain config show <command> [overrides]` prints the "
        "resolved config. Batch sizes count samples (prompt x response) unless their name says prompts.",
    ]
    for command in commands:
        schema, _ = schema_of(command)
        doc = " ".join((inspect.getdoc(schema) or "").split("\n\n")[0].split())
        parts += ["", f"## posttrain {command}", "", doc]
        sections = section_docs(schema)
        docs = list(iter_keys(schema))
        for section, text in sections.items():
            rows = [d for d in docs if d.key.split(".")[0] == section]
            parts += ["", f"### {section}", ""]
            if text:
                parts += [text, ""]
            parts += ["| key | type | default | meaning |", "|---|---|---|---|"]
            parts += [
                f"| `{d.key}` | {_cell(d.type)} | `{d.default}` | {_cell(d.meaning) or '-'} |" for d in rows
            ]
    return "\n".join(parts) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")
