"""Tests for posttrain/models/vl.py: the tiny-vl preset, its HF directory, the torchvision-free processor."""

import importlib.abc
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw
from transformers import (
    AutoImageProcessor,
    AutoModelForImageTextToText,
    AutoTokenizer,
    Qwen2Config,
    Qwen2VLForConditionalGeneration,
)

from posttrain.cli import main
from posttrain.errors import ConfigError, ModelError
from posttrain.models import load_causal_lm, load_tokenizer, make_tiny_model
from posttrain.models.loading import empty_model, is_vision_language, load_processor
from posttrain.models.tokenizer import CHAT_TEMPLATE, VISION_TOKENS, VL_CHAT_TEMPLATE
from posttrain.models.vl import VL_PRESETS, build_tiny_vl_model, get_vl_preset

from .conftest import CORPUS

DOCUMENTED = {"tiny-vl": 662_400}  # the count in the vl.py module docstring table


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("tiny-vl", tmp_path_factory.mktemp("tiny_vl") / "model", CORPUS, seed=0)


def square(size: tuple[int, int], color: str) -> Image.Image:
    img = Image.new("RGB", size, "white")
    ImageDraw.Draw(img).rectangle((5, 5, 25, 25), fill=color)
    return img


def user_with_image(text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


def test_parameter_count_and_sizes():
    ids = {t: 300 + i for i, t in enumerate(VISION_TOKENS)} | {"pad": 0, "eos": 2}
    model = build_tiny_vl_model("tiny-vl", ids)
    assert sum(p.numel() for p in model.parameters()) == DOCUMENTED["tiny-vl"]
    assert len(model.model.visual.blocks) == 2
    assert len(model.model.language_model.layers) == 2
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
    spec = VL_PRESETS["tiny-vl"]
    head_dim = spec.hidden_size // spec.num_attention_heads
    assert sum(spec.mrope_section) == head_dim // 2


def test_unknown_preset_lists_the_vl_presets():
    with pytest.raises(ConfigError, match="tiny-vl"):
        get_vl_preset("huge-vl")
    with pytest.raises(ConfigError, match="tiny-vl"):
        make_tiny_model("nope", "/tmp/never-written", CORPUS)


def test_directory_loads_with_transformers_auto_classes(vl_dir):
    model = AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32)
    assert isinstance(model, Qwen2VLForConditionalGeneration)
    image_processor = AutoImageProcessor.from_pretrained(vl_dir)
    assert type(image_processor).__name__ == "Qwen2VLImageProcessorPil"  # no torchvision needed
    assert (image_processor.patch_size, image_processor.merge_size) == (14, 2)
    tok = AutoTokenizer.from_pretrained(vl_dir)
    cfg = model.config
    assert tok.convert_tokens_to_ids("<|image_pad|>") == cfg.image_token_id
    assert tok.convert_tokens_to_ids("<|vision_start|>") == cfg.vision_start_token_id
    assert tok.convert_tokens_to_ids("<|vision_end|>") == cfg.vision_end_token_id
    assert len(tok) <= cfg.text_config.vocab_size
    # each vision token is one token, never split by BPE
    assert tok.encode("<|vision_start|><|image_pad|><|vision_end|>", add_special_tokens=False) == [
        cfg.vision_start_token_id,
        cfg.image_token_id,
        cfg.vision_end_token_id,
    ]


def test_loading_detects_a_vl_directory(vl_dir):
    assert is_vision_language(vl_dir)
    assert not is_vision_language(Qwen2Config(num_hidden_layers=1))
    assert isinstance(load_causal_lm(vl_dir), Qwen2VLForConditionalGeneration)
    assert isinstance(empty_model(vl_dir), Qwen2VLForConditionalGeneration)


def test_load_processor_needs_a_preprocessor_config(tmp_path):
    with pytest.raises(ModelError, match="preprocessor_config.json"):
        load_processor(tmp_path)


