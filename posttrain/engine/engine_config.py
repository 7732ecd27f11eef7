"""What a training engine is built from (`EngineConfig`), its dtypes, its learning-rate schedule, and the
start-up checks of what the device can do: shared by the policy/critic engine (engine.train_engine), the
reward model's (engine.reward_engine) and the workers that configure them, without importing either."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from posttrain.config.schema import LoraConfig, OptimConfig
from posttrain.data.batch import Batch
from posttrain.engine.shared_prompt import check_share_prompt
from posttrain.errors import ConfigError

# loss_fn(log_probs, entropy_or_None, micro_batch) -> (scalar loss, metrics). The loss is already
# normalised over the global mini-batch (see algorithms.aggregation), so micro-batch losses are summed.
LossFn = Callable[[torch.Tensor, torch.Tensor | None, Batch], tuple[torch.Tensor, dict[str, float]]]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    trainable: bool = True  # False: a frozen model (reference policy), no optimizer
    head: str = "lm"  # lm: causal LM (log-probs) | value: one-output token head (critic values)
    optim: OptimConfig = field(default_factory=OptimConfig)  # AdamW and its schedule (trainable engines)
    total_steps: int = 0  # optimizer steps of the run; the cosine schedule needs it
    micro_batch_size: int = 64  # rows per forward/backward on this rank (when max_token_len is 0)
    max_token_len: int = 0  # token budget per micro-batch on this rank (real tokens); 0 = by row count
    remove_padding: bool = True  # pack sequences: no compute on padding (see engine.packing)
    pack_row_tokens: int = 256  # tokens per packed row (sdpa attends per sequence: varlen_attention)
    share_prompt: bool = True  # packed rows with the same prompt run it once (see engine.shared_prompt)
    compute_dtype: str = ""  # mixed precision: e.g. bfloat16 compute over `dtype` master weights
    gradient_checkpointing: bool = False  # recompute activations in backward (less memory, ~1/3 more compute)
    offload: bool = False  # parameters, gradients and optimizer in CPU memory (accelerators only)
    lora: LoraConfig = field(default_factory=LoraConfig)  # rank 0 = full fine-tuning
    sequence_parallel_size: int = 1  # sp: each packed row split across sp ranks (engine.sequence_parallel)
    config_section: str = ""  # the config section of micro_batch_size (actor, critic, optim), for OOM errors
    token_budget_key: bool = (
        True  # OOM advice may name <section>.max_token_len_per_worker (not DPO/RM/distill)
    )
    rows_per_unit: int = (
        1  # engine rows per configured micro-batch unit (2: DPO/RM count pairs), for OOM errors
    )
    # mixture of experts: weight of the router's load-balancing loss in forward_backward (engine.moe);
    # None = the model config's router_aux_loss_coef (0 for a dense model), 0 = off
    router_aux_loss_coef: float | None = None
    vision_tower: str = "auto"  # auto | frozen | trained (models.vl.vision_tower_trained)


LR_SCHEDULES = ("constant", "cosine")


def lr_factor(optim: OptimConfig, total_steps: int) -> Callable[[int], float]:
    """The learning-rate multiplier per optimizer step: linear warm-up, then constant or cosine decay."""
    if optim.lr_schedule not in LR_SCHEDULES:
        raise ConfigError(f"lr_schedule '{optim.lr_schedule}' unknown; valid: {', '.join(LR_SCHEDULES)}")
    if optim.lr_schedule == "cosine" and total_steps <= optim.warmup_steps:
        raise ConfigError(
            f"the cosine schedule needs total_steps ({total_steps}) > warmup_steps ({optim.warmup_steps})"
        )
    warmup, total, floor = optim.warmup_steps, total_steps, optim.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if optim.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / (total - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def bf16_supported(device: torch.device) -> bool:
    """Native bfloat16 compute: CUDA's own check; on CPUs, oneDNN's (AVX512-BF16 / AMX)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return True


def check_device_support(config: EngineConfig, device: torch.device) -> None:
    """Reject at start what this device cannot do, naming the setting."""
    if "bfloat16" in (config.dtype, config.compute_dtype):
        if not bf16_supported(device):
            setting = "model.compute_dtype" if config.compute_dtype == "bfloat16" else "model.dtype"
            raise ConfigError(f"{setting}=bfloat16 but device {device} has no bfloat16 support")
    check_share_prompt(config.share_prompt, config.remove_padding, config.attn_implementation)
    if config.offload and device.type == "cpu":
        raise ConfigError(
            "offload=true needs an accelerator: on a CPU device parameters and optimizer already live in "
            "CPU memory"
        )
