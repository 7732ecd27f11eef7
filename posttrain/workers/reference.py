"""Reference: the frozen reference policy on workers of its own (`resources.ref` naming a pool).

By default the reference lives on the actor's workers (`ActorRolloutRefWorker`, `forward(model="ref")`). Placed
on another pool, typically the rollout pool of an asynchronous run, its log-probs are computed beside generation
instead of on the trainer's critical path: the producer thread asks for them as soon as a batch is sampled, while
the trainer updates on the previous one (trainers/async_rollout.py). A plain class the controller wraps as a Ray
actor; one SPMD rank per worker of its pool.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.engine.distributed import DistInfo
from posttrain.engine.engine_config import EngineConfig
from posttrain.engine.train_engine import TrainEngine
from posttrain.workers.process import prepare_worker_process, rank_seed


@dataclass(frozen=True)
class ReferenceSpec:
    engine: EngineConfig  # trainable=False, no LoRA: the base model the policy starts from
    seed: int = 0
    threads: int = 0  # torch intra-op threads; 0 = leave as is


class ReferenceWorker:
    role = "ref"

    def __init__(self, spec: ReferenceSpec, dist_info: DistInfo | None = None) -> None:
        dist_info = dist_info or DistInfo()
        prepare_worker_process(spec.threads, rank_seed(spec.seed, dist_info.rank))
        if spec.engine.trainable or spec.engine.lora.rank:
            raise ValueError(
                "the reference engine is frozen and has no adapter: trainable=False, lora.rank=0"
            )
        self.rank = dist_info.rank
        self.engine = TrainEngine(spec.engine, dist_info)
        self.dp_size = self.engine.dp_size

    def ping(self) -> dict[str, Any]:
        return {"rank": self.rank, "pid": os.getpid()}

    def forward(self, batch: Batch, temperature: float = 1.0) -> Batch:
        """`ref_log_prob` (B, R): the response tokens' log-probs under the reference at `temperature`."""
        return Batch.from_dict({keys.REF_LOG_PROB: self.engine.compute_log_prob(batch, temperature)})
