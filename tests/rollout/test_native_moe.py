"""The built-in rollout engine on mixtures of experts: the HF model's own sparse blocks run inside the
KV-cache decode path, so greedy output equals HF generate and sampled log-probs equal the trainer's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from posttrain.engine.engine_config import EngineConfig
from posttrain.engine.train_engine import TrainEngine
from posttrain.models import load_causal_lm, load_tokenizer
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.native import NativeRolloutEngine

from .test_native import prompts
from .test_native import test_rollout_log_probs_match_training_engine as _log_probs_check


def greedy_matches_hf(engine: NativeRolloutEngine, model_dir: Path, max_tokens: int = 12) -> None:
    model = load_causal_lm(model_dir)
    ps = prompts(model_dir)
    ours = engine.generate(ps, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    for prompt, result in zip(ps, ours, strict=True):
        hf = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_tokens,
            eos_token_id=engine.eos_ids,
            pad_token_id=engine.pad_id,
        )[0, len(prompt) :].tolist()
        if hf and hf[-1] == engine.pad_id and engine.pad_id not in engine.eos_ids:
            hf = hf[: hf.index(engine.pad_id)]
        assert result.token_ids == hf


@pytest.fixture(scope="module")
def moe_engine(tiny_moe_dir: Path) -> NativeRolloutEngine:
    return NativeRolloutEngine(str(tiny_moe_dir), seed=0)


def test_qwen2_moe_greedy_equals_hf_generate(moe_engine: NativeRolloutEngine, tiny_moe_dir: Path) -> None:
    assert type(moe_engine.model.model.layers[0].mlp).__name__ == "Qwen2MoeSparseMoeBlock"
    greedy_matches_hf(moe_engine, tiny_moe_dir)


def test_qwen2_moe_rollout_log_probs_match_training_engine(
    moe_engine: NativeRolloutEngine, tiny_moe_dir: Path
) -> None:
    """Same tolerance (1e-4, fp32) as the dense tiny model."""
    _log_probs_check(moe_engine, tiny_moe_dir)


@pytest.fixture(scope="module")
def qwen3_moe_dir(tiny_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A toy Qwen3-MoE (q/k norms, normalised top-k) on the tiny-moe tokenizer."""
    tokenizer = load_tokenizer(tiny_moe_dir)
    pad = tokenizer.pad_token_id
    config = Qwen3MoeConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=pad, pad_token_id=pad,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).eval()
    out = tmp_path_factory.mktemp("models") / "qwen3-moe"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_qwen3_moe_greedy_and_log_probs(qwen3_moe_dir: Path) -> None:
    engine = NativeRolloutEngine(str(qwen3_moe_dir), seed=0)
    greedy_matches_hf(engine, qwen3_moe_dir)
    _log_probs_check(engine, qwen3_moe_dir)
    # the training engine loads the same family through the same path
    assert TrainEngine(EngineConfig(model_path=str(qwen3_moe_dir), trainable=False)).model is not None
