"""Tests for posttrain/models/tiny.py: presets, parameter counts, save and load back."""

import json

import pytest
import torch

from posttrain.errors import ConfigError
from posttrain.models import PRESETS, build_tiny_model, load_causal_lm, load_tokenizer, make_tiny_model

from .conftest import CORPUS

TARGETS = {"tiny": 1e6, "small": 10e6, "medium": 50e6}
# The counts written in the tiny.py module docstring table; keep them true.
DOCUMENTED = {"tiny": 1_017_984, "small": 10_498_304, "medium": 49_441_536}


@pytest.mark.parametrize("preset", sorted(TARGETS))
def test_parameter_counts_near_targets(preset):
    model = build_tiny_model(preset)
    n = sum(p.numel() for p in model.parameters())  # tied lm_head is counted once
    assert n == DOCUMENTED[preset]
    assert 0.8 * TARGETS[preset] <= n <= 1.2 * TARGETS[preset]
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_presets_are_valid_qwen2_shapes():
    for preset in PRESETS.values():
        assert preset.hidden_size % preset.num_attention_heads == 0
        assert preset.num_attention_heads % preset.num_key_value_heads == 0


def test_init_is_seeded_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = build_tiny_model("tiny", seed=1)
    after = torch.rand(3)
    b = build_tiny_model("tiny", seed=1)
    c = build_tiny_model("tiny", seed=2)
    assert torch.equal(expected, after)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)
    std = a.model.layers[0].mlp.up_proj.weight.std().item()
    assert abs(std - 0.02) < 0.002


def test_directory_loads_back_with_same_logits(tiny_dir):
    tokenizer = load_tokenizer(tiny_dir)
    model = load_causal_lm(tiny_dir)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    reference = build_tiny_model("tiny", seed=0, bos_token_id=pad, eos_token_id=eos, pad_token_id=pad)

    ids = torch.tensor([tokenizer.encode("Question: what is 12 + 30? Answer: 42.")])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    assert model.dtype == torch.float32
    assert model.config.tie_word_embeddings


def test_directory_contents_and_token_ids(tiny_dir):
    assert (tiny_dir / "model.safetensors").is_file()
    assert (tiny_dir / "tokenizer.json").is_file()
    config = json.loads((tiny_dir / "config.json").read_text())
    generation = json.loads((tiny_dir / "generation_config.json").read_text())
    tokenizer = load_tokenizer(tiny_dir)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (pad, eos, pad)
    assert generation["eos_token_id"] == [eos, pad]
    assert generation["pad_token_id"] == pad
    assert len(tokenizer) <= config["vocab_size"]
    assert tokenizer.model_max_length == PRESETS["tiny"].max_position_embeddings


def test_loaded_model_generates_until_eos_or_limit(tiny_dir):
    tokenizer = load_tokenizer(tiny_dir)
    model = load_causal_lm(tiny_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+1?"}], tokenize=False, add_generation_prompt=True
    )
    ids = torch.tensor([tokenizer.encode(prompt)])
    out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape[0] == 1 and ids.shape[1] < out.shape[1] <= ids.shape[1] + 5


def test_same_seed_same_directory_weights(tmp_path):
    a = make_tiny_model("tiny", tmp_path / "a", CORPUS, seed=0)
    b = make_tiny_model("tiny", tmp_path / "b", CORPUS, seed=0)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_text() == (b / "tokenizer.json").read_text()


def test_unknown_preset_lists_presets(tmp_path):
    with pytest.raises(ConfigError, match="tiny, small, medium"):
        make_tiny_model("huge", tmp_path / "m", CORPUS)
