"""LoRA adapts a vision-language model's language model only: Qwen2.5-VL's vision tower has MLPs named
`gate_proj`/`up_proj`/`down_proj`, which the default `target_modules` would otherwise match (peft's and the
explicit API's multi-adapter path alike); a target that exists only in the tower is refused naming what exists."""

from __future__ import annotations

import pytest
import torch

from posttrain.config.schema import LoraConfig
from posttrain.engine.lora import apply_lora, vision_tower_linears
from posttrain.engine.multi_lora import targeted_linears
from posttrain.errors import ConfigError
from posttrain.models import load_causal_lm
from posttrain.models.tokenizer import VISION_TOKENS
from posttrain.models.vl import build_tiny_vl_model


def tiny_qwen25_vl() -> torch.nn.Module:
    """The tiny-vl-2.5 preset's model (its vision MLP is gated, as in the released Qwen2.5-VL models)."""
    ids = {t: i for i, t in enumerate((*VISION_TOKENS, "pad", "eos"))}
    return build_tiny_vl_model("tiny-vl-2.5", ids, seed=0)


def adapted(model: torch.nn.Module) -> set[str]:
    return {n.rsplit(".lora_A", 1)[0] for n, _ in model.named_parameters() if ".lora_A." in n}


def test_default_targets_leave_a_gated_vision_mlp_alone() -> None:
    model = tiny_qwen25_vl()
    tower = vision_tower_linears(model)
    assert any(name.endswith("mlp.gate_proj") for name in tower)  # the names the default targets list
    peft_model = apply_lora(model, LoraConfig(rank=4))
    names = adapted(peft_model)
    assert names and not any(".visual." in n for n in names)
    assert any("language_model.layers.0.mlp.gate_proj" in n for n in names)
    assert not any(".visual." in n for n in targeted_linears(tiny_qwen25_vl(), LoraConfig().target_modules))


def test_a_target_only_the_vision_tower_has_is_refused(tiny_vl_dir) -> None:
    model = load_causal_lm(tiny_vl_dir)
    assert any(name.endswith("fc1") for name in vision_tower_linears(model))  # Qwen2-VL's vision MLP
    with pytest.raises(ConfigError, match=r"\['fc1'\] not found.*never adapts the vision tower"):
        apply_lora(model, LoraConfig(rank=4, target_modules=("q_proj", "fc1")))
    with pytest.raises(ConfigError, match=r"\['qkv'\] not found"):
        targeted_linears(model, ("qkv",))
    assert vision_tower_linears(load_causal_lm(tiny_vl_dir).model.language_model) == []  # a text model: none
