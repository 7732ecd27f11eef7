"""Tests for posttrain/models/loading.py: directory checks with actionable errors, pad-token fallback."""

import logging
import shutil

import pytest

from posttrain.errors import ModelError
from posttrain.models import check_model_dir, load_causal_lm, load_config, load_tokenizer


def test_check_model_dir_accepts_complete_dir(tiny_dir):
    assert check_model_dir(str(tiny_dir)) == tiny_dir


def test_missing_directory(tmp_path):
    missing = tmp_path / "nope"
    for fn in (check_model_dir, load_causal_lm, load_tokenizer, load_config):
        with pytest.raises(ModelError, match="model directory not found"):
            fn(missing)


def test_hub_name_is_not_downloaded():
    with pytest.raises(ModelError, match="model directory not found: Qwen/Qwen2.5-0.5B"):
        load_causal_lm("Qwen/Qwen2.5-0.5B")


def test_missing_config(tiny_dir, tmp_path):
    d = shutil.copytree(tiny_dir, tmp_path / "m")
    (d / "config.json").unlink()
    with pytest.raises(ModelError, match="no config.json in"):
        check_model_dir(d)
    with pytest.raises(ModelError, match="no config.json in"):
        load_causal_lm(d)


def test_missing_tokenizer_files(tiny_dir, tmp_path):
    d = shutil.copytree(tiny_dir, tmp_path / "m")
    (d / "tokenizer.json").unlink()
    with pytest.raises(ModelError, match="no tokenizer files in"):
        check_model_dir(d)
    with pytest.raises(ModelError, match="no tokenizer files in"):
        load_tokenizer(d)


def test_missing_weights(tiny_dir, tmp_path):
    d = shutil.copytree(tiny_dir, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelError, match="no model weights in"):
        check_model_dir(d)
    with pytest.raises(ModelError, match="no model weights in"):
        load_causal_lm(d)


def test_load_config(tiny_dir):
    config = load_config(tiny_dir)
    assert config.model_type == "qwen2"
    assert config.hidden_size == 128


def test_load_in_bfloat16(tiny_dir):
    model = load_causal_lm(tiny_dir, dtype="bfloat16", attn_implementation="eager")
    assert next(model.parameters()).dtype.is_floating_point
    assert model.dtype.itemsize == 2
    assert model.config._attn_implementation == "eager"


def test_pad_token_falls_back_to_eos(tiny_dir, tmp_path, caplog):
    d = shutil.copytree(tiny_dir, tmp_path / "m")
    tokenizer = load_tokenizer(d)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(d)
    with caplog.at_level(logging.INFO, logger="posttrain.models.loading"):
        reloaded = load_tokenizer(d)
    assert reloaded.pad_token == reloaded.eos_token == "<|im_end|>"
    assert "no pad token" in caplog.text
