"""Image prompts in the built-in rollout engine: a vision-language prompt's prefill inputs, from the model itself.

For a batch of right-padded prompts, the model's own vision module (`get_image_features`) encodes each prompt's
images once, and its features replace the image-pad token embeddings in row order (as the HF Qwen2-VL forward
does with `masked_scatter`). The multimodal rotary positions (M-RoPE) and each prompt's rope delta come from the
model's `get_rope_index`; a generated token at cache position p then sits at rotary position p + delta, as in
HF `generate`. Nothing here reimplements the vision encoder or the position math.
Must not import engine, worker or trainer code.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def image_token_ids(model: nn.Module) -> tuple[int, ...]:
    """The placeholder tokens (image and video pad) of a vision-language model; () for a text model."""
    config = model.config
    return tuple(
        int(t)
        for t in (getattr(config, "image_token_id", None), getattr(config, "video_token_id", None))
        if t is not None
    )


def check_images(
    prompt_ids: Sequence[int], images: dict[str, torch.Tensor] | None, model: nn.Module
) -> str | None:
    """Why a request's images do not fit its prompt (None: they do): one image-pad token per merged patch."""
    image_token = getattr(model.config, "image_token_id", None)
    if image_token is None:
        return (
            "the request has images but the rollout model is not a vision-language model" if images else None
        )
    if not images:
        tokens = sum(1 for t in prompt_ids if t == image_token)
        return f"the prompt has {tokens} image tokens but no images" if tokens else None
    if "pixel_values" not in images or "image_grid_thw" not in images:
        return f"images must hold pixel_values and image_grid_thw, got {sorted(images)}"
    grid = images["image_grid_thw"]
    patches = int(grid.prod(dim=-1).sum())
    if patches != images["pixel_values"].shape[0]:
        return f"images have {images['pixel_values'].shape[0]} patches but their grids {grid.tolist()} say {patches}"
    merge = int(model.config.vision_config.spatial_merge_size) ** 2
    tokens = sum(1 for t in prompt_ids if t == image_token)
    if tokens != patches // merge:
        return f"the prompt has {tokens} image tokens but its images give {patches // merge}"
    return None


def same_images(a: dict[str, torch.Tensor] | None, b: dict[str, torch.Tensor] | None) -> bool:
    """Whether two requests carry the same images (so identical prompts may share one prefill)."""
    if not a or not b:
        return not a and not b
    return a is b or (
        torch.equal(a["image_grid_thw"], b["image_grid_thw"])
        and a["pixel_values"].shape == b["pixel_values"].shape
        and torch.equal(a["pixel_values"], b["pixel_values"])
    )


@torch.no_grad()
def prefill_inputs(
    model: nn.Module,
    embed_tokens: nn.Module,
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    images: Sequence[dict[str, torch.Tensor] | None],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(embeds (B, P, hidden), rope positions (3, B, P), rope deltas (B,)) of right-padded prompts `tokens`
    (B, P) whose row i holds `images[i]` (None or {} for a text prompt)."""
    image_token = int(model.config.image_token_id)
    valid = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < lengths[:, None]
    is_image = (tokens == image_token) & valid
    embeds = embed_tokens(tokens)
    rows = [row for row in images if row]
    grid = None
    if rows:
        pixels = torch.cat([row["pixel_values"] for row in rows]).to(embeds.device)
        grid = torch.cat([row["image_grid_thw"] for row in rows]).to(tokens.device)
        features = model.get_image_features(pixels, grid, return_dict=True).pooler_output
        features = torch.cat(list(features)).to(embeds.dtype)
        embeds = embeds.masked_scatter(is_image[..., None].expand_as(embeds), features)
    positions, deltas = model.model.get_rope_index(
        tokens, mm_token_type_ids=is_image.int(), image_grid_thw=grid, attention_mask=valid.long()
    )
    return embeds, positions, deltas.view(-1)
