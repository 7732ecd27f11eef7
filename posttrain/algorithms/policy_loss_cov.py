"""Covariance-based entropy control: the clip_cov and kl_cov policy losses.

Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models": the
entropy change of a softmax policy is driven by the covariance between a token's log-probability and its
advantage, and a few high-covariance tokens collapse entropy. Both losses act on those tokens only:
clip_cov removes the gradient of a random few of them, kl_cov adds a KL penalty to the top few.

The covariance Cov_t = (A_t - mean A) * (log pi_t - mean log pi) uses means over this micro-batch's valid
tokens (as verl does), so which tokens are picked depends on how the batch is split. Calling convention and
common metrics: see `policy_loss`. Pure: no I/O, no distributed code.
"""

from __future__ import annotations

import torch

from posttrain.algorithms.aggregation import masked_mean
from posttrain.algorithms.policy_loss import check_clip_range, policy_metrics, token_log_ratio
from posttrain.algorithms.registry import register_policy_loss
from posttrain.errors import ConfigError


def token_covariance(
    advantages: torch.Tensor, log_prob: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """(A - mean A) * (log_prob - mean log_prob) per token, means over valid tokens; no gradient."""
    with torch.no_grad():
        log_prob = log_prob.detach()
        centred_adv = advantages - masked_mean(advantages, response_mask)
        centred_logp = log_prob - masked_mean(log_prob, response_mask)
        return centred_adv * centred_logp


@register_policy_loss("clip_cov")
def clip_cov_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip-Cov (Cui et al. 2025): PPO clipping, plus no gradient for a random few high-covariance tokens.

    Per token L = max(-A * r, -A * clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)) (no dual clip, as
    verl). Among valid tokens that PPO did not clip and whose covariance lies in (clip_cov_lb, clip_cov_ub),
    max(1, floor(clip_cov_ratio * valid tokens)) are drawn uniformly (with `generator`, for reproducible
    draws) and their loss is multiplied by 0, which removes their gradient. Defaults are verl's.

    Metrics: `pg_clipfrac` is the PPO clip fraction (verl reports the covariance-clip fraction under that
    name instead), `clip_cov_frac` the fraction of valid tokens whose gradient was removed.
    """
    check_clip_range("clip_cov", clip_ratio_low, clip_ratio_high)
    if clip_cov_ratio <= 0.0:
        raise ConfigError(f"clip_cov: clip_cov_ratio must be > 0, got {clip_cov_ratio}")
    if clip_cov_lb >= clip_cov_ub:
        raise ConfigError(f"clip_cov: need clip_cov_lb < clip_cov_ub, got {clip_cov_lb}, {clip_cov_ub}")
    log_ratio = token_log_ratio(log_prob, old_log_prob)
    ratio = log_ratio.exp()
    losses_unclipped = -advantages * ratio
    losses_clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    ppo_clipped = losses_clipped > losses_unclipped

    with torch.no_grad():
        valid = response_mask > 0
        cov = token_covariance(advantages, log_prob, response_mask)
        candidates = valid & ~ppo_clipped & (cov > clip_cov_lb) & (cov < clip_cov_ub)
        candidate_idx = candidates.flatten().nonzero().squeeze(-1)
        n_pick = min(max(int(clip_cov_ratio * int(valid.sum())), 1), candidate_idx.numel())
        perm_device = generator.device if generator is not None else candidate_idx.device
        perm = torch.randperm(candidate_idx.numel(), generator=generator, device=perm_device)
        picked = candidate_idx[perm[:n_pick].to(candidate_idx.device)]
        keep = torch.ones_like(ratio, dtype=ratio.dtype)
        keep.view(-1)[picked] = 0.0
    pg_losses = torch.maximum(losses_unclipped, losses_clipped) * keep

    metrics = policy_metrics(response_mask, log_ratio, ratio, clipped=ppo_clipped)
    metrics["clip_cov_frac"] = masked_mean((keep == 0).float(), response_mask).item()
    return pg_losses, metrics


@register_policy_loss("kl_cov")
def kl_cov_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_cov_ratio: float = 2e-4,
    ppo_kl_coef: float = 0.1,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-Cov (Cui et al. 2025): unclipped policy gradient, plus a KL penalty on the top-covariance tokens.

    Per token L = -A * r; on the max(1, floor(kl_cov_ratio * valid tokens)) valid tokens of largest
    covariance, L = -A * r + ppo_kl_coef * |log r|. No clipping, so `pg_clipfrac` is 0. Defaults: verl's
    configured ones, kl_cov_ratio=2e-4 and ppo_kl_coef=0.1 (`actor.policy_loss.ppo_kl_coef` in verl's
    actor.yaml; only verl's loss function, called without a config, falls back to 1.0, the value of the
    paper's recipe recipe/entropy/*_kl_cov.sh).

    Metrics: `kl_cov_frac` the fraction of valid tokens penalised, `ppo_kl_abs` the token mean of |log r|
    (what verl reports as ppo_kl for this loss; `ppo_kl` here keeps its common meaning).
    """
    if not 0.0 < kl_cov_ratio <= 1.0:
        raise ConfigError(f"kl_cov: kl_cov_ratio must be in (0, 1], got {kl_cov_ratio}")
    if ppo_kl_coef < 0.0:
        raise ConfigError(f"kl_cov: ppo_kl_coef must be >= 0, got {ppo_kl_coef}")
    log_ratio = token_log_ratio(log_prob, old_log_prob)
    ratio = log_ratio.exp()

    with torch.no_grad():
        valid = response_mask > 0
        n_valid = int(valid.sum())
        penalised = torch.zeros_like(valid)
        if n_valid > 0:
            cov = token_covariance(advantages, log_prob, response_mask).masked_fill(~valid, float("-inf"))
            n_pick = max(int(kl_cov_ratio * n_valid), 1)
            penalised.view(-1)[cov.flatten().topk(n_pick).indices] = True
    abs_kl = log_ratio.abs()
    pg_losses = -advantages * ratio + ppo_kl_coef * abs_kl * penalised.to(ratio.dtype)

    metrics = policy_metrics(response_mask, log_ratio, ratio, clipped=None)
    metrics["kl_cov_frac"] = masked_mean(penalised.float(), response_mask).item()
    metrics["ppo_kl_abs"] = masked_mean(abs_kl.detach(), response_mask).item()
    return pg_losses, metrics
