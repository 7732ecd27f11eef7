"""The images' pixel bounds of a run (`data.min_pixels`, `data.max_pixels`): checked at start, and the one
processor every image of the run goes through.

A vision-language model's image processor resizes each image so that its area (width * height, in pixels)
lies within [min_pixels, max_pixels], and the image becomes one token per merged patch of the resized image.
Unset, a bound is the model's own (its `preprocessor_config.json`). Set, it replaces the model's in the
processor itself (`models.load_processor`), so the datasets' resize (`data.images.load_image`), their token
counts against `data.max_prompt_length`, the pixels the processor makes and the agent loop's observations all
use the same bounds. Setting either on a model without a vision tower is an error, never ignored.
"""

from __future__ import annotations

from typing import Any

from posttrain.config.schema import DataConfig
from posttrain.data.template_options import with_template_kwargs
from posttrain.errors import ConfigError
from posttrain.models import is_vision_language, load_image_processor, load_processor


def pixel_bounds_set(data: DataConfig) -> bool:
    """Whether the run sets either bound."""
    return data.min_pixels is not None or data.max_pixels is not None


def check_pixel_bounds(data: DataConfig, model_path: str) -> None:
    """Each set bound a positive integer, min <= max (a bound left unset taken from the model), and only on
    a vision-language model; the errors name the keys and, where one is the model's, its value."""
    if not pixel_bounds_set(data):
        return
    given = {
        k: v
        for k, v in (("data.min_pixels", data.min_pixels), ("data.max_pixels", data.max_pixels))
        if v is not None
    }
    if not is_vision_language(model_path):
        raise ConfigError(
            f"{' and '.join(f'{k}={v}' for k, v in given.items())} set, but model.path={model_path} has no vision "
            "tower: pixel bounds are for the images of a vision-language model; leave them unset (null)"
        )
    for key, value in given.items():
        if value < 1:
            raise ConfigError(f"{key}={value}: an image's area in pixels, must be a positive integer")
    own = load_image_processor(model_path).size
    lo = (
        (data.min_pixels, "data.min_pixels")
        if data.min_pixels is not None
        else (int(own.shortest_edge), "the model's min_pixels")
    )
    hi = (
        (data.max_pixels, "data.max_pixels")
        if data.max_pixels is not None
        else (int(own.longest_edge), "the model's max_pixels")
    )
    if lo[0] > hi[0]:
        raise ConfigError(
            f"{lo[1]}={lo[0]} is above {hi[1]}={hi[0]} (model.path={model_path}): "
            "the bounds must satisfy data.min_pixels <= data.max_pixels"
        )


def run_processor(model_path: str, data: DataConfig) -> Any:
    """The vision-language processor of a run: the model's, with the run's pixel bounds where set."""
    processor = load_processor(model_path, data.min_pixels, data.max_pixels)
    return with_template_kwargs(processor, data.apply_chat_template_kwargs, model_path)
