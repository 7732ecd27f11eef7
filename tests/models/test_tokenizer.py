"""Tests for posttrain/models/tokenizer.py: round-trip, digit splitting, special tokens, chat template."""

import pytest

from posttrain.errors import ConfigError
from posttrain.models import train_tokenizer

from .conftest import CORPUS


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(CORPUS, vocab_size=512)


@pytest.mark.parametrize(
    "text",
    [
        "hello world",
        "  two leading spaces and trailing  ",
        "line one\nline two\n\n\tindented\r\nwindows",
        "12345 + 678 = 13023",
        "Unicode: café, naïve, 日本語, emoji 🚀 (not all in the corpus: ÆØÅ ß ✓)",
        "",
        " ",
        "\n",
        "<|im_start|>user\nhi<|im_end|>\n",
    ],
)
def test_decode_encode_round_trips(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text


def test_digits_are_single_tokens(tokenizer):
    # The corpus is full of numbers, yet BPE must never merge digits: arithmetic sees one digit per token.
    tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode("9876543210"))
    assert tokens == list("9876543210")
    assert all(not any(c.isdigit() for c in t) or len(t) == 1 for t in tokenizer.get_vocab())


def test_bpe_learned_merges_within_vocab_size(tokenizer):
    assert 256 + 3 < len(tokenizer) <= 512
    assert len(tokenizer.encode("Question: what is")) < len("Question: what is")


def test_special_tokens(tokenizer):
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.eos_token == "<|im_end|>"
    start_id = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.encode("<|im_start|>") == [start_id]
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert len({tokenizer.pad_token_id, tokenizer.eos_token_id, start_id}) == 3


def test_chat_template_qwen_format(tokenizer):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello<|im_end|>\n"
    )


def test_training_is_deterministic():
    a = train_tokenizer(CORPUS, vocab_size=400)
    b = train_tokenizer(CORPUS, vocab_size=400)
    assert a.get_vocab() == b.get_vocab()


def test_vocab_size_too_small():
    with pytest.raises(ConfigError, match="vocab_size"):
        train_tokenizer(CORPUS, vocab_size=100)
