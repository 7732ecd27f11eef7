"""LoRA through peft on the FSDP2 engine: what trains, the reference, sampler sync, export, checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import PeftModel

from posttrain.config.schema import LoraConfig, OptimConfig
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.engine.engine_config import EngineConfig
from posttrain.engine.log_probs import response_log_probs
from posttrain.engine.train_engine import TrainEngine
from posttrain.errors import ConfigError
from posttrain.models import load_causal_lm
from posttrain.workers.losses import LossSpec, build_loss

from .helpers import synthetic_rl_batch, with_global_totals

LORA = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))


def lora_engine(model_dir: Path) -> TrainEngine:
    return TrainEngine(
        EngineConfig(model_path=str(model_dir), optim=OptimConfig(lr=5e-2, grad_clip=1e9), lora=LORA)
    )


def hf_log_probs(model: torch.nn.Module, batch: Batch) -> torch.Tensor:
    ids, mask, pos = batch[keys.INPUT_IDS], batch[keys.ATTENTION_MASK], batch[keys.POSITION_IDS]
    with torch.no_grad():
        return response_log_probs(model, ids, mask, pos, batch[keys.RESPONSES].shape[1])[0]


def train_step(eng: TrainEngine, batch: Batch) -> None:
    old = Batch.from_dict({keys.OLD_LOG_PROBS: eng.compute_log_prob(batch)})
    spec = LossSpec("ppo", {"use_kl_loss": False})
    eng.forward_backward(with_global_totals(batch.union(old)), build_loss(spec, 1))
    eng.optim_step()


def full_state(eng: TrainEngine) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().clone() for k, v in eng.model.state_dict().items()}


@pytest.fixture(scope="module")
def batch() -> Batch:
    return synthetic_rl_batch(rows=8, prompt_width=8, response_width=6, vocab=1000, seed=11)


@pytest.fixture(scope="module")
def trained(tiny_model_dir: Path, batch: Batch) -> TrainEngine:
    eng = lora_engine(tiny_model_dir)
    before = full_state(eng)
    for _ in range(2):
        train_step(eng, batch)
    eng.before = before  # type: ignore[attr-defined]
    return eng


def test_only_adapter_parameters_train(trained: TrainEngine) -> None:
    after = full_state(trained)
    changed = {k for k in after if not torch.equal(after[k], trained.before[k])}  # type: ignore[attr-defined]
    assert changed and all("lora_" in k for k in changed)
    assert any("lora_B" in k for k in changed)
    trainable = [n for n, p in trained.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_reference_is_the_base_model(trained: TrainEngine, tiny_model_dir: Path, batch: Batch) -> None:
    valid = batch[keys.RESPONSE_MASK].bool()
    base = hf_log_probs(load_causal_lm(tiny_model_dir), batch)
    ref = trained.compute_log_prob(batch, disable_adapter=True)
    torch.testing.assert_close(ref[valid], base[valid], atol=2e-5, rtol=0)
    policy = trained.compute_log_prob(batch)
    assert (policy[valid] - base[valid]).abs().max() > 1e-3  # the adapter does change the policy


def test_sampler_gets_merged_adapted_layers_only(
    trained: TrainEngine, tiny_model_dir: Path, batch: Batch
) -> None:
    sampler = load_causal_lm(tiny_model_dir)
    names = []
    params = dict(sampler.named_parameters())
    with torch.no_grad():
        for name, tensor in trained.named_tensors_for_rollout():
            params[name].copy_(tensor)
            names.append(name)
    assert names and all(n.rsplit(".", 2)[-2] in LORA.target_modules for n in names)
    assert len(names) == 3 * sampler.config.num_hidden_layers
    valid = batch[keys.RESPONSE_MASK].bool()
    torch.testing.assert_close(
        hf_log_probs(sampler, batch)[valid], trained.compute_log_prob(batch)[valid], atol=2e-5, rtol=0
    )


def test_export_adapter_and_merged_reload_to_the_same_log_probs(
    trained: TrainEngine, tiny_model_dir: Path, batch: Batch, tmp_path: Path
) -> None:
    valid = batch[keys.RESPONSE_MASK].bool()
    expected = trained.compute_log_prob(batch)[valid]
    trained.export_hf(tmp_path / "adapter", merged=False)
    trained.export_hf(tmp_path / "merged", merged=True)
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
    adapter = PeftModel.from_pretrained(load_causal_lm(tiny_model_dir), tmp_path / "adapter").eval()
    torch.testing.assert_close(hf_log_probs(adapter, batch)[valid], expected, atol=2e-5, rtol=0)
    merged = load_causal_lm(tmp_path / "merged")
    torch.testing.assert_close(hf_log_probs(merged, batch)[valid], expected, atol=2e-5, rtol=0)


def test_checkpoint_holds_adapters_only_and_resumes(
    trained: TrainEngine, tiny_model_dir: Path, batch: Batch, tmp_path: Path
) -> None:
    trained.save(tmp_path / "ckpt")
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys)
    restored = lora_engine(tiny_model_dir)
    restored.load(tmp_path / "ckpt")
    valid = batch[keys.RESPONSE_MASK].bool()
    torch.testing.assert_close(
        restored.compute_log_prob(batch)[valid], trained.compute_log_prob(batch)[valid], atol=0, rtol=0
    )
    # the optimizer state came back too: one more identical step gives identical weights
    train_step(restored, batch)
    train_step(trained, batch)
    for name, tensor in full_state(trained).items():
        torch.testing.assert_close(full_state(restored)[name], tensor, atol=1e-7, rtol=0)


def test_unknown_target_module_is_an_error_listing_the_layers(tiny_model_dir: Path) -> None:
    config = EngineConfig(
        model_path=str(tiny_model_dir), lora=LoraConfig(rank=4, target_modules=("q_proj", "qkv_proj"))
    )
    with pytest.raises(ConfigError, match=r"\['qkv_proj'\] not found.*q_proj"):
        TrainEngine(config)
