"""Models built on one tokenizer (`make-model --tokenizer-from`), and the check that a teacher shares it."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.errors import ConfigError
from posttrain.models import load_config, load_tokenizer, make_tiny_model
from posttrain.models.shared_tokenizer import check_same_tokenizer, tokenizer_difference
from tests.models.conftest import CORPUS


def test_tokenizer_from_gives_the_same_tokenizer_and_vocabulary_width(tiny_dir: Path, tmp_path: Path) -> None:
    # a larger preset (its own vocab_size is 4096) on the tiny model's 1024-token tokenizer
    other = make_tiny_model("small", tmp_path / "small", [], seed=1, tokenizer_from=tiny_dir)
    assert tokenizer_difference(load_tokenizer(tiny_dir), load_tokenizer(other)) is None
    assert load_config(other).vocab_size == load_config(tiny_dir).vocab_size
    assert load_config(other).num_hidden_layers == 12
    check_same_tokenizer(tiny_dir, other)  # no error


def test_cli_make_model_tokenizer_from(tiny_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "teacher"
    assert (
        main(
            [
                "make-model",
                "--preset",
                "tiny",
                "--seed",
                "3",
                "--out",
                str(out),
                "--tokenizer-from",
                str(tiny_dir),
            ]
        )
        == 0
    )
    assert f"tokenizer of {tiny_dir}" in capsys.readouterr().out
    assert load_tokenizer(out).get_vocab() == load_tokenizer(tiny_dir).get_vocab()
    assert (out / "model.safetensors").read_bytes() != (tiny_dir / "model.safetensors").read_bytes()


def test_a_different_tokenizer_is_refused_naming_both_paths_and_the_token(
    tiny_dir: Path, tmp_path: Path
) -> None:
    other = make_tiny_model("tiny", tmp_path / "other", [t.upper() for t in CORPUS] + ["zebra " * 5], seed=0)
    with pytest.raises(ConfigError) as info:
        check_same_tokenizer(tiny_dir, other)
    message = str(info.value)
    assert str(tiny_dir) in message and str(other) in message
    assert "token id" in message and "--tokenizer-from" in message


def test_a_different_special_token_is_refused(tiny_dir: Path) -> None:
    student, teacher = load_tokenizer(tiny_dir), load_tokenizer(tiny_dir)
    teacher.eos_token = "<|im_start|>"
    assert "eos_token" in (tokenizer_difference(student, teacher) or "")
