"""Generation engines behind one interface (`RolloutEngine`), chosen by `rollout.name`.

`native` is the built-in engine (continuous batching, slotted KV cache, prefix sharing); `hf` wraps
Hugging Face `generate`. A vLLM or SGLang adapter plugs in by implementing `RolloutEngine` and registering a
factory here; none ships yet (they need a GPU to test).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from posttrain.errors import ConfigError

ROLLOUT_ENGINES = ("native", "hf")


def make_rollout_engine(name: str, model_path: str, **kwargs: Any):
    """Build the engine `name` on the model directory `model_path`."""
    factories: dict[str, Callable[..., Any]] = {}
    if name == "native":
        from posttrain.rollout.native import NativeRolloutEngine

        factories[name] = NativeRolloutEngine
    elif name == "hf":
        from posttrain.rollout.hf_engine import HFRolloutEngine

        factories[name] = HFRolloutEngine
    else:
        raise ConfigError(f"unknown rollout.name '{name}'; valid: {', '.join(ROLLOUT_ENGINES)}")
    return factories[name](model_path, **kwargs)
