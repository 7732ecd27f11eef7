"""Policy losses that change the ratio or its clip: gspo, sapo, cispo, dro, gpg, geo_mean (GMPO).

Each follows the calling convention in `policy_loss` (the same positional tensors, its own options as
keyword-only arguments with its documented defaults, a (B, R) per-token loss and the common metrics) and
registers under the name users know from verl and tinker. Pure: no I/O, no distributed code.
"""

from __future__ import annotations

import torch

from posttrain.algorithms.policy_loss import check_clip_range, policy_metrics, token_log_ratio
from posttrain.algorithms.registry import register_policy_loss
from posttrain.errors import ConfigError

# verl's bound on the GSPO log-ratio before exp; a sequence ratio beyond e^10 is clipped anyway.
_GSPO_LOG_RATIO_MAX = 10.0


@register_policy_loss("gspo")
def gspo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO, Group Sequence Policy Optimization (Zheng et al. 2025): PPO clipping on a sequence-level ratio.

    s_i = exp(mean over valid tokens t of log(pi / pi_old)) is the length-normalised sequence ratio. It is
    applied per token in the straight-through form s_i,t = sg[s_i] * pi_t / sg[pi_t], whose value is s_i
    and whose gradient with respect to log pi_t is s_i (each token gets its own advantage and gradient):

        L_i,t = max(-A_i,t * s_i,t, -A_i,t * clip(s_i,t, 1 - clip_ratio_low, 1 + clip_ratio_high))

    Defaults: the paper's clip range (3e-4, 4e-4) (Sec. 5.1): a sequence ratio moves far less than a token
    ratio. verl's gspo has no range of its own (it reads actor.clip_ratio_*, 0.2 by default); its GSPO
    example sets these same two values. The paper and verl aggregate with "seq-mean-token-mean" (verl
    forces it); here the caller's `loss_agg_mode` is honoured, so set it to that to reproduce them (the
    gspo recipe does). log s_i,t is capped at 10 before exp (as verl). `pg_clipfrac` counts tokens whose
    sequence was clipped; `ratio_mean` / `ratio_max` are over s_i, weighted by tokens.
    """
    check_clip_range("gspo", clip_ratio_low, clip_ratio_high)
    log_ratio = token_log_ratio(log_prob, old_log_prob)
    mask = response_mask.to(log_ratio.dtype)
    seq_log_ratio = (log_ratio * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
    log_seq_ratio = seq_log_ratio.detach().unsqueeze(-1) + log_prob - log_prob.detach()
    seq_ratio = log_seq_ratio.clamp(max=_GSPO_LOG_RATIO_MAX).exp()

    losses_unclipped = -advantages * seq_ratio
    losses_clipped = -advantages * seq_ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg_losses = torch.maximum(losses_unclipped, losses_clipped)

    metrics = policy_metrics(response_mask, log_ratio, seq_ratio, clipped=losses_clipped > losses_unclipped)
    return pg_losses, metrics


@register_policy_loss("sapo")
def sapo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SAPO, Soft Adaptive Policy Optimization (Gao et al. 2025): a smooth gate instead of a hard clip.

    With r = exp(log_prob - old_log_prob) and tau = tau_pos where A > 0, tau_neg where A <= 0:

        f(r) = sigmoid(tau * (r - 1)) * 4 / tau,        L = -f(r) * A

    At r = 1 the gate's slope is 1, so the on-policy gradient equals the plain policy gradient; away from
    r = 1 the gradient decays smoothly instead of dropping to zero. A larger tau_neg damps negative-advantage
    updates faster. Defaults tau_pos=1.0, tau_neg=1.05: the paper's (Qwen3-30B-A3B-Base), which are also
    verl's `actor.tau_pos` / `actor.tau_neg`. verl forces "seq-mean-token-mean"; here the caller's
    `loss_agg_mode` is honoured. There is no hard clip, so `pg_clipfrac` is 0.
    """
    if tau_pos <= 0.0 or tau_neg <= 0.0:
        raise ConfigError(f"sapo: tau_pos and tau_neg must be > 0, got {tau_pos}, {tau_neg}")
    log_ratio = token_log_ratio(log_prob, old_log_prob)
    ratio = log_ratio.exp()
    tau = torch.where(advantages > 0, tau_pos, tau_neg).to(ratio.dtype)
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    pg_losses = -gate * advantages

    metrics = policy_metrics(response_mask, log_ratio, ratio, clipped=None)
    return pg_losses, metrics


