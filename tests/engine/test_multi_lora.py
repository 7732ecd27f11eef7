"""Adapters on one shared frozen base (engine.multi_lora): peft as the oracle, isolation, state round trips."""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch
from peft import PeftModel

from posttrain.config.schema import OptimConfig
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.engine.adapter_model import AdapterModel
from posttrain.engine.engine_config import EngineConfig
from posttrain.engine.multi_lora import AdapterSpec, MultiLora
from posttrain.engine.train_engine import TrainEngine
from posttrain.errors import ConfigError
from posttrain.models import load_causal_lm

from .helpers import synthetic_rl_batch
from .test_lora import LORA, hf_log_probs, lora_engine, train_step

SPEC = AdapterSpec(LORA.rank, LORA.alpha, tuple(LORA.target_modules))
OPTIM = OptimConfig(lr=5e-2, grad_clip=1e9)  # what lora_engine configures


@pytest.fixture(scope="module")
def batch() -> Batch:
    return synthetic_rl_batch(rows=8, prompt_width=8, response_width=6, vocab=1000, seed=11)


@pytest.fixture()
def base(tiny_model_dir: Path) -> TrainEngine:
    return TrainEngine(EngineConfig(model_path=str(tiny_model_dir), trainable=False))


def adapter_step(model: AdapterModel, batch: Batch) -> None:
    train_step(model, batch)  # type: ignore[arg-type]  # the calls a TrainEngine gets


def test_an_adapter_computes_and_trains_exactly_as_peft_lora(
    base: TrainEngine, tiny_model_dir: Path, batch: Batch, tmp_path: Path
) -> None:
    adapter = AdapterModel(base, base.attach_adapters(), "a", SPEC, seed=0, optim=OPTIM)
    with torch.no_grad():
        for b in adapter.adapter.lora_b.values():
            b.normal_(0.0, 0.1)  # B = 0 would hide any error in the delta
    adapter.save(tmp_path / "a")
    peft = lora_engine(tiny_model_dir)
    state = safetensors.torch.load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    with torch.no_grad():
        for name, p in peft.model.named_parameters():
            if "lora_" in name:
                p.to_local().copy_(state[name.replace(".default", "")])
    # peft reads our files, and computes what we compute
    peft_loaded = PeftModel.from_pretrained(load_causal_lm(tiny_model_dir), tmp_path / "a")
    ours = adapter.compute_log_prob(batch)
    valid = batch[keys.RESPONSE_MASK].bool()
    torch.testing.assert_close(hf_log_probs(peft_loaded, batch)[valid], ours[valid], atol=1e-5, rtol=0)
    torch.testing.assert_close(peft.compute_log_prob(batch), ours, atol=1e-5, rtol=0)
    # two PPO steps each (same loss, same AdamW settings): the same weights after
    for _ in range(2):
        adapter_step(adapter, batch)
        train_step(peft, batch)
    torch.testing.assert_close(
        peft.compute_log_prob(batch), adapter.compute_log_prob(batch), atol=1e-4, rtol=0
    )


def test_adapters_share_the_base_and_never_touch_each_other(base: TrainEngine, batch: Batch) -> None:
    adapters = base.attach_adapters()
    assert base.attach_adapters() is adapters
    a = AdapterModel(base, adapters, "a", SPEC, seed=1, optim=OPTIM)
    b = AdapterModel(base, adapters, "b", SPEC, seed=2, optim=OPTIM)
    base_before, b_before = base.compute_log_prob(batch), b.compute_log_prob(batch)
    adapter_step(a, batch)
    assert not torch.equal(a.compute_log_prob(batch), base_before)
    assert torch.equal(base.compute_log_prob(batch), base_before)  # outside `use`, the base is itself
    assert torch.equal(b.compute_log_prob(batch), b_before)  # bit for bit
    assert all(not p.requires_grad for p in base.model.parameters())
    with pytest.raises(ConfigError, match="exists already"):
        AdapterModel(base, adapters, "a", SPEC, seed=3, optim=OPTIM)
    with pytest.raises(ConfigError, match="not found"):
        AdapterModel(base, adapters, "c", AdapterSpec(4, 8.0, ("no_such_proj",)), seed=3, optim=OPTIM)


def test_state_round_trips_weights_and_optimizer_as_tensors_and_json(
    base: TrainEngine, batch: Batch, tmp_path: Path
) -> None:
    adapters = base.attach_adapters()
    a = AdapterModel(base, adapters, "a", SPEC, seed=4, optim=OPTIM)
    adapter_step(a, batch)
    a.save(tmp_path / "state")
    assert {p.suffix for p in (tmp_path / "state").iterdir()} == {".json", ".safetensors"}  # nothing pickled
    restored = AdapterModel(base, adapters, "r", SPEC, seed=5, optim=OPTIM)
    restored.load(tmp_path / "state", with_optimizer=True)
    torch.testing.assert_close(restored.compute_log_prob(batch), a.compute_log_prob(batch), atol=0, rtol=0)
    adapter_step(a, batch)
    adapter_step(restored, batch)  # the same Adam moments: the same second step
    torch.testing.assert_close(restored.compute_log_prob(batch), a.compute_log_prob(batch), atol=1e-6, rtol=0)


def test_multi_lora_needs_a_frozen_base(tiny_model_dir: Path) -> None:
    trainable = TrainEngine(EngineConfig(model_path=str(tiny_model_dir)))
    with pytest.raises(ConfigError, match="frozen"):
        trainable.attach_adapters()
    assert isinstance(MultiLora(trainable.model), MultiLora)
