"""Refusing settings that would take no effect: a key set while the switch that uses it is off.

A key that a run silently ignores is a bug of the worst kind: the run goes on, config.json records the value,
and nothing says it did nothing (`critic.optim.lr` while `critic.enable=false`, `algorithm.kl_coef` while the
KL is in the loss, `ray.address` with the in-process backend). The commands' start-up checks call
`refuse_unused` for each section or field that only a switch brings into play. A field counts as set when it
differs from the schema's default; the YAML defaults are the same values (tests/config check both agree), so
a config that only restates defaults is never refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from posttrain.errors import ConfigError


def changed_keys(
    section: Any,
    key: str,
    fields: Iterable[str] | None = None,
    besides: Iterable[str] = (),
    default: Any = None,
) -> list[str]:
    """`key.field=value` for each field of the dataclass `section` (all of them, or `fields`, minus
    `besides`) whose value differs from `default` (the section type's own defaults unless a command's schema
    gives the section others); nested sections are compared field by field."""
    default = type(section)() if default is None else default
    names = [f.name for f in dataclasses.fields(section)] if fields is None else list(fields)
    skip = set(besides)
    changed = []
    for name in names:
        if name in skip:
            continue
        value, default_value = getattr(section, name), getattr(default, name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            changed += changed_keys(value, f"{key}.{name}", default=default_value)
        elif value != default_value:
            changed.append(f"{key}.{name}={_show(value)}")
    return changed


def refuse_unused(
    section: Any,
    key: str,
    because: str,
    *,
    fields: Iterable[str] | None = None,
    besides: Iterable[str] = (),
    default: Any = None,
) -> None:
    """Raise ConfigError naming every set field of `section` (see `changed_keys`) and why none would be used:
    `because` says which switch is off, e.g. "critic.enable=false"."""
    refuse_changed(changed_keys(section, key, fields, besides, default), because)


def refuse_changed(changed: list[str], because: str) -> None:
    """The error of `refuse_unused` for keys already found."""
    if changed:
        verb = "is" if len(changed) == 1 else "are"
        raise ConfigError(
            f"{', '.join(changed)} {verb} set, but {because}: {'it' if len(changed) == 1 else 'they'} would "
            "be ignored (turn the feature on, or leave the setting out)"
        )


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value) if not isinstance(value, str) else (value or "''")