class _RefuseTorchvision(importlib.abc.MetaPathFinder):
    """An import hook under which importing torchvision fails: the test's proof it is never imported."""

    def find_spec(self, fullname, path, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            raise AssertionError(f"{fullname} was imported")
        return None


def test_load_processor_picks_the_pil_class_even_where_torchvision_is_available(vl_dir, monkeypatch):
    """With torchvision reported importable, transformers' unset backend would be torchvision: load_processor
    must ask for the Pillow class by name and never import torchvision."""
    from transformers.models.auto import image_processing_auto

    monkeypatch.setattr(image_processing_auto, "is_torchvision_available", lambda: True)
    assert image_processing_auto._resolve_backend(None, None, "Qwen2VLImageProcessor") == "torchvision"
    requested: list[str] = []
    load_class = image_processing_auto._load_class_with_fallback

    def spy(mapping, backend):
        requested.append(backend)
        return load_class(mapping, backend)

    monkeypatch.setattr(image_processing_auto, "_load_class_with_fallback", spy)
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_RefuseTorchvision(), *sys.meta_path])

    processor = load_processor(vl_dir)

    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    assert requested and set(requested) == {"pil"}
    assert not any(m == "torchvision" or m.startswith("torchvision.") for m in sys.modules)


def test_chat_template_renders_image_parts_and_strings_as_before(vl_dir):
    tok = load_tokenizer(vl_dir)
    text = tok.apply_chat_template(user_with_image("Color?"), add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Color?<|im_end|>\n<|im_start|>assistant\n"
    )
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    tok.chat_template = CHAT_TEMPLATE
    plain = tok.apply_chat_template(msgs, tokenize=False)
    tok.chat_template = VL_CHAT_TEMPLATE
    assert tok.apply_chat_template(msgs, tokenize=False) == plain


def test_processor_round_trip_through_the_model(vl_dir):
    proc = load_processor(vl_dir)
    model = load_causal_lm(vl_dir)
    text = proc.apply_chat_template(user_with_image("Color?"), add_generation_prompt=True, tokenize=False)
    images = [square((56, 56), "red"), square((200, 120), "blue")]  # different sizes, different token counts
    out = proc(text=[text, text], images=images)
    grids = out["image_grid_thw"]
    assert grids.tolist() == [[1, 4, 4], [1, 6, 10]]  # the larger one shrunk to max_pixels
    n_tokens = (out["input_ids"] == proc.image_token_id).sum(dim=1)
    assert n_tokens.tolist() == [4, 15]  # t*h*w / merge**2
    assert torch.equal(out["mm_token_type_ids"].bool(), out["input_ids"] == proc.image_token_id)
    assert out["pixel_values"].shape == (int(grids.prod(dim=-1).sum()), 3 * 2 * 14 * 14)
    with torch.no_grad():
        logits = model(**out).logits
    assert logits.shape[:2] == out["input_ids"].shape and torch.isfinite(logits).all()
    # the image changes what the model predicts (the vision tower is wired in)
    red = proc(text=[text], images=[square((56, 56), "red")])
    green = proc(text=[text], images=[square((56, 56), "green")])
    with torch.no_grad():
        assert not torch.allclose(model(**red).logits[0, -1], model(**green).logits[0, -1])


def test_processor_rejects_placeholder_and_image_count_mismatch(vl_dir):
    proc = load_processor(vl_dir)
    with pytest.raises(ModelError, match="placeholders than images"):
        proc(text=["<|image_pad|><|image_pad|>"], images=[square((56, 56), "red")])
    with pytest.raises(ModelError, match="more images"):
        proc(text=["<|image_pad|>"], images=[square((56, 56), "red")] * 2)


def test_make_model_command_writes_a_vl_directory(tmp_path):
    out = tmp_path / "m"
    assert main(["make-model", "--preset", "tiny-vl", "--out", str(out), "--corpus-size", "300"]) == 0
    assert (out / "preprocessor_config.json").is_file()
    assert is_vision_language(out)


def test_load_processor_takes_pixel_bounds(vl_dir):
    """Given bounds replace the directory's own in the image processor (one given: the other kept), so its
    resize and its token counts agree; bounds that are not 1 <= min <= max are a ModelError."""
    own = load_processor(vl_dir).image_processor
    assert (own.size.shortest_edge, own.size.longest_edge) == (56 * 56, 112 * 112)
    ip = load_processor(vl_dir, 28 * 28, 56 * 56).image_processor
    assert (ip.size.shortest_edge, ip.size.longest_edge) == (28 * 28, 56 * 56)
    assert ip.get_number_of_image_patches(112, 112, {}) // 4 == 4
    assert ip(images=[square((112, 112), "red")], return_tensors="pt")["image_grid_thw"].tolist() == [
        [1, 4, 4]
    ]
    one = load_processor(vl_dir, max_pixels=80 * 80).image_processor
    assert (one.size.shortest_edge, one.size.longest_edge) == (56 * 56, 80 * 80)
    with pytest.raises(ModelError, match="1 <= min_pixels <= max_pixels, got 3136 and 1000"):
        load_processor(vl_dir, max_pixels=1000)
