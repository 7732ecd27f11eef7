"""Observations with images: read once into the tokens and pixels the model sees, and built from a chat.

The agent loop, the samplers and the training rows all need an observation as the model reads it: token ids
with each image expanded to its image tokens, and the processed pixels (`InputRow`). `ObservationReader` does
that once per image: token ids pass through, a `ModelInput`'s `ImageChunk`s go through the model's own image
processor (`ModelInputReader`, the explicit API's reader, so the trainer and the explicit API expand an image
the same way), an `InputRow` is already read. Its cache is keyed by the image bytes, so the loop (for lengths
and the trajectory) and the sampler (for the request) process an image once, and the tokens both see are the
same by construction.

`chat_model_input` turns a chat rendered by a vision-language chat template (each image part rendered as
`<|vision_start|><|image_pad|><|vision_end|>`) into a `ModelInput` with the images as `ImageChunk`s, which is
how an environment shows the model an image in its first or a later observation.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from tinker import types

from posttrain.agents.types import Observation
from posttrain.client.model_inputs import InputRow, ModelInputReader, concat_images, text_row
from posttrain.errors import PosttrainError

ImageCache = dict[bytes, tuple[int, dict[str, torch.Tensor]]]


class ObservationReader:
    """Observations as `InputRow`s for the model in `model_dir` (None: token ids and text-only ModelInputs,
    an image chunk is then a ValueError naming the missing model)."""

    def __init__(
        self,
        model_dir: str | Path | None = None,
        min_pixels: int | None = None,
        max_pixels: int | None = None,
    ) -> None:
        # the images' pixel bounds: the model's own unless given (the run's data.min_pixels / data.max_pixels)
        self.model = ModelInputReader(model_dir, min_pixels, max_pixels) if model_dir is not None else None
        self._cache: ImageCache = {}

    def row(self, observation: Observation, what: str = "observation") -> InputRow:
        """The observation as the model reads it (`what` names it in errors)."""
        if isinstance(observation, InputRow):
            return observation
        if isinstance(observation, types.ModelInput):
            if self.model is None:
                return text_row(observation, what)
            return self.model.row(observation, what, self._cache)
        return InputRow([int(t) for t in observation])

    def clear(self) -> None:
        """Forget the processed images (between steps: the cache would otherwise grow with every image)."""
        self._cache.clear()


def is_prefix(short: dict[str, torch.Tensor], long: dict[str, torch.Tensor]) -> bool:
    """Whether the images of `short` are the first images of `long` (same grids, same pixels), as when an
    observation extends the previous one: a later observation adds images after the earlier ones."""
    if not short:
        return True
    if not long:
        return False
    grid, patches = short["image_grid_thw"], short["pixel_values"].shape[0]
    return (
        long["image_grid_thw"].shape[0] >= grid.shape[0]
        and torch.equal(long["image_grid_thw"][: grid.shape[0]], grid)
        and long["pixel_values"].shape[0] >= patches
        and torch.equal(long["pixel_values"][:patches], short["pixel_values"])
    )


def suffix_images(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The images `after` adds to `before` (`before` must be a prefix of it, `is_prefix`)."""
    if not before:
        return after
    n, patches = before["image_grid_thw"].shape[0], before["pixel_values"].shape[0]
    if after["image_grid_thw"].shape[0] == n:
        return {}
    return {"pixel_values": after["pixel_values"][patches:], "image_grid_thw": after["image_grid_thw"][n:]}


def join_images(parts: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Images of consecutive pieces of one row, in order, as one entry ({} for none)."""
    return concat_images([p for p in parts if p])


def chat_model_input(
    text: str, images: Sequence[bytes], tokenizer: Any, image_token: str = "<|image_pad|>"
) -> types.ModelInput:
    """A ModelInput of `text` (a rendered chat, or a piece of one) whose k-th `image_token` becomes an
    `ImageChunk` of `images[k]` (png or jpeg bytes). The text pieces are tokenised separately; the template
    puts `<|vision_start|>`/`<|vision_end|>` (special tokens) on both sides of each image, so a piece
    tokenises as it would within the whole text."""
    pieces = text.split(image_token)
    if len(pieces) - 1 != len(images):
        raise PosttrainError(
            f"the rendered text holds {len(pieces) - 1} image tokens ({image_token}) for {len(images)} images"
        )
    chunks: list[types.ModelInputChunk] = []
    for k, piece in enumerate(pieces):
        if piece:
            chunks.append(
                types.EncodedTextChunk(tokens=list(tokenizer.encode(piece, add_special_tokens=False)))
            )
        if k < len(images):
            chunks.append(types.ImageChunk(data=images[k], format=image_format(images[k])))
    return types.ModelInput(chunks=chunks)


def image_format(data: bytes) -> Literal["png", "jpeg"]:
    """tinker's ImageChunk format of encoded image bytes: `png` or `jpeg` (anything else is an error)."""
    if data.startswith(b"\x89PNG"):
        return "png"
    if data.startswith(b"\xff\xd8"):
        return "jpeg"
    raise PosttrainError("an observation's image must be png or jpeg bytes")
