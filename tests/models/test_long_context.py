"""The long-context presets (32k positions): their config, their directory, and the rollout engines'
context limit that follows the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from posttrain.models import PRESETS, build_tiny_model, load_config, load_tokenizer, make_tiny_model
from posttrain.rollout.base import GenerationRequest, SamplingParams
from posttrain.rollout.hf_engine import HFRolloutEngine
from posttrain.rollout.native import NativeRolloutEngine

from .conftest import CORPUS


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("tiny-32k", tmp_path_factory.mktemp("tiny-32k") / "model", CORPUS, seed=0)


@pytest.mark.parametrize(("long", "base"), [("tiny-32k", "tiny"), ("small-32k", "small")])
def test_long_presets_are_their_base_sizes_with_32k_positions(long: str, base: str) -> None:
    config = build_tiny_model(long).config
    assert config.max_position_embeddings == 32768
    assert config.rope_parameters["rope_theta"] == 1e6
    assert (
        build_tiny_model(base).config.rope_parameters["rope_theta"] == 10000.0
    )  # existing presets unchanged
    sizes = {
        k: v for k, v in vars(PRESETS[long]).items() if k not in ("max_position_embeddings", "rope_theta")
    }
    assert sizes == {k: v for k, v in vars(PRESETS[base]).items() if k in sizes}
    assert sum(p.numel() for p in build_tiny_model(long).parameters()) == sum(
        p.numel() for p in build_tiny_model(base).parameters()
    )


def test_long_directory_records_the_context(long_dir: Path) -> None:
    config = json.loads((long_dir / "config.json").read_text())
    assert config["max_position_embeddings"] == 32768
    assert config["rope_parameters"]["rope_theta"] == 1e6
    assert load_config(long_dir).max_position_embeddings == 32768
    assert load_tokenizer(long_dir).model_max_length == 32768


@pytest.mark.parametrize("engine_cls", [NativeRolloutEngine, HFRolloutEngine])
def test_rollout_context_follows_the_model_and_names_the_limit(long_dir: Path, engine_cls: type) -> None:
    engine = engine_cls(str(long_dir))
    assert engine.max_context == 32768
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    results = engine.generate_requests(
        [GenerationRequest([5, 6, 7], greedy), GenerationRequest([5] * 32767, greedy)]
    )
    assert results[0].stop_reason != "error" and results[0].token_ids  # within the context: generates
    assert results[1].stop_reason == "error"
    assert (
        "32767 tokens + max_tokens 2 = 32769 exceeds the model context of 32768 positions" in results[1].error
    )
    assert "max_position_embeddings" in results[1].error


def test_positions_far_into_the_context_run(long_dir: Path) -> None:
    """A short sequence placed at the end of the 32k window: rotary embeddings at positions near 32767 are
    finite, and differ from the same tokens at the start (the positions reach the model)."""
    from posttrain.models import load_causal_lm

    model = load_causal_lm(long_dir)
    ids = torch.tensor([[11, 12, 13, 14]])
    with torch.no_grad():
        start = model(input_ids=ids, position_ids=torch.arange(4)[None]).logits
        end = model(input_ids=ids, position_ids=torch.arange(32764, 32768)[None]).logits
    assert torch.isfinite(end).all()
    assert not torch.allclose(start[:, 1:], end[:, 1:])
