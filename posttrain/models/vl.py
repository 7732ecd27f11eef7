"""Vision-language models: the tiny Qwen2-VL / Qwen2.5-VL presets and an image processor that needs no torchvision.

`make_tiny_vl_model` writes an ordinary Hugging Face directory (config.json of model type `qwen2_vl` or
`qwen2_5_vl`, safetensors, tokenizer with the vision tokens, preprocessor_config.json of the PIL image
processor), so `AutoModelForImageTextToText.from_pretrained` and `AutoImageProcessor.from_pretrained` load it as
they load Qwen2-VL-2B or Qwen2.5-VL-3B. The two families share the text decoder (M-RoPE), the tokens, the chat
template and the image processor; Qwen2.5-VL's vision tower differs (window attention with a few full-attention
blocks, RMSNorm, a gated MLP, a merger projecting to `out_hidden_size`).
In transformers 5 `Qwen2VLProcessor` cannot be built without torchvision (its video processor slot is
type-checked against a torchvision class even when empty), so `VLProcessor` is the same image path
(expand each `<|image_pad|>` to one token per merged patch, `mm_token_type_ids` for M-RoPE) without video.
Must not import posttrain.data or anything above models/.

| preset      | text (hidden/mlp/layers/heads/kv) | vision (depth/dim/heads, patch, merge)        | parameters |
|-------------|-----------------------------------|-----------------------------------------------|------------|
| tiny-vl     | 128 / 448 / 2 / 4 / 2, vocab 1024 | 2 / 32 / 2, patch 14, merge 2                 | 662,400    |
| tiny-vl-2.5 | as tiny-vl (Qwen2.5-VL)           | as tiny-vl; 56-px windows, block 1 full       | 666,464    |
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import (
    BatchFeature,
    PreTrainedTokenizerBase,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)
from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

from posttrain.errors import ConfigError, ModelError
from posttrain.models.tokenizer import (
    IM_END,
    IMAGE_PAD,
    PAD_TOKEN,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    VISION_TOKENS,
    VL_CHAT_TEMPLATE,
    train_tokenizer,
)

# config.json attribute written by `make_tiny_vl_model`: the weights were initialised at random. It is kept by
# `save_pretrained`, so a model exported after training (SFT, then RL) still carries it.
FROM_SCRATCH_KEY = "posttrain_from_scratch"
VISION_TOWER_MODES = ("auto", "frozen", "trained")

VLFamily = Literal["qwen2_vl", "qwen2_5_vl"]
VLConfig = Qwen2VLConfig | Qwen2_5_VLConfig
VLModel = Qwen2VLForConditionalGeneration | Qwen2_5_VLForConditionalGeneration


@dataclass(frozen=True)
class TinyVLPreset:
    """Sizes of a Qwen2-VL or Qwen2.5-VL model (`family`): the text decoder, the vision tower and the default
    image pixel bounds. `vision_window_size` (pixels) and `vision_fullatt_blocks` are Qwen2.5-VL's only."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    mrope_section: tuple[int, int, int]  # (temporal, height, width) rotary pairs; sums to head_dim / 2
    vision_depth: int
    vision_embed_dim: int
    vision_num_heads: int
    vision_mlp_ratio: int
    patch_size: int = 14
    spatial_merge_size: int = 2  # 2x2 patches merge into one text token
    min_pixels: int = 56 * 56  # the image processor's bounds: 4 .. 16 image tokens per image
    max_pixels: int = 112 * 112
    rope_theta: float = 10000.0
    family: VLFamily = "qwen2_vl"
    vision_window_size: int = (
        0  # Qwen2.5-VL: side of an attention window, in pixels (a multiple of patch*merge)
    )
    vision_fullatt_blocks: tuple[int, ...] = ()  # Qwen2.5-VL: blocks attending over the whole image


_TINY_VL = TinyVLPreset(
    hidden_size=128,
    intermediate_size=448,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
    max_position_embeddings=1024,
    mrope_section=(4, 6, 6),  # Qwen2-VL's (16, 24, 24) for head_dim 128, scaled to head_dim 32
    vision_depth=2,
    vision_embed_dim=32,
    vision_num_heads=2,
    vision_mlp_ratio=2,
)

