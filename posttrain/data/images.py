"""Images of multimodal rows (verl's format): references, lazy opening, decoding and resizing with Pillow.

A row's `images` column holds one entry per `<image>` placeholder in its prompt, in order: a path (str), raw
bytes, or a dict `{"bytes": ...}` / `{"path": ...}` (the form Hugging Face `datasets` writes to parquet).
A relative path is taken relative to the dataset file's folder. Nothing is decoded until `load_image`; only
the header is read to size an image (`image_size`). Every failure is a DataError naming the row and image.
This module must not import engine, rollout, worker, Ray or model code.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from posttrain.errors import DataError

IMAGE_PLACEHOLDER = "<image>"  # verl's placeholder for an image inside a prompt message's text


@dataclass(frozen=True)
class ImageRef:
    """Where an image's bytes are: a file, or the bytes themselves (exactly one is set)."""

    path: Path | None = None
    data: bytes | None = None

    def describe(self) -> str:
        return str(self.path) if self.path is not None else f"<{len(self.data or b'')} bytes>"


def parse_image_refs(row: dict, key: str, base_dir: Path, where: str) -> list[ImageRef]:
    """The row's images as references (an absent or null column: no images); a malformed entry is a DataError."""
    value = row.get(key)
    if value is None:
        return []
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, list | tuple):
        raise DataError(f"{where}: field {key!r} must be a list of images, got {type(value).__name__}")
    refs = []
    for j, entry in enumerate(value):
        if isinstance(entry, dict):
            if entry.get("bytes") is not None:
                entry = entry["bytes"]
            elif entry.get("path") is not None:
                entry = entry["path"]
            else:
                raise DataError(f"{where}: image {j}: a dict entry needs 'bytes' or 'path'")
        if isinstance(entry, bytes | bytearray):
            refs.append(ImageRef(data=bytes(entry)))
        elif isinstance(entry, str | Path):
            path = Path(entry).expanduser()
            refs.append(ImageRef(path=path if path.is_absolute() else base_dir / path))
        else:
            raise DataError(
                f"{where}: image {j}: expected a path, bytes or a dict with 'bytes'/'path', got {type(entry).__name__}"
            )
    return refs


# The most pixels an image may have before it is decoded (its header says how many): a few hundred KB of
# PNG can declare a canvas that takes gigabytes to decode, before it is resized to the model's bounds.
# 50M pixels is 150 MB as RGB, far above any vision model's input (Qwen2-VL's max_pixels is ~12.8M).
MAX_SOURCE_PIXELS = 50_000_000
# The longest side over the shortest that Qwen2-VL's image processor (smart_resize) takes
MAX_ASPECT_RATIO = 200


def open_image(ref: ImageRef, where: str) -> Image.Image:
    """Open an image lazily (Pillow reads the header; pixels are decoded on first use). One whose header
    declares more than MAX_SOURCE_PIXELS is refused before anything is decoded."""
    try:
        if ref.path is not None:
            img = Image.open(ref.path)
        else:
            img = Image.open(io.BytesIO(ref.data or b""))
    except FileNotFoundError as e:
        raise DataError(f"{where}: image file not found: {ref.describe()}") from e
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError) as e:
        raise DataError(f"{where}: cannot read image {ref.describe()}: {e}") from e
    if img.width * img.height > MAX_SOURCE_PIXELS:
        img.close()
        raise DataError(
            f"{where}: image {ref.describe()} is {img.width}x{img.height} pixels, more than the "
            f"{MAX_SOURCE_PIXELS:,} decoded before resizing (posttrain.data.images.MAX_SOURCE_PIXELS)"
        )
    if max(img.width, img.height) > MAX_ASPECT_RATIO * min(img.width, img.height):
        img.close()
        raise DataError(
            f"{where}: image {ref.describe()} is {img.width}x{img.height} pixels, an aspect ratio over the "
            f"{MAX_ASPECT_RATIO} the vision model's image processor takes"
        )
    return img


def fit_pixels(width: int, height: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(width, height) scaled, aspect kept, so that width * height lies within [min_pixels, max_pixels]
    (verl's `process_image`); the processor then rounds each side to its patch grid."""
    if min_pixels > max_pixels:
        raise DataError(f"min_pixels ({min_pixels}) is larger than max_pixels ({max_pixels})")
    area = width * height
    if area > max_pixels:  # rounded, not truncated: a thin image keeps its aspect ratio
        scale = math.sqrt(max_pixels / area)
        width, height = round(width * scale), round(height * scale)
    elif area < min_pixels:
        scale = math.sqrt(min_pixels / area)
        width, height = math.ceil(width * scale), math.ceil(height * scale)
    return max(width, 1), max(height, 1)


def image_size(ref: ImageRef, min_pixels: int | None, max_pixels: int | None, where: str) -> tuple[int, int]:
    """The (width, height) `load_image` will return, from the header alone."""
    with open_image(ref, where) as img:
        if min_pixels is None or max_pixels is None:
            return img.width, img.height
        return fit_pixels(img.width, img.height, min_pixels, max_pixels)


def load_image(ref: ImageRef, min_pixels: int | None, max_pixels: int | None, where: str) -> Image.Image:
    """Decode an image as RGB (transparent pixels on white, as Hugging Face's image processors do), resized
    into the pixel bounds (bicubic; verl's dataset pre-resize), or as it is when they are None (the
    processor's own resize then is the only one, as when a client counts its tokens with the processor)."""
    with open_image(ref, where) as img:
        try:
            rgb = _rgb(img)  # decodes; a truncated file fails here
        except (OSError, ValueError) as e:
            raise DataError(f"{where}: cannot decode image {ref.describe()}: {e}") from e
    if min_pixels is None or max_pixels is None:
        return rgb
    size = fit_pixels(rgb.width, rgb.height, min_pixels, max_pixels)
    return rgb if size == rgb.size else rgb.resize(size, Image.Resampling.BICUBIC)


def _rgb(img: Image.Image) -> Image.Image:
    """RGB, with an image's transparency composited onto white (Pillow's plain conversion drops the alpha
    channel and shows what the transparent pixels hide, often black)."""
    if img.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def split_image_placeholders(
    messages: list[dict[str, Any]], n_images: int, where: str
) -> list[dict[str, Any]]:
    """Messages whose text holds `<image>` placeholders as content parts ({"type": "text"} / {"type": "image"}),
    the form a vision-language chat template renders; the placeholder count must equal the row's images."""
    out: list[dict[str, Any]] = []
    found = 0
    for msg in messages:
        content = msg["content"]
        if IMAGE_PLACEHOLDER not in content:
            out.append(msg)
            continue
        parts: list[dict[str, str]] = []
        for k, piece in enumerate(content.split(IMAGE_PLACEHOLDER)):
            if k:
                parts.append({"type": "image"})
                found += 1
            if piece:
                parts.append({"type": "text", "text": piece})
        out.append({**msg, "content": parts})
    if found != n_images:
        raise DataError(
            f"{where}: the prompt has {found} {IMAGE_PLACEHOLDER} placeholders but {n_images} images"
        )
    return out
