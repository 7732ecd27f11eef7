"""What every worker process does first (thread budget, quiet model loads, its seeds), and the random state
of a process, seeded and checkpointed one way: the driver and every worker use this.

`rank_seed` derives each rank's seeds from the run's seed, one stream per purpose, so that ranks differ,
roles differ, and a colocated sampler and a sampler on a pool of its own draw the same numbers.
`ProcessRNG` is the Stateful part of a checkpoint holding Python's, NumPy's and torch's global RNGs, and
optionally one more generator (a rollout engine's sampler).
"""

from __future__ import annotations

import random
from typing import Any, Literal

import numpy as np
import torch

# Offsets per rank of each seed stream (kept as they were, so runs repeat across versions).
SeedStream = Literal["process", "critic", "sampler", "adapter"]
_RANK_STRIDE = {
    "process": 1000,
    "critic": 1000,
    "sampler": 7919,
    "adapter": 0,
}  # adapters: alike on all ranks
_ROLE_OFFSET = {"process": 0, "critic": 17, "sampler": 0, "adapter": 31}


def rank_seed(seed: int, rank: int, stream: SeedStream = "process") -> int:
    """The seed of `stream` on `rank`: `process` for a worker's global RNGs (actor, sampler pool), `critic`
        for the critic's, `sampler` for a rollout engine's generator, `adapter` for new LoRA adapters (the same on
    every rank: adapters are replicated)."""
    return seed + _RANK_STRIDE[stream] * rank + _ROLE_OFFSET[stream]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def quiet_transformers() -> None:
    """No per-load progress bars from transformers: a run loads the model several times per worker."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def prepare_worker_process(threads: int, seed: int) -> None:
    """What every worker does first: its thread budget (0 = leave as is), quiet loads, its own seed."""
    if threads > 0:
        torch.set_num_threads(threads)
    quiet_transformers()
    seed_everything(seed)


class ProcessRNG:
    """This process's global RNG states (and `generator`'s, when given) as a checkpointable part."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def state_dict(self) -> dict[str, Any]:
        return {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            # every visible GPU's stream (dropout, sampling on the device); None on a CPU-only process
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "generator": self.generator.get_state() if self.generator is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        np.random.set_state(state["numpy"])
        torch.set_rng_state(state["torch"])
        if state.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
        # checkpoints written before this class named the generator after its owner
        generator = state.get("generator", state.get("rollout", state.get("sampler")))
        if self.generator is not None and generator is not None:
            self.generator.set_state(generator)
