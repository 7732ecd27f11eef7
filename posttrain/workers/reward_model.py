"""RewardModel: one SPMD rank of a reward model (a sequence classifier, engine/reward_engine.py).

The same worker trains it (`posttrain rm`: `forward_backward` with the `bradley_terry` loss over pairs, row 2i
chosen and 2i+1 rejected, then `optim_step`) and scores with it (RL: `score`, frozen). Importing this module
registers the `bradley_terry` loss in `workers.losses.LOSSES`, so a Ray worker process that builds this worker
has the loss too. A plain class the controller wraps as a Ray actor or runs in-process.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from posttrain.algorithms.reward_model_loss import bradley_terry_loss
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.data.preference_dataset import PAIR_MARGIN
from posttrain.engine.distributed import DistInfo
from posttrain.engine.engine_config import EngineConfig, LossFn
from posttrain.engine.reward_engine import RewardEngine
from posttrain.errors import ConfigError
from posttrain.workers.losses import LossSpec, build_loss, register_loss
from posttrain.workers.preference import check_pairs
from posttrain.workers.process import ProcessRNG, prepare_worker_process, rank_seed

RM_SCORE = "rm_score"  # (B,) float: the reward model's score of each row
BT_OPTIONS = ("center_rewards_coefficient",)


@register_loss("bradley_terry")
def bradley_terry(options: dict[str, Any], dp_size: int) -> LossFn:
    """sum_pairs (-log sigmoid(r_c - r_r - margin) + coef * (r_c + r_r)^2) / (pairs in the mini-batch): the
    mean over the mini-batch's pairs (algorithms/reward_model_loss.py); meta `global_seqs` = pairs."""
    unknown = sorted(set(options) - set(BT_OPTIONS))
    if unknown:
        raise ConfigError(
            f"loss 'bradley_terry' takes no option {', '.join(map(repr, unknown))}; valid: {', '.join(BT_OPTIONS)}"
        )
    coef = float(options.get("center_rewards_coefficient", 0.0))

    def loss_fn(
        scores: torch.Tensor, entropy: torch.Tensor | None, mb: Batch
    ) -> tuple[torch.Tensor, dict[str, float]]:
        check_pairs(mb)
        pairs = len(mb) // 2
        global_pairs = float(mb.meta.get(keys.GLOBAL_SEQS, pairs))
        margin = mb[PAIR_MARGIN][0::2] if PAIR_MARGIN in mb else None
        losses, metrics = bradley_terry_loss(scores[0::2], scores[1::2], margin, coef)
        loss = losses.sum() * dp_size / global_pairs
        return loss, {f"rm/{k}": float(v.mean()) for k, v in metrics.items()}

    return loss_fn


@dataclass(frozen=True)
class RewardModelSpec:
    engine: EngineConfig  # head="reward"; trainable=False to score only
    ensemble: tuple[EngineConfig, ...] = ()  # more frozen reward models scoring beside it (`score(model=i)`)
    seed: int = 0
    threads: int = 0


class RewardModelWorker:
    role = "reward_model"

    def __init__(self, spec: RewardModelSpec, dist_info: DistInfo | None = None) -> None:
        dist_info = dist_info or DistInfo()
        prepare_worker_process(spec.threads, rank_seed(spec.seed, dist_info.rank))
        self.rank = dist_info.rank
        self.engine = RewardEngine(spec.engine, dist_info)
        self.engines = [self.engine, *(RewardEngine(engine, dist_info) for engine in spec.ensemble)]
        self.dp_size = self.engine.dp_size

    def ping(self) -> dict[str, Any]:
        return {"rank": self.rank, "pid": os.getpid()}

    def score(self, batch: Batch, model: int = 0) -> Batch:
        """`rm_score` (B,) of right-padded rows (input_ids, attention_mask, position_ids) by reward model
        `model` (0: the spec's engine, i: its ensemble's i-th)."""
        if not 0 <= model < len(self.engines):
            raise ValueError(f"reward model {model} of {len(self.engines)}")
        return Batch.from_dict({RM_SCORE: self.engines[model].compute_scores(batch)})

    def forward_backward(self, batch: Batch, loss: LossSpec) -> dict[str, float]:
        start = time.perf_counter()
        metrics = self.engine.forward_backward(batch, build_loss(loss, self.dp_size))
        metrics = {k if k.startswith("rm/") else f"rm/{k}": v for k, v in metrics.items()}
        metrics["rm/seconds"] = time.perf_counter() - start
        return metrics

    def optim_step(self) -> dict[str, float]:
        return {f"rm/{k}": v for k, v in self.engine.optim_step().items()}

    def export_hf(self, out_dir: str) -> None:
        """The reward model as a HF directory that `AutoModelForSequenceClassification` loads."""
        self.engine.export_hf(out_dir)

    def save_state(self, path: str) -> None:
        """Sharded weights + optimizer of the trained model, and this rank's RNG states (`posttrain rm`)."""
        folder = Path(path) / "reward_model"
        self.engine.save(folder)
        torch.save(ProcessRNG().state_dict(), folder / f"rng_rank{self.rank}.pt")
        dist.barrier()

    def load_state(self, path: str) -> None:
        folder = Path(path) / "reward_model"
        self.engine.load(folder)
        rng_file = folder / f"rng_rank{self.rank}.pt"
        if rng_file.exists():
            ProcessRNG().load_state_dict(torch.load(rng_file, weights_only=False))
