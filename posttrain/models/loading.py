"""The one way models, tokenizers and configs are loaded: from a local Hugging Face directory.

Works the same for a tiny model from `make_tiny_model` and a real checkpoint (e.g. Qwen2.5-0.5B);
nothing here knows about tiny models, and nothing is ever fetched from a hub.
Must not import posttrain.data or anything above models/.
"""

import logging
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from posttrain.errors import ModelError

logger = logging.getLogger(__name__)

# Any one of these is enough for AutoTokenizer to build a tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "tiktoken.model")
# The image processor's backend, always named: left unset, transformers 5 picks the torchvision class whenever
# torchvision imports, and a torchvision wheel is built for one torch release (issue 20: never depend on it).
IMAGE_PROCESSOR_BACKEND = "pil"
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def _require_dir(path: str | Path) -> Path:
    """Return `path` as a Path if it is an existing directory, else raise ModelError."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ModelError(
            f"model directory not found: {path} (only local directories are loaded; download the model first)"
        )
    return p


def _require_config(p: Path) -> None:
    """Raise ModelError unless `p` holds a config.json."""
    if not (p / "config.json").is_file():
        raise ModelError(f"no config.json in {p}")


def _require_tokenizer(p: Path) -> None:
    """Raise ModelError unless `p` holds at least one file a tokenizer can be built from."""
    if not any((p / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelError(f"no tokenizer files in {p}: expected one of {', '.join(_TOKENIZER_FILES)}")


def _require_weights(p: Path) -> None:
    """Raise ModelError unless `p` holds model weights (single file or sharded index)."""
    if not any((p / name).is_file() for name in _WEIGHT_FILES):
        raise ModelError(f"no model weights in {p}: expected one of {', '.join(_WEIGHT_FILES)}")


def check_model_dir(path: str | Path) -> Path:
    """Check, without loading anything, that `path` is a complete model directory; return it as a Path.

    Meant for config validation at start, so a wrong path fails in a second instead of after Ray starts.
    """
    p = _require_dir(path)
    _require_config(p)
    _require_tokenizer(p)
    _require_weights(p)
    return p


def load_config(path: str | Path) -> PretrainedConfig:
    """Load the model config (config.json) of a local directory."""
    p = _require_dir(path)
    _require_config(p)
    try:
        return AutoConfig.from_pretrained(p, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ModelError(f"cannot load config from {p}: {e}") from e


def is_vision_language(path_or_config: str | Path | PretrainedConfig) -> bool:
    """Whether a directory (or its config) holds a vision-language model: a config with a vision tower."""
    config = path_or_config if isinstance(path_or_config, PretrainedConfig) else load_config(path_or_config)
    return getattr(config, "vision_config", None) is not None


def load_text_config(path: str | Path) -> PretrainedConfig:
    """The language model's config: a vision-language model's `text_config` (its sizes and context), else the
    directory's config itself."""
    config = load_config(path)
    return getattr(config, "text_config", None) or config


def load_causal_lm(
    path: str | Path,
    dtype: torch.dtype | str = torch.float32,
    attn_implementation: str = "sdpa",
) -> PreTrainedModel:
    """Load a causal LM from a local directory in `dtype` (float32 by default, never the hub's "auto").

    The model is returned in eval mode on CPU; the engine moves, shards and switches it to train mode.
    A vision-language directory (e.g. Qwen2-VL) loads as its image-text-to-text model (vision tower included).
    """
    p = _require_dir(path)
    _require_config(p)
    _require_weights(p)
    auto = AutoModelForImageTextToText if is_vision_language(p) else AutoModelForCausalLM
    try:
        model = auto.from_pretrained(
            p, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
        )
    except (OSError, ValueError, KeyError, ImportError) as e:
        raise ModelError(f"cannot load causal LM from {p}: {e}") from e
    return model.eval()


def empty_model(path: str | Path) -> PreTrainedModel:
    """The causal LM of a directory's config on the meta device: module names and shapes, no memory."""
    config = load_config(path)
    auto = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(config)


