"""Compose a config with Hydra (YAML defaults + command-line overrides) and turn it into frozen dataclasses.

Every key is checked against the schema: an unknown or misspelled key raises `ConfigError` naming the full
key and the closest valid one, and a value of the wrong type names the key and the expected type.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from posttrain.errors import ConfigError

T = TypeVar("T")

# Keys that moved: old full key -> new full key. An old key is refused with the new one's name.
RENAMED_KEYS: dict[str, str] = {
    **{
        f"{role}.{name}": f"{role}.optim.{name}"
        for role in ("actor", "critic")
        for name in (
            "lr",
            "betas",
            "weight_decay",
            "grad_clip",
            "warmup_steps",
            "lr_schedule",
            "min_lr_ratio",
        )
    },
}

# Keys that were replaced by a differently shaped setting: old full key -> how to say it now.
REPLACED_KEYS: dict[str, str] = {
    "actor.tis_cap": (
        "truncated importance sampling is verl's rollout correction now: set "
        "algorithm.rollout_correction.rollout_is=token and algorithm.rollout_correction.rollout_is_threshold="
        "<the cap> (rollout_is=sequence for one weight per response)"
    ),
}

YAML_DIR = Path(__file__).parent / "yaml"


def compose(config_name: str, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Compose `yaml/<config_name>.yaml` with Hydra override syntax and return a plain dict."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        with initialize_config_dir(config_dir=str(YAML_DIR), version_base=None):
            cfg = hydra_compose(config_name=config_name, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError(_hydra_message(exc, config_name)) from None
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]


def _hydra_message(exc: Exception, config_name: str) -> str:
    text = str(exc).splitlines()[0]
    if "not in struct" in str(exc) or "Could not override" in str(exc):
        return f"unknown config key in overrides for '{config_name}': {text}"
    return f"invalid configuration for '{config_name}': {text}"


def from_dict(schema: type[T], data: Mapping[str, Any], prefix: str = "") -> T:
    """Build the frozen dataclass `schema` from `data`, rejecting unknown keys and wrong types."""
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"config section '{prefix or '<root>'}' must be a mapping, got {type(data).__name__}"
        )
    fields = {f.name: f for f in dataclasses.fields(schema)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(schema)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        full_key = f"{prefix}{key}"
        check_not_renamed(full_key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
            raise ConfigError(
                f"unknown config key '{full_key}'{hint} (valid keys under '{prefix.rstrip('.') or '<root>'}': "
                f"{', '.join(sorted(fields))})"
            )
        kwargs[key] = _coerce(hints[key], value, full_key)
    return schema(**kwargs)


def check_not_renamed(key: str) -> None:
    """Refuse a key that has moved, naming where it went (a key under a moved section included), or one that
    was replaced, saying how to set it now."""
    if key in REPLACED_KEYS:
        raise ConfigError(f"config key '{key}' was removed: {REPLACED_KEYS[key]}")
    for old, new in RENAMED_KEYS.items():
        if key == old or key.startswith(f"{old}."):
            raise ConfigError(f"config key '{key}' has moved: use '{new}{key[len(old) :]}'")


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
            raise ConfigError(
                f"config key '{key}' must be one of {', '.join(map(repr, allowed))}; got {value!r}"
            )
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(typing.cast(type, tp), value or {}, prefix=f"{key}.")
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"config key '{key}' must be a mapping, got {value!r}")
        value_type = typing.get_args(tp)[1]
        return {str(k): _coerce(value_type, v, f"{key}.{k}") for k, v in value.items()}
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(members[0], value, key)
    if origin is tuple:
        if isinstance(value, str) or not isinstance(value, Sequence):
            value = [value] if value is not None and value != "" else []
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(args[0], v, f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"config key '{key}' needs {len(args)} values, got {len(value)}")
        return tuple(_coerce(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True)))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}' must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}' must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"config key '{key}' must be a number, got {value!r}")
    if tp is str:
        if value is None:
            return ""
        if isinstance(value, str | int | float) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"config key '{key}' must be a string, got {value!r}")
    return value


def to_dict(config: Any) -> dict[str, Any]:
    """A plain dict of a config dataclass (tuples as lists), for logging and checkpoints."""

    def convert(v: Any) -> Any:
        if isinstance(v, tuple | list):
            return [convert(x) for x in v]
        if isinstance(v, dict):
            return {k: convert(x) for k, x in v.items()}
        return v

    plain: dict[str, Any] = convert(dataclasses.asdict(config))
    return plain


def check_override_keys(schema: type, overrides: Sequence[str]) -> None:
    """Reject `a.b=c` overrides whose key is not in the schema before Hydra sees them (better messages)."""
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        check_not_renamed(key)
        if "=" not in override or key.startswith("hydra"):
            if "=" not in override:
                raise ConfigError(f"override '{override}' is not of the form key=value")
            continue
        node: Any = schema
        parts = key.split(".")
        for i, part in enumerate(parts):
            if typing.get_origin(node) is dict:  # any name is a key of a mapping (e.g. resources.pools.gen)
                node = typing.get_args(node)[1]
                continue
            if not dataclasses.is_dataclass(node):
                raise ConfigError(f"unknown config key '{key}': '{'.'.join(parts[:i])}' has no sub-keys")
            names = [f.name for f in dataclasses.fields(node)]
            if part not in names:
                prefix = ".".join(parts[:i])
                close = difflib.get_close_matches(part, names, n=1)
                hint = f"; did you mean '{prefix + '.' if prefix else ''}{close[0]}'?" if close else ""
                raise ConfigError(
                    f"unknown config key '{key}'{hint} (valid keys under '{prefix or '<root>'}': "
                    f"{', '.join(sorted(names))})"
                )
            node = typing.get_type_hints(node)[part]


def load_config(schema: type[T], config_name: str, overrides: Sequence[str] = ()) -> T:
    """Compose `config_name` with `overrides` and validate it into `schema`."""
    check_override_keys(schema, overrides)
    return from_dict(schema, compose(config_name, overrides))
