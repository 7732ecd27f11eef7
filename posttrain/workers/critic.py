"""Critic: one SPMD rank of the value model (same architecture, one-output head), its engine and optimizer.

A plain class the controller wraps as a Ray actor or runs in-process, like ActorRolloutRef.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.engine.distributed import DistInfo
from posttrain.engine.engine_config import EngineConfig
from posttrain.engine.train_engine import TrainEngine
from posttrain.workers.losses import LossSpec, build_loss
from posttrain.workers.process import ProcessRNG, prepare_worker_process, rank_seed


@dataclass(frozen=True)
class CriticSpec:
    engine: EngineConfig  # head="value"
    seed: int = 0
    threads: int = 0


class CriticWorker:
    role = "critic"

    def __init__(self, spec: CriticSpec, dist_info: DistInfo | None = None) -> None:
        dist_info = dist_info or DistInfo()
        prepare_worker_process(spec.threads, rank_seed(spec.seed, dist_info.rank, "critic"))
        # The token-classification head returns its logits as a view; nothing modifies them in place.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        self.rank = dist_info.rank
        self.engine = TrainEngine(spec.engine, dist_info)
        self.dp_size = self.engine.dp_size

    def ping(self) -> dict[str, int]:
        return {"rank": self.rank}

    def forward(self, batch: Batch) -> Batch:
        """V(s_t) for every response token."""
        return Batch.from_dict({keys.VALUES: self.engine.compute_values(batch)})

    def forward_backward(self, batch: Batch, loss: LossSpec) -> dict[str, float]:
        start = time.perf_counter()
        metrics = self.engine.forward_backward(batch, build_loss(loss, self.dp_size))
        metrics = {k if k.startswith("critic/") else f"critic/{k}": v for k, v in metrics.items()}
        metrics["critic/seconds"] = time.perf_counter() - start
        return metrics

    def optim_step(self) -> dict[str, float]:
        return {f"critic/{k}": v for k, v in self.engine.optim_step().items()}

    def save_state(self, path: str) -> None:
        self.engine.save(Path(path) / "critic")
        # its process's random streams too (its own process on Ray), so that a resumed run repeats
        torch.save(ProcessRNG().state_dict(), Path(path) / "critic" / f"rng_rank{self.rank}.pt")

    def load_state(self, path: str) -> None:
        self.engine.load(Path(path) / "critic")
        rng_file = Path(path) / "critic" / f"rng_rank{self.rank}.pt"
        if rng_file.exists():  # absent in checkpoints written before the critic saved it
            ProcessRNG().load_state_dict(torch.load(rng_file, weights_only=False))
