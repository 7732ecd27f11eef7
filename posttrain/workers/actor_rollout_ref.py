"""ActorRolloutRef: the hybrid-engine worker colocating the trained policy, its sampler and the reference.

A plain class: the controller wraps it as a Ray actor (one per torch.distributed rank) or runs it
in-process. Its public methods are the explicit API's verbs; batches arrive already split for this rank.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from posttrain.config.schema_rl import VLLMConfig
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.engine.distributed import DistInfo
from posttrain.engine.engine_config import DTYPES, EngineConfig
from posttrain.engine.train_engine import TrainEngine
from posttrain.errors import ConfigError
from posttrain.rollout import make_rollout_engine
from posttrain.rollout.base import SamplingParams
from posttrain.workers.losses import LossSpec, build_loss
from posttrain.workers.process import ProcessRNG, prepare_worker_process, rank_seed
from posttrain.workers.sampling import sample_batch, untie_rollout_head


@dataclass(frozen=True)
class ActorRolloutRefSpec:
    engine: EngineConfig
    with_rollout: bool = True
    with_ref: bool = False
    # a frozen distillation teacher with the actor's tokenizer: forward(model="teacher")
    teacher: EngineConfig | None = None
    rollout_name: str = "native"
    rollout_max_batch_size: int = 256
    rollout_vllm: VLLMConfig = field(default_factory=VLLMConfig)  # rollout_name="vllm" only
    seed: int = 0
    threads: int = 0  # torch intra-op threads; 0 = leave as is
    record_routing: bool = False  # the sampler records each token's experts (routing replay, native engine)


class ActorRolloutRefWorker:
    """One SPMD rank of the actor: training engine, rollout engine, and (optionally) the frozen reference."""

    role = "actor_rollout_ref"

    def __init__(self, spec: ActorRolloutRefSpec, dist_info: DistInfo | None = None) -> None:
        dist_info = dist_info or DistInfo()
        prepare_worker_process(spec.threads, rank_seed(spec.seed, dist_info.rank))
        self.spec = spec
        self.rank = dist_info.rank
        self.actor = TrainEngine(spec.engine, dist_info)
        self.dp_size = self.actor.dp_size
        # with LoRA the reference is the actor's own base model with the adapter disabled: no second copy
        self.lora = spec.engine.lora.rank > 0
        self.ref = (
            TrainEngine(replace(spec.engine, trainable=False), dist_info)
            if spec.with_ref and not self.lora
            else None
        )
        self.teacher = TrainEngine(spec.teacher, dist_info) if spec.teacher is not None else None
        self.rollout = (
            make_rollout_engine(
                spec.rollout_name,
                spec.engine.model_path,
                device=self.actor.device,
                dtype=DTYPES[spec.engine.dtype],
                max_batch_size=spec.rollout_max_batch_size,
                seed=rank_seed(spec.seed, dist_info.rank, "sampler"),
                attn_implementation=spec.engine.attn_implementation,
                **({"record_routing": True} if spec.record_routing else {}),
                **({"vllm": spec.rollout_vllm} if spec.rollout_name == "vllm" else {}),
            )
            if spec.with_rollout
            else None
        )
        if self.rollout is not None and spec.engine.lora.adapts_output_head:
            untie_rollout_head(self.rollout)  # the merged head changes; the embeddings must not

    # ---- health --------------------------------------------------------------------------------
    def ping(self) -> dict[str, Any]:
        return {"rank": self.rank, "pid": os.getpid()}

    # ---- sample --------------------------------------------------------------------------------
    def sample(self, batch: Batch, sampling: SamplingParams) -> Batch:
        """Generate one response per row; returns [prompt | response] tensors and the response text."""
        if self.rollout is None:
            raise ConfigError("this worker was built without a rollout engine")
        return sample_batch(self.rollout, batch, sampling)

    # ---- forward / backward --------------------------------------------------------------------
    def forward(
        self, batch: Batch, model: str = "actor", temperature: float = 1.0, record_routing: bool = False
    ) -> Batch:
        """Log-probs of the responses under the actor (`old_log_probs`), the reference (`ref_log_prob`) or the
        distillation teacher (`teacher_log_prob`). `record_routing` (the actor only): also each token's experts
        in this pass (`routed_experts`, routing replay R2). The rollout's KV cache is freed first (as verl
        leaves rollout mode): these passes' logits would otherwise be held beside it."""
        if self.rollout is not None:
            self.rollout.sleep()
        if model == "actor" and record_routing:
            log_probs, routed = self.actor.compute_log_prob_and_routing(batch, temperature)
            return Batch.from_dict({keys.OLD_LOG_PROBS: log_probs, keys.ROUTED_EXPERTS: routed})
        if record_routing:
            raise ValueError(f"forward(record_routing=True) records the actor's routing, not the {model}'s")
        if model == "actor":
            return Batch.from_dict({keys.OLD_LOG_PROBS: self.actor.compute_log_prob(batch, temperature)})
        if model == "ref":
            if not self.spec.with_ref:
                raise ConfigError("this worker was built without a reference model (with_ref=False)")
            if self.lora:
                ref = self.actor.compute_log_prob(batch, temperature, disable_adapter=True)
            else:
                ref = self.ref.compute_log_prob(batch, temperature)
            return Batch.from_dict({keys.REF_LOG_PROB: ref})
        if model == "teacher":
            if self.teacher is None:
                raise ConfigError("this worker was built without a teacher model (teacher=None)")
            return Batch.from_dict({keys.TEACHER_LOG_PROB: self.teacher.compute_log_prob(batch, temperature)})
        raise ValueError(f"forward: unknown model '{model}'; valid: actor, ref, teacher")

    def forward_backward(self, batch: Batch, loss: LossSpec, temperature: float = 1.0) -> dict[str, float]:
        if self.rollout is not None:
            self.rollout.sleep()
        metrics = self.actor.forward_backward(
            batch, build_loss(loss, self.dp_size), temperature=temperature, with_entropy=loss.needs_entropy
        )
        if "router_aux_loss" in metrics:  # an MoE policy's load-balancing loss (model.router_aux_loss_coef)
            metrics["actor/router_aux_loss"] = metrics.pop("router_aux_loss")
        if "replayed_tokens" in metrics:  # token cells routed by recorded experts (actor.router_replay)
            metrics["actor/replayed_tokens"] = metrics.pop("replayed_tokens")
        return metrics

    def optim_step(self) -> dict[str, float]:
        return self.actor.optim_step()

    def rollout_weights(self) -> dict[str, torch.Tensor] | None:
        """The weights a separate sampler needs (split placement): on rank 0, all at once; None elsewhere.

        A collective: every rank takes part in gathering the shards, only rank 0 keeps the result.
        """
        tensors = {}
        for name, tensor in self.actor.named_tensors_for_rollout():
            if self.rank == 0:
                tensors[name] = tensor.detach().to("cpu", copy=True)
        return tensors if self.rank == 0 else None

    def sync_sampler(self) -> dict[str, float]:
        """Push the actor's current weights into the rollout engine, in-process, tensor by tensor."""
        start = time.perf_counter()
        tensors = self.actor.named_tensors_for_rollout()
        loaded = self.rollout.load_weights(tensors) if self.rollout is not None else sum(1 for _ in tensors)
        if self.rollout is not None:
            self.rollout.wake()
        return {"sync/tensors": float(loaded), "sync/seconds": time.perf_counter() - start}

    # ---- state ---------------------------------------------------------------------------------
    def save_state(self, path: str) -> None:
        """Sharded actor weights + optimizer, and this rank's RNG states (its sampler's included)."""
        self.actor.save(Path(path) / "actor")
        torch.save(self._rng().state_dict(), Path(path) / "actor" / f"rng_rank{self.rank}.pt")
        dist.barrier()

    def load_state(self, path: str) -> None:
        self.actor.load(Path(path) / "actor")
        rng_file = Path(path) / "actor" / f"rng_rank{self.rank}.pt"
        if rng_file.exists():
            self._rng().load_state_dict(torch.load(rng_file, weights_only=False))
        else:  # a checkpoint of a smaller world size: this rank keeps its own seed
            logging.getLogger(__name__).warning(
                "%s has no RNG state for rank %d (written by fewer workers); rank %d keeps its fresh seed",
                path,
                self.rank,
                self.rank,
            )
        self.sync_sampler()

    def _rng(self) -> ProcessRNG:
        return ProcessRNG(self.rollout.generator if self.rollout is not None else None)

    def export_hf(self, out_dir: str, merged: bool = True) -> None:
        """The policy as a HF directory; with LoRA, `merged=False` writes the adapter alone."""
        self.actor.export_hf(out_dir, merged=merged)
