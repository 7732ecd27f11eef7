"""Generation engines behind one interface (`RolloutEngine`), chosen by `rollout.name`.

`native` is the built-in engine (continuous batching, slotted KV cache, prefix sharing); `hf` wraps
Hugging Face `generate`. A vLLM or SGLang adapter plugs in by implementing `RolloutEngine` and registering a
factory here; none ships yet (they need a GPU to test).
"""

from __future__ import annotations

from typing import Any

from posttrain.errors import ConfigError
from posttrain.rollout.base import RolloutEngine

ROLLOUT_ENGINES = ("native", "hf")


def make_rollout_engine(name: str, model_path: str, **kwargs: Any) -> RolloutEngine:
    """Build the engine `name` on the model directory `model_path` (imported only when chosen)."""
    if name == "native":
        from posttrain.rollout.native import NativeRolloutEngine

        return NativeRolloutEngine(model_path, **kwargs)
    if name == "hf":
        from posttrain.rollout.hf_engine import HFRolloutEngine

        return HFRolloutEngine(model_path, **kwargs)
    raise ConfigError(f"unknown rollout.name '{name}'; valid: {', '.join(ROLLOUT_ENGINES)}")