@register_policy_loss("cispo")
def cispo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 1.0,
    clip_ratio_high: float = 3.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO, Clipped IS-weight Policy Optimization (MiniMax-M1, 2025): clip the weight, keep every gradient.

        w = sg[clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)],      L = -w * A * log_prob

    Unlike PPO no token's gradient is ever zeroed: the gradient is -w * A * grad(log_prob) with w constant.
    MiniMax-M1 imposes no lower bound on the weight ("setting eps_low to a large value") and tunes only
    the upper one. Defaults: clip_ratio_low=1.0 (any value >= 1 removes the lower bound, as r > 0) and
    clip_ratio_high=3.0, i.e. tinker's cispo thresholds 0 and 4. verl's cispo has no bounds of its own (it
    reads actor.clip_ratio_*, 0.2 by default); its example sets clip_ratio_low=10, clip_ratio_high=0.2.
    `pg_clipfrac` is the fraction of tokens whose weight was clipped.
    """
    if clip_ratio_low < 0.0 or clip_ratio_high < 0.0:
        raise ConfigError(
            f"cispo: clip_ratio_low and clip_ratio_high must be >= 0, got {clip_ratio_low}, {clip_ratio_high}"
        )
    log_ratio = token_log_ratio(log_prob, old_log_prob)
    ratio = log_ratio.exp()
    low, high = 1.0 - clip_ratio_low, 1.0 + clip_ratio_high
    weight = ratio.detach().clamp(min=max(low, 0.0), max=high)
    pg_losses = -weight * advantages * log_prob

    metrics = policy_metrics(response_mask, log_ratio, ratio, clipped=(ratio < low) | (ratio > high))
    return pg_losses, metrics


@register_policy_loss("dro")
def dro_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    beta: float = 0.05,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DRO, Direct Reward Optimisation (Richemond et al. 2024; Kimi k1.5 2025), as tinker defines its loss.

        L = -(log_prob * A - beta / 2 * (log_prob - old_log_prob)^2)

    A quadratic penalty on the log-ratio keeps the policy near the sampling policy instead of a clip, so
    the loss also works off-policy. It expects the caller's soft advantages (DRO's value baseline). tinker
    documents no default for beta; 0.05 is the value of its example. The penalty uses the raw log-ratio.
    No clip: `pg_clipfrac` is 0.
    """
    if beta <= 0.0:
        raise ConfigError(f"dro: beta must be > 0 (the weight of the quadratic penalty), got {beta}")
    log_ratio = token_log_ratio(log_prob, old_log_prob)
    penalty = 0.5 * beta * (log_prob - old_log_prob).square()
    pg_losses = -(log_prob * advantages - penalty)

    metrics = policy_metrics(response_mask, log_ratio, log_ratio.exp(), clipped=None)
    return pg_losses, metrics


@register_policy_loss("gpg")
def gpg_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GPG, Group Policy Gradient (Chu et al. 2025): the plain REINFORCE surrogate L = -A * log_prob.

    No ratio and no clip; it is on-policy by construction. `ppo_kl` and the ratio stats still report how
    far the policy has moved from old_log_prob, which is useful to see when it is used off-policy.
    """
    log_ratio = token_log_ratio(log_prob, old_log_prob)
    pg_losses = -advantages * log_prob

    metrics = policy_metrics(response_mask, log_ratio, log_ratio.exp(), clipped=None)
    return pg_losses, metrics


@register_policy_loss("geo_mean")
def geo_mean_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.4,
    clip_ratio_high: float = 0.4,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GMPO, Geometric-Mean Policy Optimization (Zhao et al. 2025, arXiv:2507.20673): the geometric instead of
    the arithmetic mean of the token ratios, clipped per token in log space.

    With l_t = log(pi_t / pi_old,t), s = sign(A_t), l'_t = s * min(s * l_t, s * clip(l_t, -clip_ratio_low,
    clip_ratio_high)) (a positive-advantage token is clipped above, a negative one below) and the means over
    the n_i valid tokens of row i, A_i = mean_t A_t (a sequence-level advantage):

        L_i = -A_i * exp(mean_t l'_t)      set on every valid token of row i

    so "seq-mean-token-mean" gives mean_i L_i, the paper's and verl's objective (verl ignores the mode and
    takes torch.mean over rows; here the caller's `loss_agg_mode` is honoured, so set that mode to
    reproduce it). The geometric mean damps outlier token ratios. Defaults: the paper's clip range
    (e^-0.4, e^0.4), verl's GMPO example (verl's geo_mean reads actor.clip_ratio_*, 0.2 by default).
    l_t is clamped to [-20, 20] first, as every loss here (verl leaves it unclamped).

    Metrics: `pg_clipfrac` / `pg_clipfrac_lower` the tokens clipped with A > 0 / A < 0 (as verl);
    `ratio_mean` / `ratio_max` over the sequence ratios, weighted by tokens. Rollout IS weights, when on,
    multiply the per-token losses (an arithmetic mean of the weights over the row; verl takes their
    geometric mean).
    """
    if clip_ratio_low < 0.0 or clip_ratio_high < 0.0:
        raise ConfigError(
            f"geo_mean: clip_ratio_low and clip_ratio_high (log-space bounds) must be >= 0, "
            f"got {clip_ratio_low}, {clip_ratio_high}"
        )
    log_ratio = token_log_ratio(log_prob, old_log_prob)
    sign = torch.sign(advantages)
    clamped = log_ratio.clamp(-clip_ratio_low, clip_ratio_high)
    clipped_log_ratio = sign * torch.minimum(sign * log_ratio, sign * clamped)
    mask = response_mask.to(log_ratio.dtype)
    lengths = mask.sum(dim=-1, keepdim=True).clamp(min=1.0)
    seq_ratio = ((clipped_log_ratio * mask).sum(dim=-1, keepdim=True) / lengths).exp()
    seq_advantage = (advantages * mask).sum(dim=-1, keepdim=True) / lengths
    pg_losses = (-seq_advantage * seq_ratio).expand_as(log_ratio)

    clipped = log_ratio != clamped
    metrics = policy_metrics(
        response_mask,
        log_ratio,
        seq_ratio.expand_as(log_ratio),
        clipped=clipped & (advantages > 0),
        clipped_lower=clipped & (advantages < 0),
    )
    return pg_losses, metrics
