"""A critic's fresh value head is rank 0's on every rank: its values do not depend on the world size."""

from __future__ import annotations

from pathlib import Path

import torch

from posttrain.config.schema import OptimConfig
from posttrain.controller.worker_group import RayWorkerGroup
from posttrain.data import keys
from posttrain.engine.engine_config import EngineConfig
from posttrain.workers.critic import CriticSpec, CriticWorker

from .helpers import synthetic_rl_batch


def test_fresh_value_head_is_the_same_on_one_and_two_ranks(tiny_model_dir: Path, ray_cluster: None) -> None:
    """Each rank seeds its own stream before loading, so a head missing from the actor's directory was drawn
    per rank and FSDP sharded a mix of the draws (values differed between 1 and 2 workers by ~1e-1)."""
    engine = EngineConfig(
        model_path=str(tiny_model_dir), optim=OptimConfig(lr=1e-3), micro_batch_size=4, head="value"
    )
    batch = synthetic_rl_batch(rows=8, seed=5)
    batch = batch.select([keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS, keys.RESPONSES], [])
    values = {}
    for world in (1, 2):
        group = RayWorkerGroup(
            CriticWorker,
            CriticSpec(engine=engine, seed=3, threads=1),
            world_size=world,
            role="critic",
            device="cpu",
        )
        try:
            values[world] = group.call("forward", batch)[keys.VALUES]
        finally:
            group.shutdown()
    assert values[1].abs().max() > 0  # a real head, not zeros
    torch.testing.assert_close(values[2], values[1], atol=1e-5, rtol=0)
