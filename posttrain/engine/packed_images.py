"""Packed rows of a vision-language model: each packed sequence keeps its own images and its own multimodal
position ids (M-RoPE), as if it ran alone.

engine.packing lays the real tokens of a micro-batch's rows end to end in packed rows and calls the model once.
A vision-language model (Qwen2-VL) needs two more things for that call to equal the padded one:

- **Images in packed order.** The model encodes `pixel_values` and writes the features over the image tokens
  with one `masked_scatter`, in the order the image tokens appear in its (flattened) input. A row's tokens stay
  contiguous and in order when packed, so the images are the rows' images with the rows taken in the order of
  their first packed token (not the micro-batch's row order).
- **M-RoPE per sequence.** The rotary positions of an image token are (t, h, w) grid coordinates, and the text
  after an image continues from the image's largest coordinate, not from its token count. They come from the
  model's own `get_rope_index`, run on the micro-batch's padded rows with their attention mask (the call the
  padded pass makes), so each row's positions are those of the row alone; each real token's three positions
  then move to its packed cell. The model gets them as transformers' packed form, (4, rows, width): the text
  positions (restarting at 0 per sequence, from which eager attention derives its block-diagonal mask) above
  the three M-RoPE rows. `posttrain_varlen` attends per sequence from the segments engine.packing passes.

The vision tower is not packed: it attends within each image (its own `cu_seqlens`). Under `posttrain_varlen`
the tower must keep full (non-causal) attention, so the engine loads it with sdpa (`vision_attention_apart`).
Pure tensor code around one model call; no optimizer, no distributed logic.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.data.mm_dataset import MULTI_MODAL_INPUTS
from posttrain.engine.multimodal import check_image_tokens, gather_images
from posttrain.engine.packing import PackedLayout, pack
from posttrain.errors import ModelError

VISION_ATTENTION = "sdpa"  # the vision tower's attention when the language model attends per packed segment


def vision_attention_apart(model: nn.Module) -> None:
    """Give a vision-language model's vision tower `sdpa` attention while its language model keeps the packed
    one (`posttrain_varlen`): a model loaded with one implementation gives it to every sub-model, and the
    causal per-segment attention would be wrong for image patches, which attend to each other both ways."""
    config = getattr(model, "config", None)
    if getattr(config, "vision_config", None) is not None:
        model.set_attn_implementation({"vision_config": VISION_ATTENTION})  # type: ignore[operator]


def rope_index_owner(model: nn.Module) -> Any:
    """The module that computes the model's multimodal positions (Qwen2-VL's `Qwen2VLModel.get_rope_index`):
    the model or its first submodule with the method (under peft's and FSDP's wrappers)."""
    for module in model.modules():
        if callable(getattr(module, "get_rope_index", None)):
            return module
    raise ModelError(f"{type(model).__name__} has no get_rope_index: not a multimodal-RoPE model")


def image_order(layout: PackedLayout) -> list[int]:
    """The micro-batch's rows in the order their first token takes in the packed rows (flattened)."""
    first = layout.flat_pos.masked_fill(layout.flat_pos < 0, layout.input_ids.numel()).min(dim=1).values
    return sorted(range(len(first)), key=lambda r: int(first[r]))


class PackedWithImages(nn.Module):
    """`model` called on one packed layout with its images and M-RoPE positions (see the module docstring).

    engine.packing's helpers call it as a text model (packed `input_ids`, text `position_ids` (rows, width),
    segments or mask); it checks that the ids are the layout it was built for, then adds the three M-RoPE rows
    to the position ids and, when the micro-batch has images, the pixels and grids in packed order.
    """

    def __init__(
        self,
        model: nn.Module,
        layout: PackedLayout,
        cell_positions: torch.Tensor,
        images: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        super().__init__()
        self.inner = model
        self.layout = layout
        self.cells = layout.real_pos()  # flat packed position of every real token, row-major
        self.cell_positions = cell_positions  # (3, real tokens) M-RoPE positions, same order
        self.images = images

    @property
    def config(self) -> Any:
        """The inner model's config: engine.packing reads its attention implementation."""
        return self.inner.config

    def get_output_embeddings(self) -> nn.Module | None:
        """The LM head, where engine.packing keeps only the positions it needs."""
        head: nn.Module | None = self.inner.get_output_embeddings()  # type: ignore[operator]
        return head

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        if input_ids.shape != self.layout.input_ids.shape or not torch.equal(
            input_ids, self.layout.input_ids
        ):
            raise RuntimeError(
                "the packed rows differ from the layout their images and multimodal positions were placed for "
                f"({tuple(input_ids.shape)} vs {tuple(self.layout.input_ids.shape)}): engine.packing packed "
                "them another way (shared prompts are not supported with a vision-language model)"
            )
        rope = position_ids.reshape(1, -1).repeat(3, 1)  # filler tokens: text positions on all three axes
        rope[:, self.cells] = self.cell_positions.to(rope.device, rope.dtype)
        positions = torch.cat([position_ids[None], rope.view(3, *position_ids.shape)])
        extra: dict[str, torch.Tensor] = {}
        if self.images is not None:
            extra = {"pixel_values": self.images[0], "image_grid_thw": self.images[1]}
        return self.inner(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, **extra, **kwargs
        )


def packed_image_model(
    model: nn.Module, mb: Batch, image_token_id: int, row_tokens: int, device: torch.device
) -> PackedWithImages:
    """`model` bound to the packed layout of `mb` (`engine.packing.pack` with `row_tokens`, as the packed
    helpers build it), the micro-batch's images in packed order and every real token's M-RoPE positions.
    Rows without images (or a micro-batch without the images column) are text: their positions are 0, 1, ..."""
    ids, mask = mb[keys.INPUT_IDS], mb[keys.ATTENTION_MASK]
    rows: Sequence[dict[str, torch.Tensor]] = (
        list(mb[MULTI_MODAL_INPUTS]) if MULTI_MODAL_INPUTS in mb else [{}] * len(mb)
    )
    check_image_tokens(model, mb, rows, image_token_id)
    layout = pack(ids, mask, row_tokens)
    in_row_order = gather_images(rows)
    is_image = ((ids == image_token_id) & mask.bool()).int()
    grids = in_row_order[1].to(ids.device) if in_row_order is not None else None
    with torch.no_grad():  # integer positions; the model's own code, the call the padded pass makes
        positions, _ = rope_index_owner(model).get_rope_index(
            ids, mm_token_type_ids=is_image, image_grid_thw=grids, attention_mask=mask
        )
    cell_positions = positions[:, mask.bool()]
    packed = gather_images([rows[r] for r in image_order(layout)])
    images = None if packed is None else (packed[0].to(device), packed[1].to(device))
    return PackedWithImages(model, layout, cell_positions, images)
