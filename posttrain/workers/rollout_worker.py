"""Rollout: one sampler of its own (split placement), fed weights by the trainer after each update.

Used when `resources.rollout` names a pool other than the trainer's: generation and training then run on
different workers, and weights travel from the actor's rank 0 through Ray's object store. No
torch.distributed group: samplers never talk to each other.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from posttrain.data.batch import Batch
from posttrain.engine.distributed import DistInfo, resolve_device
from posttrain.engine.train_engine import DTYPES
from posttrain.rollout import make_rollout_engine
from posttrain.rollout.base import SamplingParams
from posttrain.workers.process import ProcessRNG, prepare_worker_process, rank_seed
from posttrain.workers.sampling import sample_batch


@dataclass(frozen=True)
class RolloutSpec:
    model_path: str
    name: str = "native"
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    max_batch_size: int = 256
    seed: int = 0
    threads: int = 0


class RolloutWorker:
    role = "rollout"

    def __init__(self, spec: RolloutSpec, dist_info: DistInfo | None = None) -> None:
        dist_info = dist_info or DistInfo()
        prepare_worker_process(spec.threads, rank_seed(spec.seed, dist_info.rank))
        self.rank = dist_info.rank
        # the same seed a colocated sampler of this rank gets, so placement does not change the samples
        self.engine = make_rollout_engine(
            spec.name,
            spec.model_path,
            device=resolve_device(dist_info.device),
            dtype=DTYPES[spec.dtype],
            max_batch_size=spec.max_batch_size,
            seed=rank_seed(spec.seed, dist_info.rank, "sampler"),
            attn_implementation=spec.attn_implementation,
        )

    def ping(self) -> dict[str, Any]:
        return {"rank": self.rank, "pid": os.getpid()}

    def sample(self, batch: Batch, sampling: SamplingParams) -> Batch:
        return sample_batch(self.engine, batch, sampling)

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> dict[str, float]:
        start = time.perf_counter()
        loaded = self.engine.load_weights(tensors.items())
        return {"sync/tensors": float(loaded), "sync/seconds": time.perf_counter() - start}

    def save_state(self, path: str) -> None:
        """This rank's RNG states, its sampler's included (the weights are the actor's)."""
        folder = Path(path) / "rollout"
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(ProcessRNG(self.engine.generator).state_dict(), folder / f"rng_rank{self.rank}.pt")

    def load_state(self, path: str) -> None:
        rng_file = Path(path) / "rollout" / f"rng_rank{self.rank}.pt"
        if rng_file.exists():
            ProcessRNG(self.engine.generator).load_state_dict(torch.load(rng_file, weights_only=False))
