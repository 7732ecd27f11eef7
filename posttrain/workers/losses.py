"""Losses by name for `forward_backward`: the engine computes log-probs, these turn them into a scalar.

A `LossSpec` is a plain, picklable value (it crosses Ray); `build_loss` makes the callable on the worker.
Names: `ppo` (a registered policy loss + optional KL-to-reference and entropy terms), `value` (the critic's
clipped value loss) and `cross_entropy` (SFT: mean negative log-likelihood over `loss_mask` tokens).
An unknown name is an error listing them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.algorithms.aggregation import aggregate_loss, masked_mean
from posttrain.algorithms.policy_loss import kl_loss
from posttrain.algorithms.registry import get_policy_loss
from posttrain.algorithms.value_loss import clipped_value_loss
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.engine.train_engine import LossFn
from posttrain.errors import ConfigError

LOSS_NAMES = ("ppo", "value", "cross_entropy")


@dataclass(frozen=True)
class LossSpec:
    name: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def needs_entropy(self) -> bool:
        return self.name == "ppo" and float(self.options.get("entropy_coeff", 0.0)) != 0.0


def build_loss(spec: LossSpec, dp_size: int) -> LossFn:
    """The callable for `spec`; totals for normalisation come from the micro-batch's meta."""
    if spec.name == "ppo":
        return _ppo_loss(spec.options, dp_size)
    if spec.name == "value":
        return _value_loss(spec.options, dp_size)
    if spec.name == "cross_entropy":
        return _cross_entropy_loss(dp_size)
    raise ConfigError(f"unknown loss '{spec.name}'; valid: {', '.join(LOSS_NAMES)}")


def _totals(mb: Batch, mask: torch.Tensor) -> dict[str, Any]:
    return {
        "global_tokens": mb.meta.get(keys.GLOBAL_TOKENS, float(mask.sum())),
        "global_seqs": mb.meta.get(keys.GLOBAL_SEQS, mask.shape[0]),
    }


def _ppo_loss(options: dict[str, Any], dp_size: int) -> LossFn:
    options = dict(options)
    policy_loss = get_policy_loss(options.pop("policy_loss", "vanilla"))
    use_kl = bool(options.pop("use_kl_loss", False))
    kl_coef = float(options.pop("kl_loss_coef", 0.0))
    kl_type = str(options.pop("kl_loss_type", "k3"))
    entropy_coeff = float(options.pop("entropy_coeff", 0.0))
    agg_mode = str(options.pop("loss_agg_mode", "token-mean"))

    def loss_fn(log_probs: torch.Tensor, entropy: torch.Tensor | None, mb: Batch):
        mask = mb[keys.RESPONSE_MASK].to(log_probs.dtype)
        totals = _totals(mb, mask)
        on_policy = keys.OLD_LOG_PROBS not in mb  # one optimizer step per batch: these are the old ones
        old_log_probs = log_probs.detach() if on_policy else mb[keys.OLD_LOG_PROBS]
        loss, metrics = policy_loss(
            log_probs,
            old_log_probs,
            mb[keys.ADVANTAGES],
            mask,
            loss_agg_mode=agg_mode,
            dp_size=dp_size,
            rollout_log_probs=mb[keys.ROLLOUT_LOG_PROBS] if keys.ROLLOUT_LOG_PROBS in mb else None,
            **totals,
            **options,
        )
        metrics = {f"actor/{k}": v for k, v in metrics.items()}
        metrics["actor/pg_loss"] = float(loss.detach())  # rank-averaged by the group: the true loss
        if on_policy and keys.ROLLOUT_LOG_PROBS in mb:
            diff = (log_probs.detach() - mb[keys.ROLLOUT_LOG_PROBS]).abs() * mask
            metrics["rollout/logprob_diff_max"] = float(diff.max())
            metrics["rollout/logprob_diff_mean"] = float(diff.sum() / mask.sum().clamp(min=1))
        if use_kl:
            kl_value, kl_metrics = kl_loss(
                log_probs,
                mb[keys.REF_LOG_PROB],
                mask,
                kind=kl_type,
                loss_agg_mode=agg_mode,
                dp_size=dp_size,
                **totals,
            )
            loss = loss + kl_coef * kl_value
            metrics.update({f"actor/{k}": v for k, v in kl_metrics.items()})
        if entropy is not None:
            entropy_term = aggregate_loss(entropy, mask, agg_mode, dp_size=dp_size, **totals)
            loss = loss - entropy_coeff * entropy_term
        if entropy is not None:
            metrics["actor/entropy"] = float(masked_mean(entropy.detach(), mask))
        return loss, metrics

    return loss_fn


def _value_loss(options: dict[str, Any], dp_size: int) -> LossFn:
    cliprange_value = float(options.get("cliprange_value", 0.5))
    agg_mode = str(options.get("loss_agg_mode", "token-mean"))

    def loss_fn(values: torch.Tensor, entropy: torch.Tensor | None, mb: Batch):
        mask = mb[keys.RESPONSE_MASK].to(values.dtype)
        loss, metrics = clipped_value_loss(
            values,
            mb[keys.VALUES],
            mb[keys.RETURNS],
            mask,
            cliprange_value=cliprange_value,
            loss_agg_mode=agg_mode,
            dp_size=dp_size,
            **_totals(mb, mask),
        )
        metrics = {f"critic/{k}": v for k, v in metrics.items()}
        metrics["critic/vf_loss"] = float(loss.detach())
        return loss, metrics

    return loss_fn


def _cross_entropy_loss(dp_size: int) -> LossFn:
    def loss_fn(log_probs: torch.Tensor, entropy: torch.Tensor | None, mb: Batch):
        mask = mb["loss_mask"].to(log_probs.dtype)
        totals = _totals(mb, mask)
        loss = aggregate_loss(-log_probs, mask, "token-mean", dp_size=dp_size, **totals)
        return loss, {"sft/nll": float(masked_mean(-log_probs.detach(), mask))}

    return loss_fn
