"""Policy losses: per-token surrogate objectives, and the one place they become the scalar for backward.

Every registered policy loss shares one calling convention:

    pg_losses, metrics = fn(log_prob, old_log_prob, advantages, response_mask, **own_options)

where the tensors are (B, R) and `pg_losses` is the (B, R) per-token loss (its padding entries are ignored).
A loss's own options are keyword-only, with the loss's documented defaults in its signature (see
`own_options`): a caller passes only the options a user set, so an option left unset means the loss's own
default. `metrics` maps names to python floats over this micro-batch's valid tokens; every loss reports
`pg_clipfrac` and `pg_clipfrac_lower` (0 where the loss has no such clip), `ppo_kl` (token mean of
old_log_prob - log_prob), `ratio_mean` and `ratio_max` (over valid tokens of the ratio the loss uses).

`compute_policy_loss` is the caller's side, once per micro-batch: it applies the rollout correction (old
policy, truncated importance-sampling weights, rejection mask; `rollout_correction.py`) and aggregates with
`aggregate_loss` under the caller's loss_agg_mode and mini-batch totals. No loss aggregates on its own, so
none can override the mode it is given, even where the paper recommends another one (its docstring says
which).

This module holds the shared pieces and the PPO loss; `policy_loss_variants` (gspo, sapo, cispo, dro, gpg,
geo_mean), `policy_loss_dppo` (dppo_tv, dppo_kl) and `policy_loss_cov` (clip_cov, kl_cov) hold the others.
Pure: no I/O, no distributed code.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from posttrain.algorithms.aggregation import aggregate_loss, masked_mean
from posttrain.algorithms.kl import kl_penalty
from posttrain.algorithms.registry import register_policy_loss
from posttrain.algorithms.rollout_correction import RolloutCorrection, apply_rollout_correction
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
    rollout_correction: RolloutCorrection | None = None,
    loss_agg_mode: str = "token-mean",
    global_tokens: Total = None,
    global_seqs: Total = None,
    dp_size: int = 1,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The scalar policy loss of one micro-batch: loss_fn's per-token losses, corrected, then aggregated.

        loss = aggregate(w * keep * loss_fn(log_prob, old, advantages, m * keep, **options), m)

    `rollout_correction` (verl's `algorithm.rollout_correction`, see `rollout_correction.py`) gives the old
    policy (`old_log_prob`, or the rollout log-probs in bypass mode), the truncated IS weights w (1 when off)
    and the rejection mask keep (1 when off). The loss sees the kept tokens only (its statistics, e.g. GSPO's
    sequence ratio, leave rejected ones out), while `aggregate_loss` runs on the mask m before rejection: a
    rejected token adds no loss but keeps its place in every normaliser (tokens, sequences, a row's length),
    so rejecting never scales the other tokens up. It uses `loss_agg_mode` and the mini-batch totals (see
    `aggregation` for `global_tokens`, `global_seqs`, `dp_size`; `loss_scale_factor` is the constant of
    "seq-mean-token-sum-norm", default the response width). Metrics: the loss's own, plus the correction's
    (`rollout_is_*`, `rollout_rs_*`) when one is on.
    """
    correction = rollout_correction or RolloutCorrection()
    corrected = apply_rollout_correction(log_prob, old_log_prob, rollout_log_probs, response_mask, correction)
    keep = None if corrected.keep is None else corrected.keep.to(response_mask.dtype)
    loss_mask = response_mask if keep is None else response_mask * keep
    pg_losses, metrics = loss_fn(
        log_prob, corrected.old_log_prob, advantages, loss_mask, **dict(options or {})
    )
    if keep is not None:  # where, not a product: a rejected token's loss may be inf or NaN
        pg_losses = torch.where(keep > 0, pg_losses, torch.zeros_like(pg_losses))
    if corrected.weights is not None:
        pg_losses = pg_losses * corrected.weights
    metrics.update(corrected.metrics)
    loss = aggregate_loss(
        pg_losses, response_mask, loss_agg_mode, global_tokens, global_seqs, dp_size, width=loss_scale_factor
    )
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


def policy_metrics(
    response_mask: torch.Tensor,
    log_ratio: torch.Tensor,
    ratio: torch.Tensor,
    clipped: torch.Tensor | None,
    clipped_lower: torch.Tensor | None = None,
) -> dict[str, float]:
    """The metrics every loss reports, over this micro-batch's valid tokens.

    `log_ratio` is the token log(pi / pi_old) (for ppo_kl), `ratio` the ratio the loss works with (for the
    ratio stats), `clipped` a bool (B, R) of tokens where a clip was active, or None where none exists;
    `clipped_lower` the same for the loss's second clip (`pg_clipfrac_lower`: PPO's dual clip, GMPO's clip
    of negative-advantage tokens, DPPO's truncation), None where it has none.
    """
    with torch.no_grad():
        valid = response_mask > 0

        def fraction(flags: torch.Tensor | None) -> float:
            return 0.0 if flags is None else masked_mean(flags.float(), response_mask).item()

        ratio_max = ratio.detach().masked_fill(~valid, float("-inf")).max().item() if valid.any() else 0.0
        return {
            "pg_clipfrac": fraction(clipped),
            "pg_clipfrac_lower": fraction(clipped_lower),
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

    clipped = losses_clipped > losses_unclipped
    dual_active = (clip_losses > dual_bound) & negative
    metrics = policy_metrics(response_mask, log_ratio, ratio, clipped=clipped, clipped_lower=dual_active)
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
