"""Rollout: one sampler of its own (split placement), fed weights by the trainer after each update.

Used when `resources.rollout` names a pool other than the trainer's: generation and training then run on
different workers, and weights travel from the actor's rank 0 through Ray's object store. No
torch.distributed group: samplers never talk to each other.

Streaming (`async_rl.streaming`): `stream_submit` queues rows on the engine's continuous batching and returns at
once; `stream_collect` hands back whichever rows have finished, so the driver can form a step's batch from the
groups that complete first while the others keep generating (trainers/streaming.py).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain.config.schema_rl import VLLMConfig
from posttrain.data.batch import Batch
from posttrain.engine.distributed import DistInfo, resolve_device
from posttrain.engine.engine_config import DTYPES
from posttrain.errors import ConfigError
from posttrain.rollout import make_rollout_engine
from posttrain.rollout.base import GenerationRequest, SamplingParams
from posttrain.workers.process import ProcessRNG, prepare_worker_process, rank_seed
from posttrain.workers.sampling import batch_prompts, results_batch, sample_batch, untie_rollout_head


@dataclass
class _Submission:
    """Rows queued by one `stream_submit`, with the futures of those not collected yet."""

    rows: Batch
    sampling: SamplingParams
    futures: dict[int, Future]  # row index in `rows` -> its GenerationResult
    submitted: float


@dataclass(frozen=True)
class RolloutSpec:
    model_path: str
    name: str = "native"
    vllm: VLLMConfig = field(default_factory=VLLMConfig)  # name="vllm" only
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    max_batch_size: int = 256
    seed: int = 0
    threads: int = 0
    record_routing: bool = (
        False  # the sampler records each token's experts (routing replay R3, native engine)
    )
    # LoRA adapts the output projection (`lm_head` in target_modules): the synced head is W_E + BA while the
    # embeddings stay W_E, so a tied model's sampler gets a head of its own
    adapted_head: bool = False


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
            **({"record_routing": True} if spec.record_routing else {}),
            **({"vllm": spec.vllm} if spec.name == "vllm" else {}),
        )
        if spec.adapted_head:
            untie_rollout_head(self.engine)
        self._streams: list[_Submission] = []

    def ping(self) -> dict[str, Any]:
        return {"rank": self.rank, "pid": os.getpid()}

    def sample(self, batch: Batch, sampling: SamplingParams) -> Batch:
        return sample_batch(self.engine, batch, sampling)

    def stream_submit(self, batch: Batch, sampling: SamplingParams) -> None:
        """Queue one request per row of `batch` on the engine's scheduler thread and return at once."""
        if not hasattr(self.engine, "submit_many"):
            raise ConfigError(
                "async_rl.streaming needs a rollout engine with an asynchronous request API: rollout.name=native"
            )
        self.engine.wake()
        requests = [GenerationRequest(prompt, sampling) for prompt in batch_prompts(batch)]
        futures = self.engine.submit_many(requests)
        self._streams.append(_Submission(batch, sampling, dict(enumerate(futures)), time.perf_counter()))

    def stream_collect(self, wait_s: float) -> list[Batch]:
        """The rows finished since the last call (one Batch per submission they came from, the submitted
        non-tensor columns kept); waits up to `wait_s` seconds for a first one. An empty list: none yet."""
        pending = [f for sub in self._streams for f in sub.futures.values()]
        if pending and not any(f.done() for f in pending):
            wait(pending, timeout=wait_s, return_when=FIRST_COMPLETED)
        out: list[Batch] = []
        for sub in self._streams:
            done = sorted(i for i, f in sub.futures.items() if f.done())
            if not done:
                continue
            results = [sub.futures.pop(i).result() for i in done]  # an engine failure raises here
            for i, result in zip(done, results, strict=True):
                if result.error is not None:
                    raise ValueError(f"request {i}: {result.error}")
            rows = sub.rows.index(done)
            seconds = time.perf_counter() - sub.submitted
            batch = results_batch(
                rows, results, self.engine.pad_id, sub.sampling.max_tokens, seconds, sub.sampling.temperature
            )
            out.append(batch.union(rows.select(tensor_keys=[])))
        self._streams = [sub for sub in self._streams if sub.futures]
        return out

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> dict[str, float]:
        running = sum(not f.done() for sub in self._streams for f in sub.futures.values())
        if running:  # the engine would take the weights between two decode steps: one sequence, two versions
            raise RuntimeError(f"load_weights with {running} streamed requests still generating")
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
