"""LoRA through peft: wrap a loaded model, merged weights for samplers, adapter/merged HF export.

Only adapter parameters train; the frozen base stays shared, and the reference policy is the same model
with the adapter disabled, so a LoRA run holds one copy of the base weights.

Linear layers are adapted by module name (`target_modules`). A mixture's routed experts are not linear layers:
transformers stores each layer's experts as fused 3-D parameters (experts, out, in), so they are adapted with
peft's parameter targeting (`target_parameters`, peft's `ParamWrapper`): one low-rank pair per expert, folded
into the fused tensor for the forward. `model.lora.target_parameters` names them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from peft.tuners.lora.layer import ParamWrapper
from torch import nn
from torch.distributed.tensor import DTensor

from posttrain.config.schema import LoraConfig
from posttrain.engine.distributed import broadcast_from_rank0
from posttrain.errors import ConfigError
from posttrain.models.vl import vision_tower

ADAPTER = "default"
_PEFT_PREFIX = "base_model.model."


def vision_tower_linears(model: nn.Module) -> list[str]:
    """Full module names of the linear layers inside a vision-language model's vision tower ([] for a text
    model). LoRA adapts the language model only: Qwen2.5-VL's tower has `gate_proj`/`up_proj`/`down_proj` MLPs,
    which the default `target_modules` would otherwise match and adapt (and train, even with the tower frozen)."""
    tower = vision_tower(model)
    if tower is None:
        return []
    prefix = next(name for name, m in model.named_modules() if m is tower)
    return [f"{prefix}.{n}" for n, m in tower.named_modules() if isinstance(m, nn.Linear)]


def linear_module_names(model: nn.Module) -> set[str]:
    """The last name component of every nn.Linear outside a vision tower (what `target_modules` entries
    match)."""
    tower = set(vision_tower_linears(model))
    return {
        name.rsplit(".", 1)[-1]
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name not in tower
    }


def fused_expert_parameters(model: nn.Module) -> set[str]:
    """The last name component of every 3-D parameter (a mixture's experts stacked in one tensor)."""
    return {name.rsplit(".", 1)[-1] for name, p in model.named_parameters() if p.dim() == 3}


def _matches(name: str, target: str) -> bool:
    """peft's rule for `target_parameters`: the full name, or a suffix after a dot."""
    return name == target or name.endswith(f".{target}")


def check_target_modules(model: nn.Module, lora: LoraConfig) -> None:
    """Every `target_modules` entry must name a linear layer of this model and every `target_parameters` entry a
    fused 3-D expert parameter; an error lists the ones that exist."""
    available = linear_module_names(model)
    fused_names = fused_expert_parameters(model)
    missing = [t for t in lora.target_modules if t not in available]
    # transformers stores a mixture's routed experts as fused (experts, out, in) parameters, not nn.Linear
    fused = sorted({t for t in missing if t in fused_names})
    if fused:
        raise ConfigError(
            f"model.lora.target_modules {fused}: fused 3-D expert parameters of this mixture of experts, not "
            f"linear layers; name them in model.lora.target_parameters instead (linear layers: "
            f"{', '.join(sorted(available))})"
        )
    if missing or not (lora.target_modules or lora.target_parameters):
        raise ConfigError(
            f"model.lora.target_modules {list(missing or lora.target_modules)} "
            f"{'not found in the model' if missing else 'is empty'}; linear layers of this model: "
            f"{', '.join(sorted(available))}"
            + (
                " (the language model's; LoRA never adapts the vision tower)"
                if vision_tower_linears(model)
                else ""
            )
        )
    check_target_parameters(model, lora)
    if lora.rank < 0 or lora.alpha <= 0 or not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(
            f"model.lora: rank must be >= 0, alpha > 0 and dropout in [0, 1); got rank={lora.rank}, "
            f"alpha={lora.alpha}, dropout={lora.dropout}"
        )


def check_target_parameters(model: nn.Module, lora: LoraConfig) -> None:
    """`target_parameters` entries must each match a fused 3-D expert parameter (peft would also wrap a 2-D one,
    but linear weights belong in `target_modules`); peft's parameter LoRA takes no dropout."""
    if not lora.target_parameters:
        return
    fused = [name for name, p in model.named_parameters() if p.dim() == 3]
    valid = ", ".join(sorted(fused_expert_parameters(model))) or "none: this model has no fused experts"
    unknown = [t for t in lora.target_parameters if not any(_matches(name, t) for name in fused)]
    if unknown:
        raise ConfigError(
            f"model.lora.target_parameters {unknown} match no fused 3-D expert parameter of this model; "
            f"valid (by name, or a dotted suffix such as experts.<name>): {valid}"
        )
    if lora.dropout > 0:
        raise ConfigError(
            f"model.lora.dropout={lora.dropout} with model.lora.target_parameters: peft's parameter LoRA cannot "
            "apply dropout (the delta is folded into the expert weights); set model.lora.dropout=0"
        )


def peft_config(lora: LoraConfig, model: nn.Module | None = None) -> PeftLoraConfig:
    """peft's config of `lora`; given the model, its vision tower's linear layers are excluded by name."""
    excluded = vision_tower_linears(model) if model is not None else []
    return PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        target_parameters=list(lora.target_parameters) or None,
        exclude_modules=excluded or None,
        bias="none",
        task_type="CAUSAL_LM",
    )