VL_PRESETS: dict[str, TinyVLPreset] = {
    "tiny-vl": _TINY_VL,
    # Qwen2.5-VL's 112-px windows hold 4x4 merged tokens of 28 px; at 56 px a 112x112 image (4x4 tokens) has
    # four 2x2 windows, so block 0 attends within windows and block 1 (the last, as in Qwen2.5-VL) over the image
    "tiny-vl-2.5": replace(_TINY_VL, family="qwen2_5_vl", vision_window_size=56, vision_fullatt_blocks=(1,)),
}


def get_vl_preset(name: str) -> TinyVLPreset:
    """Look up a vision-language preset; an unknown name raises ConfigError with the valid names."""
    if name not in VL_PRESETS:
        raise ConfigError(f"unknown vision-language preset {name!r}; valid presets: {', '.join(VL_PRESETS)}")
    return VL_PRESETS[name]


def make_vl_config(preset: TinyVLPreset, token_ids: dict[str, int]) -> VLConfig:
    """The Qwen2VLConfig or Qwen2_5_VLConfig of a preset (its `family`; tied embeddings, init std 0.02,
    float32); `token_ids` maps the vision tokens and bos/eos/pad to their ids."""
    text = dict(
        vocab_size=preset.vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        max_position_embeddings=preset.max_position_embeddings,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": preset.rope_theta,
            "mrope_section": list(preset.mrope_section),
        },
        initializer_range=0.02,
        bos_token_id=token_ids["pad"],
        eos_token_id=token_ids["eos"],
        pad_token_id=token_ids["pad"],
    )
    vision: dict[str, Any] = dict(
        depth=preset.vision_depth,
        num_heads=preset.vision_num_heads,
        patch_size=preset.patch_size,
        spatial_merge_size=preset.spatial_merge_size,
        temporal_patch_size=2,
        initializer_range=0.02,
    )
    if preset.family == "qwen2_vl":
        vision.update(
            embed_dim=preset.vision_embed_dim,
            hidden_size=preset.hidden_size,  # the merger projects into the text model's width
            mlp_ratio=preset.vision_mlp_ratio,
        )
    else:  # Qwen2.5-VL names the tower's width hidden_size and the merger's output out_hidden_size
        vision.update(
            hidden_size=preset.vision_embed_dim,
            intermediate_size=preset.vision_embed_dim * preset.vision_mlp_ratio,
            out_hidden_size=preset.hidden_size,
            window_size=preset.vision_window_size,
            fullatt_block_indexes=list(preset.vision_fullatt_blocks),
        )
    config_class = Qwen2_5_VLConfig if preset.family == "qwen2_5_vl" else Qwen2VLConfig
    return config_class(
        text_config=text,
        vision_config=vision,
        image_token_id=token_ids[IMAGE_PAD],
        video_token_id=token_ids[VIDEO_PAD],
        vision_start_token_id=token_ids[VISION_START],
        vision_end_token_id=token_ids[VISION_END],
        tie_word_embeddings=True,
        dtype=torch.float32,
    )


def build_tiny_vl_model(preset: str, token_ids: dict[str, int], seed: int = 0) -> VLModel:
    """A randomly initialised Qwen2-VL or Qwen2.5-VL of a preset, reproducibly, without touching the global RNG."""
    config = make_vl_config(get_vl_preset(preset), token_ids)
    model: VLModel
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if isinstance(config, Qwen2_5_VLConfig):
            model = Qwen2_5_VLForConditionalGeneration(config)
        else:
            model = Qwen2VLForConditionalGeneration(config)
    model.eval()
    return model


def make_image_processor(
    patch_size: int, merge_size: int, min_pixels: int, max_pixels: int
) -> Qwen2VLImageProcessorPil:
    """Qwen2-VL's image processor on Pillow + numpy (the default one needs torchvision)."""
    return Qwen2VLImageProcessorPil(
        patch_size=patch_size, merge_size=merge_size, min_pixels=min_pixels, max_pixels=max_pixels
    )


