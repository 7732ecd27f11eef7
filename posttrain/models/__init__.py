"""Models: loading from a local Hugging Face directory and the tiny-model factory.

Must not import posttrain.data or anything above models/.
"""

from posttrain.models.loading import (
    check_model_dir,
    empty_model,
    load_causal_lm,
    load_config,
    load_tokenizer,
    load_value_model,
)
from posttrain.models.tiny import PRESETS, TinyPreset, build_tiny_model, make_tiny_model
from posttrain.models.tokenizer import CHAT_TEMPLATE, train_tokenizer

__all__ = [
    "CHAT_TEMPLATE",
    "PRESETS",
    "TinyPreset",
    "build_tiny_model",
    "check_model_dir",
    "empty_model",
    "load_causal_lm",
    "load_config",
    "load_tokenizer",
    "load_value_model",
    "make_tiny_model",
    "train_tokenizer",
]