def load_value_model(
    path: str | Path,
    dtype: torch.dtype | str = torch.float32,
    attn_implementation: str = "sdpa",
) -> PreTrainedModel:
    """A critic: the same architecture with a one-output token head (`...ForTokenClassification`).

    From an actor's directory the head is freshly initialised (transformers logs the new `score` weights);
    from a saved critic's directory it is restored.
    """
    from transformers import AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    p = _require_dir(path)
    _require_config(p)
    _require_weights(p)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the missing `score` head is expected from an actor's directory
    try:
        model = AutoModelForTokenClassification.from_pretrained(
            p, num_labels=1, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
        )
    except (OSError, ValueError, KeyError, ImportError) as e:
        raise ModelError(f"cannot load a value model (token-classification head) from {p}: {e}") from e
    finally:
        hf_logging.set_verbosity(verbosity)
    logger.info("loaded value model from %s (a new value head unless the directory holds a critic)", p)
    return model.eval()


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load the tokenizer of a local directory, making sure it has a pad token (eos if none is set).

    Batching needs a pad id; padded positions are masked, so reusing eos is safe.
    """
    p = _require_dir(path)
    _require_tokenizer(p)
    try:
        tokenizer = AutoTokenizer.from_pretrained(p, local_files_only=True)
    except (OSError, ValueError, KeyError, ImportError) as e:
        raise ModelError(f"cannot load tokenizer from {p}: {e}") from e
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelError(f"tokenizer in {p} has neither a pad token nor an eos token to pad with")
        tokenizer.pad_token = tokenizer.eos_token
        logger.info("tokenizer in %s has no pad token; using eos token %r", p, tokenizer.eos_token)
    return tokenizer


def save_tokenizer_as_is(path: str | Path, out_dir: str | Path) -> None:
    """The tokenizer of `path` saved into `out_dir` as the directory has it: not `load_tokenizer`'s, whose pad
    token (eos, when the model has none) would be written into the export, where HF/TRL collators that mask
    the pad label would then drop eos from the loss."""
    p = _require_dir(path)
    _require_tokenizer(p)
    try:
        AutoTokenizer.from_pretrained(p, local_files_only=True).save_pretrained(str(out_dir))
    except (OSError, ValueError, KeyError, ImportError) as e:
        raise ModelError(f"cannot save the tokenizer of {p}: {e}") from e


def load_image_processor(
    path: str | Path, min_pixels: int | None = None, max_pixels: int | None = None
) -> Any:
    """The PIL image processor of a vision-language directory, its resize bounds (`size`: shortest_edge and
    longest_edge, in pixels) replaced by `min_pixels` / `max_pixels` where given (None: the directory's own).

    Asked for by backend (`IMAGE_PROCESSOR_BACKEND`, Pillow), so an installed torchvision is never chosen nor
    imported. A directory without preprocessor_config.json, or bounds that are not 1 <= min <= max, are a
    ModelError.
    """
    p = _require_dir(path)
    if not (p / "preprocessor_config.json").is_file():
        raise ModelError(f"no preprocessor_config.json in {p}: not a vision-language model directory")
    bounds = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
    try:
        image_processor = AutoImageProcessor.from_pretrained(
            p, local_files_only=True, backend=IMAGE_PROCESSOR_BACKEND, **bounds
        )
    except (OSError, ValueError, KeyError, ImportError) as e:
        raise ModelError(f"cannot load the image processor from {p}: {e}") from e
    lo, hi = int(image_processor.size.shortest_edge), int(image_processor.size.longest_edge)
    if not 1 <= lo <= hi:
        raise ModelError(
            f"image pixel bounds of {p} must satisfy 1 <= min_pixels <= max_pixels, got {lo} and {hi}"
        )
    return image_processor


def load_processor(path: str | Path, min_pixels: int | None = None, max_pixels: int | None = None) -> Any:
    """The image + text processor of a vision-language directory (tokenizer and PIL image processor, with the
    pixel bounds of `load_image_processor`: the directory's own unless given).

    Returns `posttrain.models.vl.VLProcessor`, which needs no torchvision (transformers 5's `Qwen2VLProcessor`
    does). Every image it processes, and every image-token count taken from it, uses the same bounds.
    """
    from posttrain.models.vl import VLProcessor

    p = _require_dir(path)
    return VLProcessor(load_image_processor(p, min_pixels, max_pixels), load_tokenizer(p))
