"""Policy losses: per-token surrogate objectives aggregated with the caller's loss_agg_mode.

Every registered policy loss shares one calling convention:

    loss, metrics = fn(log_prob, old_log_prob, advantages, response_mask, *, loss_agg_mode,
                       global_tokens, global_seqs, dp_size, **options)

where the tensors are (B, R), `loss` is a scalar ready for backward (see `aggregation.aggregate_loss` for
the global totals) and `metrics` maps names to python floats computed over this micro-batch.
Pure: no I/O, no distributed code.
"""

from __future__ import annotations

import torch

from posttrain.algorithms.aggregation import aggregate_loss, masked_mean
from posttrain.algorithms.kl import kl_penalty
from posttrain.algorithms.registry import register_policy_loss
from posttrain.errors import ConfigError

# Bound on log(pi / pi_old) before exp: a ratio of e^20 is already meaningless, and exp of a larger value
# overflows in bf16/fp16 into inf, which would turn the loss into NaN.
_LOG_RATIO_CLAMP = 20.0


@register_policy_loss("vanilla")
def ppo_clip_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    global_tokens: int | float | torch.Tensor | None = None,
    global_seqs: int | float | torch.Tensor | None = None,
    dp_size: int = 1,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate (Schulman et al. 2017) with clip-higher and dual-clip.

    With r = exp(log_prob - old_log_prob) (log-ratio clamped to [-20, 20]) and advantage A, per token:

        L = max(-A * r, -A * clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))
        L = min(L, -A * clip_ratio_c)            where A < 0   (dual-clip, Ye et al. 2020, "Mastering
                                                                Complex Control in MOBA Games with DRL")

    An asymmetric range (clip_ratio_high > clip_ratio_low) is DAPO's "clip-higher" (Yu et al. 2025), which
    lets low-probability tokens grow and keeps entropy from collapsing. The dual clip bounds the loss of a
    negative-advantage token whose ratio has exploded; where it is active the gradient is zero.

    Metrics (python floats, over this micro-batch's valid tokens):
    `pg_clipfrac` fraction of tokens where the clipped term was taken, `pg_clipfrac_lower` fraction where
    the dual clip was active, `ppo_kl` mean of old_log_prob - log_prob (a k1 estimate of KL(old || new)).
    """
    if clip_ratio_c <= 1.0:
        raise ConfigError(f"clip_ratio_c must be > 1.0 for the dual-clip PPO loss, got {clip_ratio_c}")
    if not 0.0 <= clip_ratio_low < 1.0 or clip_ratio_high < 0.0:
        raise ConfigError(
            f"need 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, got {clip_ratio_low}, {clip_ratio_high}"
        )
    log_ratio = (log_prob - old_log_prob).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = log_ratio.exp()

    losses_unclipped = -advantages * ratio
    losses_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip_losses = torch.maximum(losses_unclipped, losses_clipped)
    dual_bound = -advantages * clip_ratio_c
    dual_losses = torch.minimum(clip_losses, dual_bound)
    negative = advantages < 0
    pg_losses = torch.where(negative, dual_losses, clip_losses)

    loss = aggregate_loss(pg_losses, response_mask, loss_agg_mode, global_tokens, global_seqs, dp_size)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((losses_clipped > losses_unclipped).float(), response_mask).item(),
            "pg_clipfrac_lower": masked_mean(
                ((clip_losses > dual_bound) & negative).float(), response_mask
            ).item(),
            "ppo_kl": masked_mean(-log_ratio, response_mask).item(),
        }
    return loss, metrics


def kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kind: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    global_tokens: int | float | torch.Tensor | None = None,
    global_seqs: int | float | torch.Tensor | None = None,
    dp_size: int = 1,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-to-reference penalty used as a loss term (GRPO's "KL in loss", Shao et al. 2024).

    loss = aggregate(kl_penalty(log_prob, ref_log_prob, kind)) with the same aggregation and global totals
    as the policy loss, so `pg_loss + kl_coef * kl_loss` stays split-invariant. The caller scales by kl_coef.
    Metric `kl_loss`: token mean of the estimate over this micro-batch (independent of the split).
    """
    kl = kl_penalty(log_prob, ref_log_prob, kind)
    loss = aggregate_loss(kl, response_mask, loss_agg_mode, global_tokens, global_seqs, dp_size)
    with torch.no_grad():
        metrics = {"kl_loss": masked_mean(kl, response_mask).item()}
    return loss, metrics
