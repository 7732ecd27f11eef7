"""Memory levers: activation checkpointing and bf16 mixed precision keep the math; bad settings fail at start."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from posttrain.config.schema import OptimConfig
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.engine import engine_config
from posttrain.engine.engine_config import EngineConfig
from posttrain.engine.train_engine import TrainEngine
from posttrain.errors import ConfigError
from posttrain.workers.losses import LossSpec, build_loss

from .helpers import synthetic_rl_batch, with_global_totals

BASE = EngineConfig(optim=OptimConfig(lr=1e-3, grad_clip=1e9), model_path="")


def step_outputs(model_dir: Path, **overrides) -> tuple[torch.Tensor, float, torch.Tensor]:
    """(log-probs, loss, flat gradient) of one PPO forward/backward on a fixed batch."""
    eng = TrainEngine(replace(BASE, model_path=str(model_dir), **overrides))
    batch = synthetic_rl_batch(rows=8, prompt_width=8, response_width=6, vocab=1000, seed=21)
    log_probs = eng.compute_log_prob(batch)
    batch = batch.union(Batch.from_dict({keys.OLD_LOG_PROBS: log_probs - 0.05}))
    loss = eng.forward_backward(with_global_totals(batch), build_loss(LossSpec("ppo", {}), 1))["loss"]
    grads = torch.cat([p.grad.full_tensor().flatten() for p in eng.model.parameters()])
    return log_probs * batch[keys.RESPONSE_MASK], loss, grads


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> tuple[torch.Tensor, float, torch.Tensor]:
    return step_outputs(tiny_model_dir)


def test_gradient_checkpointing_gives_the_same_gradients(tiny_model_dir: Path, reference) -> None:
    log_probs, loss, grads = step_outputs(tiny_model_dir, gradient_checkpointing=True)
    torch.testing.assert_close(log_probs, reference[0], atol=1e-6, rtol=0)
    assert loss == pytest.approx(reference[1], abs=1e-7)
    torch.testing.assert_close(grads, reference[2], atol=1e-7, rtol=1e-5)


@pytest.mark.skipif(
    not engine_config.bf16_supported(torch.device("cpu")), reason="this CPU has no bfloat16 support"
)
def test_bf16_mixed_precision_is_close_and_keeps_fp32_master_weights(tiny_model_dir: Path, reference) -> None:
    log_probs, loss, grads = step_outputs(tiny_model_dir, compute_dtype="bfloat16")
    # bf16 has 8 mantissa bits: log-probs agree to a few 1e-2, gradients point the same way
    assert (log_probs - reference[0]).abs().max() < 0.1
    assert loss == pytest.approx(reference[1], abs=0.02)
    assert torch.nn.functional.cosine_similarity(grads, reference[2], dim=0) > 0.98
    eng = TrainEngine(replace(BASE, model_path=str(tiny_model_dir), compute_dtype="bfloat16"))
    assert all(p.dtype == torch.float32 for p in eng.model.parameters())


def test_bf16_on_a_device_without_it_is_an_error(tiny_model_dir: Path, monkeypatch) -> None:
    monkeypatch.setattr(engine_config, "bf16_supported", lambda device: False)
    with pytest.raises(ConfigError, match="model.compute_dtype=bfloat16 but device cpu has no bfloat16"):
        TrainEngine(replace(BASE, model_path=str(tiny_model_dir), compute_dtype="bfloat16"))


def test_offload_on_cpu_is_an_error(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="offload=true needs an accelerator"):
        TrainEngine(replace(BASE, model_path=str(tiny_model_dir), offload=True))
