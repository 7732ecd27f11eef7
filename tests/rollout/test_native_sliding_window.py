"""A model with a sliding attention window (Mistral's `sliding_window`): the built-in engine attends to the
whole context, which is the same attention for requests within the window, so it takes those (greedy equals
HF generate) and refuses longer ones naming the window, instead of sampling from another model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config

from posttrain.models import load_tokenizer
from posttrain.rollout.base import GenerationRequest, SamplingParams
from posttrain.rollout.decoder import sliding_window
from posttrain.rollout.native import NativeRolloutEngine

from .test_native import prompts
from .test_native_moe import greedy_matches_hf

WINDOW = 48


@pytest.fixture(scope="module")
def mistral_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = load_tokenizer(tiny_model_dir)
    config = MistralConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, sliding_window=WINDOW, tie_word_embeddings=False,
        bos_token_id=tokenizer.pad_token_id, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )  # fmt: skip
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("models") / "mistral-sw"
    MistralForCausalLM(config).eval().save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_requests_within_the_window_equal_hf_and_longer_ones_are_refused(mistral_dir: Path) -> None:
    engine = NativeRolloutEngine(str(mistral_dir), seed=0)
    assert engine.window == WINDOW
    longest = max(len(p) for p in prompts(mistral_dir))
    assert longest + 8 <= WINDOW
    greedy_matches_hf(engine, mistral_dir, max_tokens=8)
    over = GenerationRequest(prompts(mistral_dir)[0], SamplingParams(max_tokens=WINDOW, temperature=0.0))
    (result,) = engine.generate_requests([over])
    assert result.stop_reason == "error" and f"sliding attention window of {WINDOW}" in str(result.error)


def test_which_configs_have_a_window() -> None:
    assert sliding_window(MistralConfig(sliding_window=4096)) == 4096
    assert sliding_window(MistralConfig(sliding_window=None)) is None
    assert sliding_window(Qwen2Config(sliding_window=4096)) is None  # use_sliding_window is off
    assert sliding_window(Qwen2Config(use_sliding_window=True, sliding_window=64, max_window_layers=0)) == 64
