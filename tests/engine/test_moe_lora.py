"""LoRA on a mixture's fused 3-D experts (`model.lora.target_parameters`, peft's parameter targeting): only
adapters train, a fresh adapter leaves the model unchanged, the reference is the base, the merged weights reach
the built-in sampler (its log-probs equal the trainer's after an update) and both exports load back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel

from posttrain.config.schema import LoraConfig, OptimConfig
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.engine.engine_config import EngineConfig
from posttrain.engine.lora import check_target_modules
from posttrain.engine.train_engine import TrainEngine
from posttrain.errors import ConfigError
from posttrain.models import load_causal_lm
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.native import NativeRolloutEngine
from posttrain.workers.losses import LossSpec, build_loss
from posttrain.workers.sampling import batch_prompts, results_batch

from .helpers import synthetic_rl_batch, with_global_totals

PPO = LossSpec("ppo", {"use_kl_loss": False, "loss_agg_mode": "token-mean"})
EXPERTS = LoraConfig(
    rank=4, alpha=8, target_modules=(), target_parameters=("gate_up_proj", "experts.down_proj")
)


def lora_engine(model_dir: Path, lora: LoraConfig = EXPERTS, **fields) -> TrainEngine:
    torch.manual_seed(0)  # peft draws A at random
    optim = OptimConfig(lr=1e-2, grad_clip=0.0)
    return TrainEngine(
        EngineConfig(model_path=str(model_dir), optim=optim, micro_batch_size=4, lora=lora, **fields)
    )


def trained(engine: TrainEngine, batch: Batch) -> TrainEngine:
    engine.forward_backward(with_global_totals(batch), build_loss(PPO, 1))
    engine.optim_step()
    return engine


def masked_max(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b) * mask).abs().max())


def hf_log_probs(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Response log-probs of a plain (or peft) HF model on padded rows."""
    from posttrain.engine.log_probs import response_log_probs

    with torch.no_grad():
        lp, _ = response_log_probs(
            model,
            batch[keys.INPUT_IDS],
            batch[keys.ATTENTION_MASK],
            batch[keys.POSITION_IDS],
            batch[keys.RESPONSES].shape[1],
        )
    return lp


def test_expert_adapters_start_at_the_base_and_only_they_train(tiny_moe_dir: Path) -> None:
    batch = synthetic_rl_batch(rows=4, vocab=1000)
    base = TrainEngine(EngineConfig(model_path=str(tiny_moe_dir), trainable=False, micro_batch_size=4))
    engine = lora_engine(tiny_moe_dir)
    adapters = {n for n, p in engine.model.named_parameters() if p.requires_grad}
    # one A/B pair per adapted fused tensor (nested wrappers when both of a layer's tensors are adapted)
    assert len(adapters) == 4 * 2 * 2 and all(".experts." in n and "lora_" in n for n in adapters)
    mask = batch[keys.RESPONSE_MASK]
    base_lp = base.compute_log_prob(batch)
    assert masked_max(engine.compute_log_prob(batch), base_lp, mask) == 0.0  # B = 0: the base model
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    trained(engine, batch)
    changed = {n for n, p in engine.model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed and changed <= adapters
    assert masked_max(engine.compute_log_prob(batch), base_lp, mask) > 1e-3
    # the reference of a LoRA run is the adapter switched off: still the base
    assert masked_max(engine.compute_log_prob(batch, disable_adapter=True), base_lp, mask) < 1e-6
    # the merged weights (what a sampler gets) give a plain HF model the trainer's log-probs
    merged = dict(engine.named_tensors_for_rollout())
    assert sorted(merged)[:2] == [
        "model.layers.0.mlp.experts.down_proj",
        "model.layers.0.mlp.experts.gate_up_proj",
    ]
    model = load_causal_lm(tiny_moe_dir)
    model.load_state_dict(merged, strict=False)
    assert masked_max(hf_log_probs(model, batch), engine.compute_log_prob(batch), mask) < 1e-5


def test_rollout_log_probs_equal_the_trainer_after_an_update(tiny_moe_dir: Path) -> None:
    engine = trained(lora_engine(tiny_moe_dir), synthetic_rl_batch(rows=4, vocab=1000))
    sampler = NativeRolloutEngine(str(tiny_moe_dir), seed=0)
    assert sampler.load_weights(engine.named_tensors_for_rollout()) == 8
    prompts = synthetic_rl_batch(rows=6, vocab=1000, seed=1)
    width = prompts[keys.INPUT_IDS].shape[1] - prompts[keys.RESPONSES].shape[1]
    prompts = Batch.from_dict(
        {k: prompts[k][:, :width] for k in (keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS)}
    )
    sampling = SamplingParams(max_tokens=8, temperature=1.0, seed=3)
    rows = batch_prompts(prompts)
    batch = results_batch(prompts, sampler.generate(rows, sampling), sampler.pad_id, 8, 0.0, 1.0)
    diff = masked_max(
        engine.compute_log_prob(batch), batch[keys.ROLLOUT_LOG_PROBS], batch[keys.RESPONSE_MASK]
    )
    assert diff < 1e-4  # the tolerance of the dense and full-MoE samplers


def test_merged_and_adapter_exports_load_back(tiny_moe_dir: Path, tmp_path: Path) -> None:
    batch = synthetic_rl_batch(rows=4, vocab=1000)
    engine = trained(lora_engine(tiny_moe_dir), batch)
    expected = engine.compute_log_prob(batch)
    engine.export_hf(tmp_path / "merged", merged=True)
    engine.export_hf(tmp_path / "adapter", merged=False)
    mask = batch[keys.RESPONSE_MASK]
    assert masked_max(hf_log_probs(load_causal_lm(tmp_path / "merged"), batch), expected, mask) < 1e-5
    peft = PeftModel.from_pretrained(load_causal_lm(tiny_moe_dir), str(tmp_path / "adapter"))
    assert masked_max(hf_log_probs(peft, batch), expected, mask) < 1e-5


def test_expert_targets_are_validated(tiny_model_dir: Path, tiny_moe_dir: Path) -> None:
    moe = load_causal_lm(tiny_moe_dir)
    check_target_modules(moe, LoraConfig(rank=4, target_parameters=("mlp.experts.gate_up_proj",)))
    with pytest.raises(
        ConfigError, match=r"target_parameters \['gate_proj'\].*valid.*down_proj, gate_up_proj"
    ):
        check_target_modules(moe, LoraConfig(rank=4, target_parameters=("gate_proj",)))
    with pytest.raises(ConfigError, match="model.lora.dropout=0.1 with model.lora.target_parameters"):
        check_target_modules(moe, LoraConfig(rank=4, dropout=0.1, target_parameters=("down_proj",)))
    with pytest.raises(ConfigError, match=r"\['gate_up_proj'\].*model.lora.target_parameters instead"):
        check_target_modules(moe, LoraConfig(rank=4, target_modules=("q_proj", "gate_up_proj")))
    with pytest.raises(ConfigError, match="none: this model has no fused experts"):
        check_target_modules(
            load_causal_lm(tiny_model_dir), LoraConfig(rank=4, target_parameters=("down_proj",))
        )