def make_tiny_vl_model(preset: str, out_dir: str | Path, corpus: Iterable[str], seed: int = 0) -> Path:
    """Train a tokenizer (with the vision tokens) on `corpus`, build a seeded tiny Qwen2(.5)-VL, and save model,
    tokenizer (chat template taking image parts) and image processor as one HF directory; returns it."""
    spec = get_vl_preset(preset)
    tokenizer = train_tokenizer(corpus, spec.vocab_size, extra_special_tokens=VISION_TOKENS)
    tokenizer.model_max_length = spec.max_position_embeddings
    tokenizer.chat_template = VL_CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    ids["pad"] = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    ids["eos"] = tokenizer.convert_tokens_to_ids(IM_END)

    model = build_tiny_vl_model(preset, ids, seed)
    # read by `vision_tower_trained`: a tower built here has never seen an image, so training it is the default
    setattr(model.config, FROM_SCRATCH_KEY, True)
    model.generation_config.bos_token_id = ids["pad"]
    model.generation_config.pad_token_id = ids["pad"]
    model.generation_config.eos_token_id = [ids["eos"], ids["pad"]]

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    make_image_processor(
        spec.patch_size, spec.spatial_merge_size, spec.min_pixels, spec.max_pixels
    ).save_pretrained(out)
    return out


class VLProcessor:
    """Tokenizer + Qwen2-VL image processor: the image half of `Qwen2VLProcessor`, with the same call.

    `processor(text=[...], images=[...])` returns input_ids, attention_mask, mm_token_type_ids (1 on image
    tokens, which M-RoPE needs), pixel_values and image_grid_thw; each `<|image_pad|>` in the text becomes
    grid_t * grid_h * grid_w / merge_size**2 tokens, images taken in order across the texts.
    """

    def __init__(self, image_processor: Any, tokenizer: PreTrainedTokenizerBase) -> None:
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.image_token = IMAGE_PAD
        self.image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        self.chat_template = tokenizer.chat_template

    def apply_chat_template(self, conversation: list[dict], **kwargs: Any) -> Any:
        return self.tokenizer.apply_chat_template(conversation, **kwargs)

    def num_image_tokens(self, image_grid_thw: torch.Tensor) -> list[int]:
        """Text tokens per image for rows of (t, h, w) patch grids."""
        merge = self.image_processor.merge_size
        return [int(n) for n in image_grid_thw.prod(dim=-1) // (merge * merge)]

    def __call__(
        self,
        text: str | Sequence[str],
        images: Sequence[Any] | None = None,
        return_tensors: str = "pt",
        padding: bool | str = True,
        **kwargs: Any,
    ) -> BatchFeature:
        texts = [text] if isinstance(text, str) else list(text)
        data: dict[str, Any] = {}
        if images:
            data.update(self.image_processor(images=list(images), return_tensors="pt"))
            counts = iter(self.num_image_tokens(data["image_grid_thw"]))
            expanded = []
            for t in texts:
                parts = t.split(self.image_token)
                out = parts[0]
                for part in parts[1:]:
                    n = next(counts, None)
                    if n is None:
                        raise ModelError(f"more {self.image_token} placeholders than images ({len(images)})")
                    out += self.image_token * n + part
                expanded.append(out)
            if next(counts, None) is not None:
                raise ModelError(
                    f"more images ({len(images)}) than {self.image_token} placeholders in the text"
                )
            texts = expanded
        enc = self.tokenizer(texts, return_tensors=return_tensors, padding=padding, **kwargs)
        data.update(enc)
        data["mm_token_type_ids"] = (enc["input_ids"] == self.image_token_id).long()
        return BatchFeature(data=data, tensor_type=return_tensors)


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """The vision encoder of a vision-language model (Qwen2-VL's `model.visual`), or None for a text model."""
    inner = getattr(model, "model", None)
    for owner in (inner, model):
        visual = getattr(owner, "visual", None) if owner is not None else None
        if isinstance(visual, torch.nn.Module):
            return visual
    return None


def vision_tower_trained(mode: str, config: Any) -> bool:
    """Whether `model.vision_tower=mode` trains the vision encoder of a model with this config.

    `frozen` / `trained` say so; `auto` trains it only for a model `make-model` built from scratch (its config
    carries `posttrain_from_scratch: true`): a pretrained tower already sees, a random one must learn to.
    """
    if mode not in VISION_TOWER_MODES:
        raise ConfigError(f"model.vision_tower={mode!r} unknown; valid: {', '.join(VISION_TOWER_MODES)}")
    if mode == "auto":
        return bool(getattr(config, FROM_SCRATCH_KEY, False))
    return mode == "trained"
