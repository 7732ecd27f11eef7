"""The critic's checkpoint holds its process's random streams, as the actor's does: a resumed run repeats."""

from __future__ import annotations

from pathlib import Path

import torch

from posttrain.config.schema import OptimConfig
from posttrain.engine.engine_config import EngineConfig
from posttrain.workers.critic import CriticSpec, CriticWorker


def test_the_critics_state_restores_its_random_streams(tiny_model_dir: Path, tmp_path: Path) -> None:
    engine = EngineConfig(
        model_path=str(tiny_model_dir), optim=OptimConfig(lr=1e-3), micro_batch_size=4, head="value"
    )
    critic = CriticWorker(CriticSpec(engine=engine, seed=3, threads=1))
    critic.save_state(str(tmp_path))
    assert (tmp_path / "critic" / "rng_rank0.pt").exists()
    expected = torch.rand(4)  # what the stream draws next after the save
    torch.manual_seed(12345)  # the stream moves on (a restarted process seeds afresh)
    critic.load_state(str(tmp_path))
    assert torch.equal(torch.rand(4), expected)
