"""A tinker `ModelInput` as one row of the model: its token ids, image chunks expanded, and the row's images.

tinker's chunks: an `EncodedTextChunk` is its tokens; an `ImageChunk` (png or jpeg bytes) is decoded with Pillow,
fitted into the model's own pixel bounds and processed by the model's own image processor, exactly as the
multimodal datasets do (`posttrain.data.images`, `posttrain.data.mm_dataset`), and becomes the model's image
token (`<|image_pad|>` for Qwen2-VL) repeated once per merged patch. As in tinker (and its cookbook's Qwen-VL
renderers), the chunk is the image tokens only: the text around it carries `<|vision_start|>` and
`<|vision_end|>`. The pixels and grid sizes of a row's images are its `multi_modal_inputs` (the Batch column
the train engine and the rollout engine read). An `ImageAssetPointerChunk` (a URL or path) is refused: nothing
is fetched. Every failure is a ValueError naming the datum (or prompt) and the chunk, raised in the caller's
thread before anything is queued. A client without the model (http) checks lengths as the chunks declare
them (`declared_length`: an image chunk's `expected_tokens`); the server processes the images.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from tinker import types

from posttrain.data.images import ImageRef, image_size, load_image, open_image
from posttrain.data.mm_dataset import image_token_count, multi_modal_inputs
from posttrain.errors import DataError, ModelError

PIL_FORMATS = {"png": "PNG", "jpeg": "JPEG"}  # tinker's ImageChunk.format -> the format Pillow reads


@dataclass(frozen=True)
class InputRow:
    """A ModelInput as the model reads it: token ids (each image as its image tokens) and the row's images
    (`{"pixel_values", "image_grid_thw"}`; {} without images)."""

    tokens: list[int]
    images: dict[str, torch.Tensor] = field(default_factory=dict)


def text_row(model_input: types.ModelInput, what: str) -> InputRow:
    """The row of a ModelInput of token chunks only (no model needed); any other chunk is a ValueError."""
    tokens: list[int] = []
    for j, chunk in enumerate(model_input.chunks):
        if not isinstance(chunk, types.EncodedTextChunk):
            raise ValueError(
                f"{what}: chunk {j} is an {type(chunk).__name__}: image chunks are expanded with a "
                "vision-language model's processor (ModelInputReader); this call takes token chunks only"
            )
        tokens.extend(int(t) for t in chunk.tokens)
    return InputRow(tokens)


def check_expected_tokens(chunk: types.ImageChunk, where: str) -> None:
    """An image's declared token count is a count: a negative one (which would shrink a request's length under
    a server's limits) is a ValueError naming the chunk."""
    if chunk.expected_tokens is not None and chunk.expected_tokens < 0:
        raise ValueError(f"{where}: expected_tokens={chunk.expected_tokens} is negative")


def declared_length(model_input: types.ModelInput, what: str) -> int | None:
    """The length of a ModelInput as its chunks declare it, for a client that does not hold the model (http):
    an image chunk counts its `expected_tokens`. None when an image chunk leaves it out (tinker calls it
    advisory): only the server, which holds the processor, can count that image, and it checks the request's
    lengths when it does. A URL or path pointer is a ValueError, as on every backend."""
    length: int | None = 0
    for j, chunk in enumerate(model_input.chunks):
        if isinstance(chunk, types.EncodedTextChunk):
            length = None if length is None else length + len(chunk.tokens)
        elif isinstance(chunk, types.ImageChunk):
            unsized = chunk.expected_tokens is None
            check_expected_tokens(chunk, f"{what}: chunk {j}")
            length = None if length is None or unsized else length + int(chunk.expected_tokens or 0)
        elif isinstance(chunk, types.ImageAssetPointerChunk):
            raise ValueError(pointer_refusal(chunk, f"{what}: chunk {j}"))
        else:
            raise ValueError(
                f"{what}: chunk {j}: {type(chunk).__name__} is not supported (token and image chunks are)"
            )
    return length


def pointer_refusal(chunk: types.ImageAssetPointerChunk, where: str) -> str:
    return (
        f"{where}: an ImageAssetPointerChunk ({chunk.location!r}) is not supported: images are never fetched "
        "from a URL or path; send the image's bytes as an ImageChunk(data=..., format='png' or 'jpeg')"
    )


