"""Every rank's pass runs the vision tower, with or without images: a micro-batch without images adds the tower's
output on a blank image, times zero, to its token embeddings.

Under FSDP2 each vision block is a sharded unit of its own (engine.fsdp): running it all-gathers its weights
from every rank and, when the tower trains, its backward reduce-scatters their gradients. These collectives pair
up only when every rank runs the tower in the same pass. A rank whose micro-batch holds no image (a dataset that
mixes image and text-only rows, or rows split so that one rank's micro-batch is text only) would skip them, and
the ranks' collectives would mismatch: gloo aborts the worker ("Received data size doesn't match expected
size"), NCCL hangs or corrupts.

Nothing changes in value: 0 x (sum of the blank image's features) is an exact zero, so every embedding, log-prob
and loss is what the text-only pass gives, and the tower's gradient from it is exactly zero. The tower runs
where the image path runs it (after the token embedding, before the decoder layers), so the collectives come in
the same order as on a rank with images. The blank image is the smallest the tower takes: one merged token
(spatial_merge_size^2 patches). Pure tensor code; the engine decides when a pass needs it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from posttrain.errors import ModelError


def image_model_owner(model: nn.Module) -> nn.Module:
    """The module that encodes images and embeds tokens (Qwen2-VL: `get_image_features`, `get_input_embeddings`);
    the model itself or the first submodule that has both (under peft's wrappers)."""
    for module in model.modules():
        if callable(getattr(module, "get_image_features", None)) and callable(
            getattr(module, "get_input_embeddings", None)
        ):
            return module
    raise ModelError(f"{type(model).__name__} has no get_image_features: not a vision-language model")


def blank_image(vision_config: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values, image_grid_thw) of the smallest image the tower takes: one frame of merge x merge patches,
    all zero, so its merged output is one token."""
    try:
        channels = int(getattr(vision_config, "in_channels", None) or vision_config.in_chans)
        temporal, patch = int(vision_config.temporal_patch_size), int(vision_config.patch_size)
        merge = int(vision_config.spatial_merge_size)
    except AttributeError as exc:
        raise ModelError(f"the vision config lacks a patch geometry field: {exc}") from None
    pixels = torch.zeros(merge * merge, channels * temporal * patch * patch, device=device)
    grid = torch.tensor([[1, merge, merge]], dtype=torch.long, device=device)
    return pixels, grid


def _features(output: Any) -> torch.Tensor:
    """The merged image features of `get_image_features`' output (a tensor, a tuple of per-image tensors, or
    a ModelOutput whose pooler_output is either)."""
    pooled = getattr(output, "pooler_output", output)
    if isinstance(pooled, (tuple, list)):
        pooled = torch.cat(list(pooled))
    if not isinstance(pooled, torch.Tensor):
        raise ModelError(f"get_image_features returned {type(output).__name__}, not image features")
    return pooled


class VisionPass:
    """Makes a text-only pass of a vision-language `model` run its vision tower too (see the module docstring).

    `text_only()` is a context: while it is open, each call of the model's token embedding adds 0 x the tower's
    features of a blank image to the embeddings (one tower call per forward).
    """

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.owner: Any = image_model_owner(model)  # HF methods, untyped
        config: Any = getattr(model, "config", None) or self.owner.config
        self.pixel_values, self.image_grid_thw = blank_image(config.vision_config, device)
        self.calls = 0  # tower calls on the blank image (tests read it)

    @contextlib.contextmanager
    def text_only(self) -> Iterator[None]:
        handle = self.owner.get_input_embeddings().register_forward_hook(self._add_zero_features)
        try:
            yield
        finally:
            handle.remove()

    def _add_zero_features(self, module: nn.Module, args: Any, embeddings: torch.Tensor) -> torch.Tensor:
        output = self.owner.get_image_features(self.pixel_values, self.image_grid_thw, return_dict=True)
        self.calls += 1
        zero = _features(output).sum() * 0.0  # exact zero for finite features; keeps the tower in the graph
        return embeddings + zero.to(embeddings.dtype)