def apply_lora(model: nn.Module, lora: LoraConfig) -> PeftModel:
    """Wrap `model` with fresh adapters (B = 0, so the output is unchanged); base weights are frozen."""
    check_target_modules(model, lora)
    return get_peft_model(model, peft_config(lora, model))


def same_adapters_on_every_rank(model: nn.Module) -> None:
    """Rank 0's fresh adapter weights on every rank (engine.distributed.broadcast_from_rank0): each rank
    initialises its adapters from its own seed, so without this a run's result would depend on its world
    size. After it, the adapters of an n-rank run are those of a one-rank run with rank 0's seed."""
    broadcast_from_rank0(p for p in model.parameters() if p.requires_grad)  # the frozen base: same files


def hf_name(peft_name: str) -> str:
    """The name a plain HF model uses for a tensor of the peft-wrapped one."""
    parts = peft_name.removeprefix(_PEFT_PREFIX).split(".")
    # nested ParamWrappers (several parameters of one experts module) stack `base_layer`s
    return ".".join(p for p in parts if p != "base_layer")


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@torch.no_grad()
def merged_lora_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, W + scale * B @ A) for every adapted linear layer and fused expert parameter, one at a time
    (a collective).

    For samplers that cannot apply adapters: only these weights change during LoRA training, so they are
    all a sampler built from the base directory needs after each update.
    """
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer) or ADAPTER not in module.lora_A:
            continue
        a = _full(module.lora_A[ADAPTER].weight).float()
        b = _full(module.lora_B[ADAPTER].weight).float()
        if isinstance(module, ParamWrapper):
            base = _full(getattr(module.get_base_layer(), module.parameter_name))
            delta = expert_delta(module, a, b)
            yield f"{hf_name(name)}.{module.parameter_name}", (base.float() + delta).to(base.dtype)
            continue
        base = _full(module.get_base_layer().weight)
        delta = (b @ a) * module.scaling[ADAPTER]
        yield f"{hf_name(name)}.weight", (base.float() + delta).to(base.dtype)


def expert_delta(module: ParamWrapper, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The (experts, ., .) delta of a fused expert parameter from its full A (r*E, in) and B (out, r*E), laid
    out as peft's `ParamWrapper.get_delta_weight` lays it (expert e uses rows e*r..e*r+r of A)."""
    experts = module.num_experts
    a = a.reshape(experts, -1, a.shape[-1])  # (E, r, in)
    b = b.reshape(b.shape[0], -1, experts)  # (out, r, E)
    layout = "o r e, e r i -> e o i" if module._did_swap_in_out_features else "o r e, e r i -> e i o"
    return torch.einsum(layout, b, a) * module.scaling[ADAPTER]


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
    if lora.adapts_output_head:
        untie_output_embeddings(base)
    model = get_peft_model(base, peft_config(lora, base))
    missing, unexpected = model.load_state_dict(adapter_state, strict=False)
    adapter_missing = [k for k in missing if "lora_" in k]
    if unexpected or adapter_missing:
        raise RuntimeError(f"LoRA export: missing {adapter_missing}, unexpected {unexpected}")
    return model
