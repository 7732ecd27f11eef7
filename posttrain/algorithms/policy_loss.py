"""Policy losses: per-token surrogate objectives, and the one place they become the scalar for backward.

Every registered policy loss shares one calling convention:

    pg_losses, metrics = fn(log_prob, old_log_prob, advantages, response_mask, **own_options)

where the tensors are (B, R) and `pg_losses` is the (B, R) per-token loss (its padding entries are ignored).
A loss's own options are keyword-only, with the loss's documented defaults in its signature (see
`own_options`): a caller passes only the options a user set, so an option left unset means the loss's own
default. `metrics` maps names to python floats over this micro-batch's valid tokens; every loss reports
`pg_clipfrac` (0 where no clipping exists), `ppo_kl` (token mean of old_log_prob - log_prob), `ratio_mean`
and `ratio_max` (over valid tokens of the ratio the loss uses).

`compute_policy_loss` is the caller's side, once per micro-batch: it weighs the per-token losses by the
truncated importance-sampling weights (`truncated_is_weights`) and aggregates them with `aggregate_loss`
under the caller's loss_agg_mode and mini-batch totals. No loss aggregates on its own, so none can override
the mode it is given, even where the paper recommends another one (its docstring says which).

This module holds the shared pieces and the PPO loss; `policy_loss_variants` (gspo, sapo, cispo, dro, gpg)
and `policy_loss_cov` (clip_cov, kl_cov) hold the others. Pure: no I/O, no distributed code.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from posttrain.algorithms.aggregation import aggregate_loss, masked_mean
from posttrain.algorithms.kl import kl_penalty
from posttrain.algorithms.registry import register_policy_loss
from posttrain.errors import ConfigError

# Bound on log(pi / pi_old) before exp: a ratio of e^20 is already meaningless, and exp of a larger value
# overflows in bf16/fp16 into inf, which would turn the loss into NaN.
LOG_RATIO_CLAMP = 20.0

Total = int | float | torch.Tensor | None
PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, float]]]


def own_options(loss_fn: PolicyLoss) -> dict[str, Any]:
    """A policy loss's own options and their defaults: its keyword-only parameters."""
    params = inspect.signature(loss_fn).parameters.values()
    return {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


def compute_policy_loss(
    loss_fn: PolicyLoss,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    options: Mapping[str, Any] | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    tis_cap: float = 0.0,
    loss_agg_mode: str = "token-mean",
    global_tokens: Total = None,
    global_seqs: Total = None,
    dp_size: int = 1,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The scalar policy loss of one micro-batch: loss_fn's per-token losses, weighed, then aggregated.

        loss = aggregate(w * loss_fn(log_prob, old_log_prob, advantages, response_mask, **options))

    with w the truncated IS weights (1 when tis_cap == 0) and `aggregate_loss` under `loss_agg_mode` with the
    mini-batch totals (see `aggregation` for `global_tokens`, `global_seqs`, `dp_size`). Adds
    `tis_weight_mean` and `tis_capped_frac` (fraction of tokens whose weight hit the cap) when TIS is on.
    """
    pg_losses, metrics = loss_fn(log_prob, old_log_prob, advantages, response_mask, **dict(options or {}))
    tis_weights = truncated_is_weights(old_log_prob, rollout_log_probs, tis_cap)
    if tis_weights is not None:
        pg_losses = pg_losses * tis_weights
        with torch.no_grad():
            metrics["tis_weight_mean"] = masked_mean(tis_weights, response_mask).item()
            metrics["tis_capped_frac"] = masked_mean((tis_weights >= tis_cap).float(), response_mask).item()
    loss = aggregate_loss(pg_losses, response_mask, loss_agg_mode, global_tokens, global_seqs, dp_size)
    return loss, metrics


def token_log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    """log(pi / pi_old) per token, clamped to [-20, 20] so that its exp stays finite."""
    return (log_prob - old_log_prob).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def check_clip_range(loss_name: str, clip_ratio_low: float, clip_ratio_high: float) -> None:
    """Raise ConfigError unless 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0."""
    if not 0.0 <= clip_ratio_low < 1.0 or clip_ratio_high < 0.0:
        raise ConfigError(
            f"{loss_name}: need 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, "
            f"got {clip_ratio_low}, {clip_ratio_high}"
        )


def truncated_is_weights(
    old_log_prob: torch.Tensor, rollout_log_probs: torch.Tensor | None, tis_cap: float
) -> torch.Tensor | None:
    """Truncated importance-sampling weights for the rollout/training mismatch, or None when off.

    w = sg[min(pi_old / pi_rollout, tis_cap)] = sg[min(exp(old_log_prob - rollout_log_probs), tis_cap)]
    (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"): the
    inference engine samples from a slightly different distribution than the trainer computes, so each
    token's loss is reweighted by the capped ratio. Off when tis_cap == 0 (the default), whether or not
    rollout log-probs are given. Raises ConfigError for tis_cap < 0 or tis_cap > 0 without rollout log-probs.
    """
    if tis_cap < 0.0:
        raise ConfigError(f"tis_cap must be >= 0 (0 turns truncated importance sampling off), got {tis_cap}")
    if tis_cap == 0.0:
        return None
    if rollout_log_probs is None:
        raise ConfigError(
            f"tis_cap={tis_cap} turns on truncated importance sampling, which needs rollout_log_probs "
            "(the log-probs the rollout engine sampled with); pass them or set tis_cap=0"
        )
    with torch.no_grad():
        log_w = (old_log_prob - rollout_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return log_w.exp().clamp(max=tis_cap).detach()


def policy_metrics(
    response_mask: torch.Tensor,
    log_ratio: torch.Tensor,
    ratio: torch.Tensor,
    clipped: torch.Tensor | None,
) -> dict[str, float]:
    """The metrics every loss reports, over this micro-batch's valid tokens.

    `log_ratio` is the token log(pi / pi_old) (for ppo_kl), `ratio` the ratio the loss works with (for the
    ratio stats), `clipped` a bool (B, R) of tokens where a clip was active, or None where none exists.
    """
    with torch.no_grad():
        valid = response_mask > 0
        clipfrac = 0.0 if clipped is None else masked_mean(clipped.float(), response_mask).item()
        ratio_max = ratio.detach().masked_fill(~valid, float("-inf")).max().item() if valid.any() else 0.0
        return {
            "pg_clipfrac": clipfrac,
            "ppo_kl": masked_mean(-log_ratio.detach(), response_mask).item(),
            "ratio_mean": masked_mean(ratio.detach(), response_mask).item(),
            "ratio_max": ratio_max,
        }


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
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate (Schulman et al. 2017) with clip-higher and dual-clip.

    With r = exp(log_prob - old_log_prob) (log-ratio clamped to [-20, 20]) and advantage A, per token:

        L = max(-A * r, -A * clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))
        L = min(L, -A * clip_ratio_c)            where A < 0   (dual-clip, Ye et al. 2020, "Mastering
                                                                Complex Control in MOBA Games with DRL")

    An asymmetric range (clip_ratio_high > clip_ratio_low) is DAPO's "clip-higher" (Yu et al. 2025), which
    lets low-probability tokens grow and keeps entropy from collapsing. The dual clip bounds the loss of a
    negative-advantage token whose ratio has exploded; where it is active the gradient is zero.

    Defaults: the symmetric 0.2 of the PPO paper and verl, and verl's dual-clip bound 3.0.
    Metrics besides the common ones: `pg_clipfrac` is the fraction of tokens where the clipped term was
    taken, `pg_clipfrac_lower` the fraction where the dual clip was active.
    """
    if clip_ratio_c <= 1.0:
        raise ConfigError(f"clip_ratio_c must be > 1.0 for the dual-clip PPO loss, got {clip_ratio_c}")
    check_clip_range("vanilla", clip_ratio_low, clip_ratio_high)
    log_ratio = token_log_ratio(log_prob, old_log_prob)
    ratio = log_ratio.exp()

    losses_unclipped = -advantages * ratio
    losses_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clip_losses = torch.maximum(losses_unclipped, losses_clipped)
    dual_bound = -advantages * clip_ratio_c
    dual_losses = torch.minimum(clip_losses, dual_bound)
    negative = advantages < 0
    pg_losses = torch.where(negative, dual_losses, clip_losses)

    metrics = policy_metrics(response_mask, log_ratio, ratio, clipped=losses_clipped > losses_unclipped)
    with torch.no_grad():
        dual_active = (clip_losses > dual_bound) & negative
        metrics["pg_clipfrac_lower"] = masked_mean(dual_active.float(), response_mask).item()
    return pg_losses, metrics


def kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kind: str = "low_var_kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-to-reference penalty used as a loss term (GRPO's "KL in loss", Shao et al. 2024), per token.

    Returns the (B, R) estimate kl_penalty(log_prob, ref_log_prob, kind); the caller aggregates it with the
    same mode and global totals as the policy loss, so `pg_loss + kl_coef * kl_loss` stays split-invariant.
    Metric `kl_loss`: token mean of the estimate over this micro-batch (independent of the split).
    """
    kl = kl_penalty(log_prob, ref_log_prob, kind)
    with torch.no_grad():
        metrics = {"kl_loss": masked_mean(kl, response_mask).item()}
    return kl, metrics
