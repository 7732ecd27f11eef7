"""The hybrid-engine worker: weights move from the FSDP trainer into the sampler in-process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.config.schema import OptimConfig
from posttrain.config.schema_shared import LoraConfig
from posttrain.controller.worker_group import LocalWorkerGroup
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.engine.engine_config import EngineConfig
from posttrain.models import load_tokenizer
from posttrain.rollout.base import SamplingParams
from posttrain.workers.actor_rollout_ref import ActorRolloutRefSpec, ActorRolloutRefWorker
from posttrain.workers.losses import LossSpec
from posttrain.workers.rollout_worker import RolloutSpec, RolloutWorker

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


def prompt_batch(model_dir: Path) -> Batch:
    tok = load_tokenizer(model_dir)
    ids = [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": f"What is {i}+{i}?"}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for i in range(4)
    ]
    width = max(map(len, ids))
    input_ids = torch.full((4, width), tok.pad_token_id)
    mask = torch.zeros((4, width), dtype=torch.long)
    for i, p in enumerate(ids):
        input_ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return Batch.from_dict({keys.INPUT_IDS: input_ids, keys.ATTENTION_MASK: mask})


@pytest.mark.parametrize("rollout_name", ["native", "hf"])
def test_an_optimizer_step_reaches_the_sampler(tiny_model_dir: Path, rollout_name: str) -> None:
    spec = ActorRolloutRefSpec(
        EngineConfig(model_path=str(tiny_model_dir), optim=OptimConfig(lr=5e-2), micro_batch_size=4),
        rollout_name=rollout_name,
        threads=1,
    )
    group = LocalWorkerGroup(ActorRolloutRefWorker, spec)
    prompts = prompt_batch(tiny_model_dir)
    before = group.call("sample", prompts, GREEDY)
    # one SFT-style step that pushes up the sampled responses' first token of row 0 everywhere
    batch = before.select([keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS], [])
    loss_mask = torch.zeros_like(batch[keys.INPUT_IDS], dtype=torch.float32)
    loss_mask[:, -8:] = before[keys.RESPONSE_MASK]
    batch.set(keys.LOSS_MASK, loss_mask)
    batch.set(keys.INPUT_IDS, batch[keys.INPUT_IDS].clone())
    batch[keys.INPUT_IDS][:, -8:] = torch.where(
        before[keys.RESPONSE_MASK] > 0, 7, batch[keys.INPUT_IDS][:, -8:]
    )
    for _ in range(3):
        group.call("forward_backward", batch, LossSpec("cross_entropy"))
        group.call("optim_step")
    unsynced = group.call("sample", prompts, GREEDY)
    assert torch.equal(unsynced[keys.RESPONSES], before[keys.RESPONSES]), (
        "no sync yet: the sampler is unchanged"
    )
    metrics = group.call("sync_sampler")
    assert metrics["sync/tensors"] > 0
    after = group.call("sample", prompts, GREEDY)
    assert not torch.equal(after[keys.RESPONSES], before[keys.RESPONSES])
    # the synced sampler and the trainer agree on the log-probs of what it now samples
    fwd = after.select([keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS, keys.RESPONSES], [])
    trained = group.call("forward", fwd, "actor")[keys.OLD_LOG_PROBS]
    diff = ((trained - after[keys.ROLLOUT_LOG_PROBS]).abs() * after[keys.RESPONSE_MASK]).max()
    assert diff < 1e-4


@pytest.mark.parametrize("rollout_name", ["native", "hf"])
def test_lora_on_a_tied_lm_head_leaves_the_samplers_embeddings_alone(
    tiny_model_dir: Path, rollout_name: str
) -> None:
    """The trainer adapts the head alone (W_E + BA); synced merged into a tied sampler it overwrote the
    embeddings too, and the sampler ran another model (log-probs 18 nats off after 3 steps)."""
    lora = LoraConfig(rank=8, alpha=16, target_modules=("q_proj", "v_proj", "lm_head"))
    engine = EngineConfig(
        model_path=str(tiny_model_dir), lora=lora, optim=OptimConfig(lr=5e-2), micro_batch_size=4
    )
    worker = ActorRolloutRefWorker(ActorRolloutRefSpec(engine, rollout_name=rollout_name, threads=1))
    base_embeddings = worker.rollout.model.get_input_embeddings().weight.detach().clone()
    prompts = prompt_batch(tiny_model_dir)
    sampled = worker.sample(prompts, GREEDY)
    batch = sampled.select([keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS], [])
    loss_mask = torch.zeros_like(batch[keys.INPUT_IDS], dtype=torch.float32)
    loss_mask[:, -8:] = sampled[keys.RESPONSE_MASK]
    batch.set(keys.LOSS_MASK, loss_mask)
    for _ in range(3):
        worker.forward_backward(batch, LossSpec("cross_entropy"))
        worker.optim_step()
    worker.sync_sampler()
    assert torch.equal(worker.rollout.model.get_input_embeddings().weight, base_embeddings)
    after = worker.sample(prompts, SamplingParams(max_tokens=8, temperature=1.0, seed=0))
    fwd = after.select([keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS, keys.RESPONSES], [])
    trained = worker.forward(fwd, "actor")[keys.OLD_LOG_PROBS]
    assert ((trained - after[keys.ROLLOUT_LOG_PROBS]).abs() * after[keys.RESPONSE_MASK]).max() < 1e-4


def test_a_split_rollout_worker_unties_the_head_for_an_adapted_one(tiny_model_dir: Path) -> None:
    worker = RolloutWorker(RolloutSpec(str(tiny_model_dir), adapted_head=True, threads=1))
    model = worker.engine.model
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
