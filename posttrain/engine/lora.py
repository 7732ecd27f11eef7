"""LoRA through peft: wrap a loaded model, merged weights for samplers, adapter/merged HF export.

Only adapter parameters train; the frozen base stays shared, and the reference policy is the same model
with the adapter disabled, so a LoRA run holds one copy of the base weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from torch import nn
from torch.distributed.tensor import DTensor

from posttrain.config.schema import LoraConfig
from posttrain.errors import ConfigError

ADAPTER = "default"
_PEFT_PREFIX = "base_model.model."


def linear_module_names(model: nn.Module) -> set[str]:
    """The last name component of every nn.Linear (what `target_modules` entries match)."""
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def fused_expert_parameters(model: nn.Module) -> set[str]:
    """The last name component of every 3-D parameter (a mixture's experts stacked in one tensor)."""
    return {name.rsplit(".", 1)[-1] for name, p in model.named_parameters() if p.dim() == 3}


def check_target_modules(model: nn.Module, lora: LoraConfig) -> None:
    """Every target must name a linear layer of this model; an error lists the ones that exist."""
    available = linear_module_names(model)
    missing = [t for t in lora.target_modules if t not in available]
    # transformers stores a mixture's routed experts as fused (experts, out, in) parameters, not nn.Linear
    fused = sorted({t for t in missing if t in fused_expert_parameters(model)})
    if fused:
        raise ConfigError(
            f"model.lora.target_modules {fused}: fused 3-D expert parameters of this mixture of experts, not "
            "linear layers; LoRA on the routed experts (peft's target_parameters) is not supported: target the "
            f"attention or shared-expert linear layers ({', '.join(sorted(available))})"
        )
    if missing or not lora.target_modules:
        raise ConfigError(
            f"model.lora.target_modules {list(missing or lora.target_modules)} "
            f"{'not found in the model' if missing else 'is empty'}; linear layers of this model: "
            f"{', '.join(sorted(available))}"
        )
    if lora.rank < 0 or lora.alpha <= 0 or not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(
            f"model.lora: rank must be >= 0, alpha > 0 and dropout in [0, 1); got rank={lora.rank}, "
            f"alpha={lora.alpha}, dropout={lora.dropout}"
        )


def peft_config(lora: LoraConfig) -> PeftLoraConfig:
    return PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )


def apply_lora(model: nn.Module, lora: LoraConfig) -> PeftModel:
    """Wrap `model` with fresh adapters (B = 0, so the output is unchanged); base weights are frozen."""
    check_target_modules(model, lora)
    return get_peft_model(model, peft_config(lora))


def hf_name(peft_name: str) -> str:
    """The name a plain HF model uses for a tensor of the peft-wrapped one."""
    name = peft_name.removeprefix(_PEFT_PREFIX)
    return name.replace(".base_layer.", ".")


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def merged_lora_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, W + scale * B @ A) for every adapted linear layer, one at a time (a collective).

    For samplers that cannot apply adapters: only these weights change during LoRA training, so they are
    all a sampler built from the base directory needs after each update.
    """
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or ADAPTER not in module.lora_A:
            continue
        base = _full(module.get_base_layer().weight)
        a = _full(module.lora_A[ADAPTER].weight)
        b = _full(module.lora_B[ADAPTER].weight)
        delta = (b.float() @ a.float()) * module.scaling[ADAPTER]
        yield f"{hf_name(name)}.weight", (base.float() + delta).to(base.dtype)


def untie_output_embeddings(model: nn.Module) -> None:
    """Give `model` an output projection of its own where it shares the input embedding's weights.

    An adapter on a tied `lm_head` changes only the output projection in training (the adapter sits on the
    head's output); merging it into the shared weight would change the embeddings too.
    """
    head = model.get_output_embeddings()
    if head is not None and head.weight is model.get_input_embeddings().weight:
        head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=head.weight.requires_grad)
        model.config.tie_word_embeddings = False


def export_peft_model(
    base_path: str | Path, lora: LoraConfig, adapter_state: dict[str, torch.Tensor], dtype: torch.dtype
) -> PeftModel:
    """A CPU peft model over the base directory holding `adapter_state` (full, unsharded tensors)."""
    from posttrain.models import load_causal_lm

    base = load_causal_lm(base_path, dtype=dtype)
    if "lm_head" in lora.target_modules:
        untie_output_embeddings(base)
    model = get_peft_model(base, peft_config(lora))
    missing, unexpected = model.load_state_dict(adapter_state, strict=False)
    adapter_missing = [k for k in missing if "lora_" in k]
    if unexpected or adapter_missing:
        raise RuntimeError(f"LoRA export: missing {adapter_missing}, unexpected {unexpected}")
    return model
