"""Per-step throughput, phase time shares and MFU of the RL loop, from the step's batch and phase timings.

MFU = model FLOPs of a phase / (phase seconds x peak FLOP/s per worker x workers); FLOPs as defined in
`posttrain.tracking.flops` (causal attention pairs, backward = 2 x forward, no recomputation). Generation
and the passes that score responses (log-probs, values, updates) count each prompt once per group of
`rollout.n` samples and the head only where a response token is predicted: the work the step needs, not what
an implementation happens to run (so `model.share_prompt=false` shows as a lower MFU). The peak is
`trainer.peak_flops_per_worker`, or measured once at start-up with a short matmul loop on the workers' device
type and thread count.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.config.schema import RLConfig
from posttrain.controller.ray_env import cluster_has_gpus
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.models import load_text_config
from posttrain.tracking.flops import forward_flops, generation_flops, measure_matmul_flops, train_flops

log = logging.getLogger(__name__)


def worker_device(cfg: RLConfig) -> str:
    """Where the workers compute (Ray must be started for backend=ray with device=auto)."""
    t = cfg.trainer
    if t.device != "auto":
        return t.device
    if t.backend == "local":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if cluster_has_gpus() else "cpu"


def peak_flops_per_worker(cfg: RLConfig, threads: int) -> float:
    """`trainer.peak_flops_per_worker`, or a ~0.4 s matmul measurement in the model's dtype on the workers'
    device type with their thread count; 0.0 (MFU not logged) when that device is not visible here."""
    if cfg.trainer.peak_flops_per_worker > 0:
        return cfg.trainer.peak_flops_per_worker
    device = worker_device(cfg)
    if device == "cuda" and not torch.cuda.is_available():
        log.warning(
            "workers run on CUDA but the driver sees no GPU, so the peak FLOP/s cannot be measured here: "
            "set trainer.peak_flops_per_worker to log perf/mfu"
        )
        return 0.0
    compute = cfg.model.compute_dtype or cfg.model.dtype
    dtype = torch.bfloat16 if compute == "bfloat16" else torch.float32
    return measure_matmul_flops(threads=threads if device == "cpu" else 0, device=device, dtype=dtype)


@dataclass(frozen=True)
class PerfMeter:
    """Turns one step's batch and `timing/<phase>` seconds into `throughput/*`, `timing_share/*`, `perf/*`."""

    actor_model: dict[str, Any]  # HF config dicts
    critic_model: dict[str, Any] | None
    actor_epochs: int
    actor_frozen: bool  # LoRA: the base weights get no gradients
    critic_epochs: int
    samples_per_prompt: int
    peak_flops_per_worker: float  # 0 = unknown: no MFU
    n_workers: int

    @classmethod
    def from_config(cls, cfg: RLConfig, threads: int) -> PerfMeter:
        critic_path = cfg.critic.model_path or cfg.model.path
        return cls(
            # a vision-language model's language model (its vision tower's FLOPs are not counted)
            actor_model=load_text_config(cfg.model.path).to_dict(),
            critic_model=load_text_config(critic_path).to_dict() if cfg.critic.enable else None,
            actor_epochs=cfg.actor.ppo_epochs,
            actor_frozen=cfg.model.lora.rank > 0,
            critic_epochs=cfg.critic.ppo_epochs,
            samples_per_prompt=cfg.rollout.n,
            peak_flops_per_worker=peak_flops_per_worker(cfg, threads),
            n_workers=cfg.trainer.world_size,
        )

    def phase_work(
        self, batch: Batch, gen_tokens: float, timings: dict[str, float]
    ) -> dict[str, tuple[float, float]]:
        """(tokens, model FLOPs) of each phase that ran this step."""
        mask = batch[keys.ATTENTION_MASK]
        width = batch[keys.RESPONSE_MASK].shape[1]
        lens = mask.sum(-1)
        tokens = float(lens.sum())
        responses = batch[keys.RESPONSE_MASK].sum(-1)
        prompts = mask[:, :-width].sum(-1)
        shape = {"prompt_lens": prompts, "samples_per_prompt": self.samples_per_prompt}
        forward = forward_flops(self.actor_model, lens, **shape)
        gen = generation_flops(self.actor_model, prompts, responses, self.samples_per_prompt)
        # dynamic sampling's dropped rounds and ReMax's greedy pass generated more than the batch holds
        gen *= gen_tokens / max(float(responses.sum()), 1.0)
        work = {
            "gen": (gen_tokens, gen),
            "old_log_prob": (tokens, forward),
            "ref": (tokens, forward),
            "update_actor": (
                self.actor_epochs * tokens,
                self.actor_epochs
                * train_flops(self.actor_model, lens, frozen_weights=self.actor_frozen, **shape),
            ),
        }
        if self.critic_model is not None:
            work["values"] = (tokens, forward_flops(self.critic_model, lens, head="value", **shape))
            work["update_critic"] = (
                self.critic_epochs * tokens,
                self.critic_epochs * train_flops(self.critic_model, lens, head="value", **shape),
            )
        return {phase: w for phase, w in work.items() if timings.get(f"timing/{phase}", 0.0) > 0}

    def metrics(
        self, batch: Batch, timings: dict[str, float], gen_metrics: dict[str, float]
    ) -> dict[str, float]:
        step_s = timings["timing/step"]
        gen_tokens = gen_metrics.get("throughput/gen_tokens_total", float(batch[keys.RESPONSE_MASK].sum()))
        work = self.phase_work(batch, gen_tokens, timings)
        asynchronous = any(name.startswith("async/") for name in gen_metrics)
        if asynchronous:
            # generation ran on the rollout pool beside the update: the trainer's `timing/gen` is its wait for
            # a batch, and the trainer workers' peak is not what generated; the producer's own time is used
            work.pop("gen", None)
            gen_seconds = gen_metrics.get("async/gen_seconds", 0.0)
        out = {"throughput/tokens_per_s": float(batch[keys.ATTENTION_MASK].sum()) / step_s}
        for name, seconds in timings.items():
            if name != "timing/step":
                out[f"timing_share/{name.removeprefix('timing/')}"] = seconds / step_s
        for phase, (tokens, _) in work.items():
            out[f"throughput/{phase}_tokens_per_s"] = tokens / timings[f"timing/{phase}"]
        if asynchronous and gen_seconds > 0:
            out["throughput/gen_tokens_per_s"] = gen_tokens / gen_seconds
        peak = self.peak_flops_per_worker * self.n_workers
        if peak > 0:
            out["perf/peak_flops_per_worker"] = self.peak_flops_per_worker
            for phase, (_, flops) in work.items():
                out[f"perf/mfu/{phase}"] = flops / (timings[f"timing/{phase}"] * peak)
            out["perf/mfu"] = sum(flops for _, flops in work.values()) / (step_s * peak)
        return out
