"""Image inputs of a training pass: a micro-batch's pixels and grids gathered in row order, and the model call
that takes them.

A multimodal Batch carries each row's images in the non-tensor column `multi_modal_inputs` (one dict per row:
`pixel_values` (patches, features), `image_grid_thw` (images, 3)), so every row operation (chunk over ranks,
micro-batch split, select) keeps a row's pixels with its tokens. Here a micro-batch's padded rows are
concatenated in row order, the order in which the model's `masked_scatter` fills the image tokens. Multimodal
position ids (M-RoPE) are not computed here: the model derives them from input_ids, `mm_token_type_ids` and
image_grid_thw (transformers' `get_rope_index`), so they always match the model's own implementation. Packed
rows take their images and positions from engine.packed_images.
Pure tensor code; no optimizer, no distributed logic.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.data.mm_dataset import MULTI_MODAL_INPUTS
from posttrain.errors import DataError


def has_images(mb: Batch) -> bool:
    """Whether any row of the batch carries images."""
    return MULTI_MODAL_INPUTS in mb and any(bool(row) for row in mb[MULTI_MODAL_INPUTS])


def gather_images(rows: Sequence[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(pixel_values, image_grid_thw) of the rows concatenated in row order; None when no row has images.

    Each row's patch count must equal what its grids say (t * h * w patches per image): a row whose pixels
    were split from its grids would otherwise feed another row's image tokens.
    """
    pixels, grids = [], []
    for i, row in enumerate(rows):
        if not row:
            continue
        pv, thw = row["pixel_values"], row["image_grid_thw"]
        if int(thw.prod(dim=-1).sum()) != pv.shape[0]:
            raise DataError(
                f"row {i} of the micro-batch has {pv.shape[0]} patches but its image grids "
                f"{thw.tolist()} say {int(thw.prod(dim=-1).sum())}"
            )
        pixels.append(pv)
        grids.append(thw)
    if not pixels:
        return None
    return torch.cat(pixels), torch.cat(grids)


class WithImages(nn.Module):
    """`model` called with a micro-batch's images: the log-prob helpers call it like a text model
    (input_ids, attention_mask, position_ids, ...); the 1-D position ids are dropped so the model computes
    M-RoPE itself, and `mm_token_type_ids` (1 on image tokens) is derived from the ids it receives."""

    def __init__(
        self, model: nn.Module, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor, image_token_id: int
    ) -> None:
        super().__init__()
        self.inner = model
        self.pixel_values = pixel_values
        self.image_grid_thw = image_grid_thw
        self.image_token_id = image_token_id

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs: Any
    ) -> Any:
        kwargs.pop("position_ids", None)
        return self.inner(
            input_ids=input_ids,
            attention_mask=attention_mask,
            pixel_values=self.pixel_values,
            image_grid_thw=self.image_grid_thw,
            mm_token_type_ids=(input_ids == self.image_token_id).int(),
            **kwargs,
        )


def check_image_tokens(
    model: nn.Module, mb: Batch, rows: Sequence[dict[str, torch.Tensor]], image_token_id: int
) -> None:
    """Each row's image tokens must number what its own grids give (one per merged patch): an image
    separated from its row would otherwise feed another row's image tokens."""
    merge = int(getattr(model.config.vision_config, "spatial_merge_size", 1)) ** 2
    tokens = ((mb[keys.INPUT_IDS] == image_token_id) & mb[keys.ATTENTION_MASK].bool()).sum(1).tolist()
    for r, (row, n_tokens) in enumerate(zip(rows, tokens, strict=True)):
        expected = int(row["image_grid_thw"].prod(dim=-1).sum()) // merge if row else 0
        if n_tokens != expected:
            raise DataError(
                f"row {r} of the micro-batch has {n_tokens} image tokens but its images give {expected}"
            )


def image_model(model: nn.Module, mb: Batch, image_token_id: int | None, device: torch.device) -> nn.Module:
    """`model` itself for a batch without images, else `model` bound to the batch's images (`WithImages`)."""
    rows = list(mb[MULTI_MODAL_INPUTS]) if MULTI_MODAL_INPUTS in mb else []
    images = gather_images(rows)
    if images is None:
        return model
    if image_token_id is None:
        raise DataError(
            "the batch has images but the model has no image_token_id: not a vision-language model"
        )
    check_image_tokens(model, mb, rows, image_token_id)
    pixel_values, grid = (t.to(device) for t in images)
    return WithImages(model, pixel_values, grid, image_token_id)
