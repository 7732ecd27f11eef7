"""Packed rows of a vision-language model: each packed sequence keeps its own images and its own multimodal
position ids (M-RoPE), as if it ran alone, and so do the rows of a shared prompt.

engine.packing lays the real tokens of a micro-batch's rows end to end in packed rows and calls the model once;
with shared prompts (`model.share_prompt`) the rows of one prompt land on one packed copy of it, followed by
their responses. A vision-language model (Qwen2-VL) needs two more things for that call to equal the padded one:

- **Images in packed order.** The model encodes `pixel_values` and writes the features over the image tokens
  with one `masked_scatter`, in the order the image tokens appear in its (flattened) input. engine.packing
  tells the model where each real cell landed (`PackingOptions.cell_positions`); each image goes where its
  first token landed, and an image of a shared prompt, whose tokens several rows placed on one copy, is
  encoded once. Rows share a prompt only when their images are equal too (`image_labels`): the same image
  tokens over other pixels are another prompt.
- **M-RoPE per sequence.** The rotary positions of an image token are (t, h, w) grid coordinates, and the text
  after an image continues from the image's largest coordinate, not from its token count. They come from the
  model's own `get_rope_index`, run on the micro-batch's padded rows with their attention mask (the call the
  padded pass makes), so each row's positions are those of the row alone; each real token's three positions
  then move to its packed cell. A response packed after a shared prompt thus continues from its prompt's
  positions, rope delta included, exactly as unshared. The model gets them as transformers' packed form,
  (4, rows, width): the text positions (restarting at 0 per sequence, from which eager attention derives its
  block-diagonal mask; shared prompts pass their own mask or segments) above the three M-RoPE rows.
  `posttrain_varlen` attends per sequence from the segments engine.packing passes.

The vision tower is not packed: it attends within each image (its own `cu_seqlens`). Under `posttrain_varlen`
the tower must keep full (non-causal) attention, so the engine loads it with sdpa (`vision_attention_apart`).
Pure tensor code around one model call; no optimizer, no distributed logic.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.data.mm_dataset import MULTI_MODAL_INPUTS
from posttrain.engine.multimodal import check_image_tokens, gather_images
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


def image_labels(rows: Sequence[dict[str, torch.Tensor]]) -> tuple[int, ...]:
    """One label per row, equal for rows with equal images (pixels and grids; every text-only row alike):
    rows whose prompt tokens are equal share a prompt pass only within a label, since the same image tokens
    over other pixels are another prompt. Compared by a hash of the pixels' bytes (the n samples of a GRPO
    group carry copies of one prompt's images)."""
    seen: dict[tuple[tuple[int, ...], str] | None, int] = {}
    labels = []
    for row in rows:
        key = None
        if row:
            pixels = row["pixel_values"].detach().contiguous().cpu()
            digest = hashlib.blake2b(pixels.view(-1).view(torch.uint8).numpy().tobytes(), digest_size=16)
            key = (tuple(row["image_grid_thw"].reshape(-1).tolist()), f"{pixels.dtype}:{digest.hexdigest()}")
        labels.append(seen.setdefault(key, len(seen)))
    return tuple(labels)


@dataclass(frozen=True)
class Placement:
    """Where a micro-batch's real cells landed in one packed layout, and its images in packed order."""

    cell_pos: torch.Tensor  # (N,) flat packed position of each real cell, `attention_mask.bool()` order
    images: tuple[torch.Tensor, torch.Tensor] | None  # (pixel_values, image_grid_thw) in packed order


