"""Models: loading from a local Hugging Face directory (text or vision-language) and the tiny-model factory.

Must not import posttrain.data or anything above models/.
"""

from posttrain.models.loading import (
    check_model_dir,
    empty_model,
    is_vision_language,
    load_causal_lm,
    load_config,
    load_image_processor,
    load_processor,
    load_text_config,
    load_tokenizer,
    load_value_model,
    save_tokenizer_as_is,
)
from posttrain.models.tiny import PRESETS, MoePreset, TinyPreset, build_tiny_model, make_tiny_model
from posttrain.models.tokenizer import CHAT_TEMPLATE, VL_CHAT_TEMPLATE, train_tokenizer
from posttrain.models.vl import VL_PRESETS, VLProcessor, make_tiny_vl_model

__all__ = [
    "CHAT_TEMPLATE",
    "MoePreset",
    "PRESETS",
    "VL_CHAT_TEMPLATE",
    "VL_PRESETS",
    "VLProcessor",
    "TinyPreset",
    "build_tiny_model",
    "check_model_dir",
    "empty_model",
    "is_vision_language",
    "load_causal_lm",
    "load_config",
    "load_image_processor",
    "load_processor",
    "load_text_config",
    "load_tokenizer",
    "load_value_model",
    "make_tiny_model",
    "make_tiny_vl_model",
    "save_tokenizer_as_is",
    "train_tokenizer",
]
