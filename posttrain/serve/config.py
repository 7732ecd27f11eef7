"""`posttrain serve --config FILE`: the server's Limits from a YAML or JSON file (read with OmegaConf).

The file is one mapping of Limits' fields (posttrain/serve/limits.py), e.g.

    max_lora_rank: 32
    adapters_total: 8
    tokens_per_second: 20000
    adapter_idle_seconds: 600

Fields left out keep their defaults. An unknown key, a value of the wrong type, a negative value, NaN or
infinity is a ConfigError naming the key (and, for an unknown one, the valid keys).
"""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from posttrain.errors import ConfigError
from posttrain.serve.limits import Limits


def load_limits(path: str | Path) -> Limits:
    try:
        loaded = OmegaConf.load(path)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except Exception as exc:  # noqa: BLE001 - yaml's parse errors have many types
        raise ConfigError(f"--config {path}: not YAML or JSON: {exc}") from None
    if loaded is None:
        return Limits()
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"--config {path}: expected a mapping of limit names to values")
    valid = [f.name for f in fields(Limits)]
    for key in loaded:
        if key not in valid:
            raise ConfigError(f"--config {path}: unknown key {key!r}; valid keys: {', '.join(valid)}")
    base = OmegaConf.structured(Limits)
    OmegaConf.set_readonly(base, False)
    try:
        limits = OmegaConf.to_object(OmegaConf.merge(base, loaded))
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        raise ConfigError(f"--config {path}: {key}: {str(exc).splitlines()[0]}") from None
    assert isinstance(limits, Limits)
    for name in valid:
        value = getattr(limits, name)
        if not math.isfinite(value) or value < 0:  # NaN passes `< 0`: it would switch the limit off
            raise ConfigError(f"--config {path}: {name} must be a finite number >= 0, got {value}")
    return limits