class ModelInputReader:
    """Rows of ModelInputs for the model in `model_dir`: token chunks as they are, image chunks through the
    model's own image processor, in its pixel bounds unless `min_pixels` / `max_pixels` replace them (the
    trainer's data.min_pixels / data.max_pixels). The processor is loaded on the first image."""

    def __init__(
        self, model_dir: str | Path, min_pixels: int | None = None, max_pixels: int | None = None
    ) -> None:
        self.model_dir = str(model_dir)
        self.min_pixels, self.max_pixels = min_pixels, max_pixels

    @cached_property
    def _config(self) -> Any:
        from posttrain.models import load_config

        return load_config(self.model_dir)

    @cached_property
    def _processor(self) -> Any:
        from posttrain.models import load_processor

        try:
            return load_processor(self.model_dir, self.min_pixels, self.max_pixels)
        except ModelError as exc:
            raise ValueError(f"cannot process image chunks for {self.model_dir}: {exc}") from None

    def rows(self, inputs: Sequence[types.ModelInput], what: str = "datum") -> list[InputRow]:
        """One row per input (`what` i names input i in errors). An image that appears in several inputs
        (the n samples of one prompt) is processed once."""
        cache: dict[bytes, tuple[int, dict[str, torch.Tensor]]] = {}
        return [self.row(m, f"{what} {i}", cache) for i, m in enumerate(inputs)]

    @cached_property
    def vocab_size(self) -> int:
        """The model's embedding rows (its text config's vocab_size): the token ids it can read."""
        text = getattr(self._config, "text_config", None) or self._config
        return int(text.vocab_size)

    def check_token_ids(self, tokens: Sequence[int] | torch.Tensor, what: str) -> None:
        """A ValueError naming the first id outside 0..vocab_size-1 and its position: such an id would index
        past the embedding (an IndexError on CPU, a device-side assert on a GPU that poisons the process)."""
        ids = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        bad = ((ids < 0) | (ids >= self.vocab_size)).nonzero()
        if len(bad):
            at = int(bad[0])
            raise ValueError(
                f"{what}: token id {int(ids[at])} at position {at} is outside the model's vocabulary "
                f"(0..{self.vocab_size - 1})"
            )

    def row(
        self,
        model_input: types.ModelInput,
        what: str,
        cache: dict[bytes, tuple[int, dict[str, torch.Tensor]]] | None = None,
    ) -> InputRow:
        """The row of one ModelInput (`what` names it in errors); every token id is checked against the
        model's vocabulary."""
        row = self._row(model_input, what, cache)
        self.check_token_ids(row.tokens, what)
        return row

    def _row(
        self,
        model_input: types.ModelInput,
        what: str,
        cache: dict[bytes, tuple[int, dict[str, torch.Tensor]]] | None = None,
    ) -> InputRow:
        if all(isinstance(c, types.EncodedTextChunk) for c in model_input.chunks):
            row = text_row(model_input, what)
            token = getattr(self._config, "image_token_id", None)
            if token is not None and getattr(self._config, "vision_config", None) is not None:
                check_no_image_token(model_input, int(token), what)
            return row
        cache = {} if cache is None else cache
        image_token = self._image_token(model_input, what)
        check_no_image_token(model_input, image_token, what)
        tokens: list[int] = []
        images: list[dict[str, torch.Tensor]] = []
        after_image = False  # no text token since the last image
        for j, chunk in enumerate(model_input.chunks):
            where = f"{what}: chunk {j}"
            if isinstance(chunk, types.EncodedTextChunk):
                tokens.extend(int(t) for t in chunk.tokens)
                after_image = after_image and not chunk.tokens
            elif isinstance(chunk, types.ImageChunk):
                if after_image:  # an empty token chunk between two images separates nothing
                    # the model's position ids take one image per run of image tokens: two images back to
                    # back would read as one (a shape error mid-pass, a hang for the other FSDP ranks)
                    raise ValueError(
                        f"{where}: an ImageChunk right after another with no token between them; put text "
                        "between them (the model's "
                        "<|vision_end|><|vision_start|> tokens, as its chat template does)"
                    )
                count, image = self._image(chunk, where, cache)
                tokens.extend([image_token] * count)
                images.append(image)
                after_image = True
            elif isinstance(chunk, types.ImageAssetPointerChunk):
                raise ValueError(pointer_refusal(chunk, where))
            else:
                raise ValueError(
                    f"{where}: {type(chunk).__name__} is not supported (token and image chunks are)"
                )
        return InputRow(tokens, concat_images(images))

    def length(self, model_input: types.ModelInput, what: str) -> int:
        """The ModelInput's length without processing its images: an image chunk counts its `expected_tokens`,
        or when that is unset (tinker calls it advisory) the tokens its size gives, read from the image's header
        alone. What a server counts against its limits before the request is queued; `row` still checks every
        image in full (its format, its pixels, the count)."""
        length = 0
        for j, chunk in enumerate(model_input.chunks):
            where = f"{what}: chunk {j}"
            if isinstance(chunk, types.EncodedTextChunk):
                length += len(chunk.tokens)
            elif isinstance(chunk, types.ImageChunk) and chunk.expected_tokens is not None:
                check_expected_tokens(chunk, where)
                length += chunk.expected_tokens
            elif isinstance(chunk, types.ImageChunk):
                self._image_token(model_input, what)  # a text-only model: the ValueError that names it
                try:
                    width, height = image_size(ImageRef(data=chunk.data), None, None, where)
                except DataError as exc:
                    raise ValueError(str(exc)) from None
                length += image_token_count(self._processor, width, height)
            elif isinstance(chunk, types.ImageAssetPointerChunk):
                raise ValueError(pointer_refusal(chunk, where))
            else:
                raise ValueError(
                    f"{where}: {type(chunk).__name__} is not supported (token and image chunks are)"
                )
        return length

    def _image_token(self, model_input: types.ModelInput, what: str) -> int:
        """The model's image token id; a text-only model given an image chunk is a ValueError naming it."""
        config = self._config
        token = getattr(config, "image_token_id", None)
        if getattr(config, "vision_config", None) is None or token is None:
            kinds = sorted({type(c).__name__ for c in model_input.chunks} - {"EncodedTextChunk"})
            raise ValueError(
                f"{what}: the model input holds {', '.join(kinds)} but {self.model_dir} "
                f"({getattr(config, 'model_type', 'unknown type')}) has no vision tower: image chunks need a "
                "vision-language model (the Qwen2-VL family)"
            )
        return int(token)

    def _image(
        self, chunk: types.ImageChunk, where: str, cache: dict[bytes, tuple[int, dict[str, torch.Tensor]]]
    ) -> tuple[int, dict[str, torch.Tensor]]:
        """(image tokens, {pixel_values, image_grid_thw}) of an image chunk, checked against its format and
        its expected_tokens."""
        key = hashlib.sha256(chunk.data).digest()
        if key not in cache:
            cache[key] = self._process(chunk, where)
        count, image = cache[key]
        if chunk.expected_tokens is not None and chunk.expected_tokens != count:
            raise ValueError(
                f"{where}: the ImageChunk says expected_tokens={chunk.expected_tokens}, but the image is "
                f"{count} tokens for {self.model_dir}'s image processor (its pixel bounds and patch grid)"
            )
        return count, image

    def _process(self, chunk: types.ImageChunk, where: str) -> tuple[int, dict[str, torch.Tensor]]:
        processor = self._processor
        ref = ImageRef(data=chunk.data)
        try:
            with open_image(ref, where) as img:
                actual = img.format
            if actual != PIL_FORMATS[chunk.format]:
                raise ValueError(
                    f"{where}: the ImageChunk says format={chunk.format!r} but its bytes are {actual}"
                )
            image = load_image(ref, None, None, where)  # resized once, by the processor, as on a client
            count = image_token_count(processor, image.width, image.height)
            return count, multi_modal_inputs(processor, [image], [count], where)
        except DataError as exc:
            raise ValueError(str(exc)) from None


def check_no_image_token(model_input: types.ModelInput, image_token: int, what: str) -> None:
    """A token chunk must not hold the image token: the model would look for an image that is not there."""
    for j, chunk in enumerate(model_input.chunks):
        if isinstance(chunk, types.EncodedTextChunk) and image_token in chunk.tokens:
            raise ValueError(
                f"{what}: chunk {j}: a token chunk holds the image token ({image_token}) as text: an image is "
                "an ImageChunk, which expands to its image tokens itself"
            )


def concat_images(images: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One row's images, in order, as one `multi_modal_inputs` entry ({} for none)."""
    if not images:
        return {}
    return {
        "pixel_values": torch.cat([i["pixel_values"] for i in images]),
        "image_grid_thw": torch.cat([i["image_grid_thw"] for i in images]),
    }