class PackedWithImages(nn.Module):
    """`model` called on packed rows with a micro-batch's images and M-RoPE positions (the module docstring).

    Built once per micro-batch from its padded rows: each real cell's token and M-RoPE positions (the
    model's `get_rope_index` of each row alone) and each image's cells and pixels. engine.packing tells it,
    before every model call, where each real cell landed (`place`, the `cell_positions` hook of
    `PackingOptions`): plain packing or shared prompts, where the cells of a shared prompt's rows land on
    one packed copy. It then calls the model with the M-RoPE rows at those positions (a response's continue
    after its own prompt's, rope delta included, shared or not) and each distinct image once, in the order
    its tokens take in the packed rows. A layout it was not told of is an error, never text positions.
    """

    def __init__(
        self,
        model: nn.Module,
        cell_tokens: torch.Tensor,
        cell_rope: torch.Tensor,
        image_cells: list[tuple[int, int]],
        images: tuple[torch.Tensor, torch.Tensor] | None,
        labels: tuple[int, ...],
    ) -> None:
        super().__init__()
        self.inner = model
        self.cell_tokens = cell_tokens  # (N,) token of each real cell
        self.cell_positions = cell_rope  # (3, N) M-RoPE positions of each real cell
        self.image_cells = image_cells  # per image (row order): (index of its first cell, its token count)
        self.row_images = images  # (pixel_values, image_grid_thw) of the rows concatenated in row order
        self.labels = labels  # `image_labels` of the rows
        grids = images[1].tolist() if images is not None else []
        patches = [t * h * w for t, h, w in grids]
        self.patch_offsets = list(itertools.accumulate(patches, initial=0))  # image j: [o[j], o[j + 1])
        self.placement: Placement | None = None

    @property
    def config(self) -> Any:
        """The inner model's config: engine.packing reads its attention implementation."""
        return self.inner.config

    def get_output_embeddings(self) -> nn.Module | None:
        """The LM head, where engine.packing keeps only the positions it needs."""
        head: nn.Module | None = self.inner.get_output_embeddings()  # type: ignore[operator]
        return head

    def place(self, cell_pos: torch.Tensor) -> None:
        """Learn where each real cell lands in the packed rows of the next call (flat packed positions, in
        `attention_mask.bool()` order), and order the images by where their tokens land. Rows that share a
        packed prompt share its images: an image whose tokens land where another's did is passed once."""
        if cell_pos.shape != self.cell_tokens.shape:
            raise RuntimeError(f"{cell_pos.numel()} placed cells for {self.cell_tokens.numel()} real cells")
        images = None
        if self.row_images is not None:
            first = [i for i, _ in self.image_cells]
            last = [i + n - 1 for i, n in self.image_cells]
            starts = cell_pos[first].tolist()
            ends = cell_pos[last].tolist()
            by_start: dict[int, int] = {}
            for j, (start, end) in enumerate(zip(starts, ends, strict=True)):
                if end - start != self.image_cells[j][1] - 1:  # a row's cells land in order: contiguous
                    raise RuntimeError(f"image {j}'s tokens were packed apart (packed {start}..{end})")
                if start not in by_start:
                    by_start[start] = j
                elif not self._same_image(by_start[start], j):
                    raise RuntimeError(
                        f"images {by_start[start]} and {j} differ but their tokens were packed as one prompt"
                    )
            order = [by_start[start] for start in sorted(by_start)]
            pixels, grids = self.row_images
            offsets = self.patch_offsets
            images = (
                torch.cat([pixels[offsets[j] : offsets[j + 1]] for j in order]),
                grids[order],
            )
        self.placement = Placement(cell_pos, images)

    def _same_image(self, a: int, b: int) -> bool:
        assert self.row_images is not None
        pixels, grids = self.row_images
        o = self.patch_offsets
        return torch.equal(grids[a], grids[b]) and torch.equal(
            pixels[o[a] : o[a + 1]], pixels[o[b] : o[b + 1]]
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        placement, self.placement = self.placement, None  # one placement per call
        if placement is None:
            raise RuntimeError(
                "the packed model was called without being told where the rows' cells landed "
                "(engine.packing's cell_positions hook): their images and multimodal positions have no place"
            )
        cells = placement.cell_pos.to(input_ids.device)
        flat_ids = input_ids.reshape(-1)
        if not torch.equal(flat_ids[cells], self.cell_tokens.to(flat_ids.device)):
            raise RuntimeError(
                "the packed rows do not hold the micro-batch's tokens where they were placed: the layout "
                "the model was called on is not the one its images and multimodal positions were placed for"
            )
        rope = position_ids.reshape(1, -1).repeat(3, 1)  # filler tokens: text positions on all three axes
        cell_rope = self.cell_positions.to(rope.device, rope.dtype)
        rope[:, cells] = cell_rope
        if not torch.equal(rope[:, cells], cell_rope):  # cells placed on one shared position must agree
            raise RuntimeError("rows packed on a shared prompt have different multimodal positions there")
        positions = torch.cat([position_ids[None], rope.view(3, *position_ids.shape)])
        extra: dict[str, torch.Tensor] = {}
        if placement.images is not None:
            device = input_ids.device
            extra = {
                "pixel_values": placement.images[0].to(device),
                "image_grid_thw": placement.images[1].to(device),
            }
        return self.inner(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, **extra, **kwargs
        )


def packed_image_model(model: nn.Module, mb: Batch, image_token_id: int) -> PackedWithImages:
    """`model` bound to the micro-batch `mb` (its padded rows): every real token's M-RoPE positions (the
    model's `get_rope_index` of each row alone, the call the padded pass makes), each image's token cells and
    pixels, and the rows' `image_labels`; engine.packing then places them (`PackedWithImages.place`).
    Rows without images (or a micro-batch without the images column) are text: their positions are 0, 1, ..."""
    ids, mask = mb[keys.INPUT_IDS], mb[keys.ATTENTION_MASK]
    rows: Sequence[dict[str, torch.Tensor]] = (
        list(mb[MULTI_MODAL_INPUTS]) if MULTI_MODAL_INPUTS in mb else [{}] * len(mb)
    )
    check_image_tokens(model, mb, rows, image_token_id)
    in_row_order = gather_images(rows)
    real = mask.bool()
    is_image = (ids == image_token_id) & real
    grids = in_row_order[1].to(ids.device) if in_row_order is not None else None
    with torch.no_grad():  # integer positions; the model's own code, the call the padded pass makes
        positions, _ = rope_index_owner(model).get_rope_index(
            ids, mm_token_type_ids=is_image.int(), image_grid_thw=grids, attention_mask=mask
        )
    image_cells: list[tuple[int, int]] = []
    if in_row_order is not None:
        vision_config: Any = getattr(model.config, "vision_config", None)
        merge = int(getattr(vision_config, "spatial_merge_size", 1)) ** 2
        counts = [int(c) // merge for c in in_row_order[1].prod(dim=-1).tolist()]
        cells = torch.nonzero(is_image[real]).reshape(-1).tolist()  # real-cell index of every image token
        offset = 0
        for n in counts:  # images in row order: each row's tokens, each image's in order
            image_cells.append((cells[offset], n))
            offset += n
    return PackedWithImages(
        model, ids[real], positions[:, real], image_cells, in_row_order, image_labels(rows)
    )
