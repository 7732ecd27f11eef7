"""DPPO, Divergence Proximal Policy Optimization: a trust region on the policy divergence, not on the ratio.

Qi et al. 2026, "Rethinking the Trust Region in LLM Reinforcement Learning" (arXiv:2602.04879). PPO's ratio
clip over-restrains low-probability tokens (their ratio moves a lot for a small change of probability) and
under-restrains high-probability ones. DPPO masks a token's gradient only when the policy has moved too far
from pi_old by a divergence of the sampled token's binary distribution (p, 1 - p), in the direction the
advantage pushes it:

    L_t = -A_t * sg[min(r_t, clip_ratio_c)] * log pi_t * valid_t,       r_t = pi_t / pi_old,t

whose gradient is the truncated-IS policy gradient on the tokens inside the trust region. `dppo_tv` bounds
the total variation |p - p_old|, `dppo_kl` the binary KL. As in verl, `clip_ratio_low` / `clip_ratio_high`
are the divergence bounds for A < 0 / A > 0 (not ratio bounds). Calling convention and common metrics: see
`policy_loss`; `pg_clipfrac` is the share of tokens outside the trust region, `pg_clipfrac_lower` the share
of tokens inside it whose ratio was truncated at clip_ratio_c. Pure: no I/O, no distributed code.
"""

from __future__ import annotations

import torch

from posttrain.algorithms.policy_loss import policy_metrics, token_log_ratio
from posttrain.algorithms.registry import register_policy_loss
from posttrain.errors import ConfigError

# verl's epsilon inside the binary KL's log((1 - p_old) / (1 - p)): p = 1 would divide by zero.
_BINARY_KL_EPS = 1e-8


def _check(name: str, clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float) -> None:
    if clip_ratio_low < 0.0 or clip_ratio_high < 0.0:
        raise ConfigError(
            f"{name}: clip_ratio_low and clip_ratio_high are divergence bounds and must be >= 0, "
            f"got {clip_ratio_low}, {clip_ratio_high}"
        )
    if clip_ratio_c <= 0.0:
        raise ConfigError(
            f"{name}: clip_ratio_c (the truncation of the ratio) must be > 0, got {clip_ratio_c}"
        )


def _dppo_surrogate(
    log_prob: torch.Tensor,
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    valid: torch.Tensor,
    clip_ratio_c: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """-A * sg[min(r, c)] * log pi on the tokens in the trust region, and the metrics."""
    ratio = log_ratio.exp()
    truncated = ratio.detach().clamp(max=clip_ratio_c)
    pg_losses = -advantages * truncated * log_prob * valid.to(log_prob.dtype)
    metrics = policy_metrics(
        response_mask, log_ratio, ratio, clipped=~valid, clipped_lower=valid & (ratio > clip_ratio_c)
    )
    return pg_losses, metrics


@register_policy_loss("dppo_tv")
def dppo_tv_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.15,
    clip_ratio_high: float = 0.15,
    clip_ratio_c: float = 20.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO-Binary-TV (Qi et al. 2026): the trust region bounds the change of the sampled token's probability.

    With p = pi_t, p_old = pi_old,t (no gradient through the test):

        valid_t = p - p_old <= clip_ratio_high     where A_t > 0  (do not push p further up)
        valid_t = p - p_old >= -clip_ratio_low     where A_t <= 0 (do not push p further down)
        L_t     = -A_t * sg[min(r_t, clip_ratio_c)] * log p * valid_t

    Defaults: the TV bound 0.15 of verl's DPPO example (examples/dppo_trainer) and clip_ratio_c=20, the
    truncation verl's loss falls back to (the paper, Sec. 5.4, recommends a large one; verl's example sets
    10000; with verl's actor config unchanged its clip_ratio_c of 3.0 would apply). The log-ratio is
    clamped to [-20, 20] before exp, as verl.
    """
    _check("dppo_tv", clip_ratio_low, clip_ratio_high, clip_ratio_c)
    log_ratio = token_log_ratio(log_prob, old_log_prob)
    with torch.no_grad():
        change = log_prob.detach().exp() - old_log_prob.exp()
        valid = torch.where(advantages > 0, change <= clip_ratio_high, change >= -clip_ratio_low)
    return _dppo_surrogate(log_prob, log_ratio, advantages, response_mask, valid, clip_ratio_c)


@register_policy_loss("dppo_kl")
def dppo_kl_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.05,
    clip_ratio_high: float = 0.05,
    clip_ratio_c: float = 20.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DPPO-Binary-KL (Qi et al. 2026): the trust region bounds the KL of the binary distributions (p, 1 - p).

    With p = pi_t, p_old = pi_old,t, e = 1e-8 (as verl) and no gradient through the test:

        D_t     = p_old * log(p_old / p) + (1 - p_old) * log((1 - p_old + e) / (1 - p + e))
        valid_t = D_t <= clip_ratio_high or p <= p_old     where A_t > 0
        valid_t = D_t <= clip_ratio_low  or p >= p_old     where A_t <= 0
        L_t     = -A_t * sg[min(r_t, clip_ratio_c)] * log p * valid_t

    A token that moved against its advantage's push stays in the region whatever its divergence.
    Defaults: the KL bound 0.05 of verl's DPPO example and clip_ratio_c=20 (see `dppo_tv_loss`).
    """
    _check("dppo_kl", clip_ratio_low, clip_ratio_high, clip_ratio_c)
    log_ratio = token_log_ratio(log_prob, old_log_prob)
    with torch.no_grad():
        log_p = log_prob.detach()
        p, p_old = log_p.exp(), old_log_prob.exp()
        binary_kl = p_old * (old_log_prob - log_p) + (1.0 - p_old) * torch.log(
            (1.0 - p_old + _BINARY_KL_EPS) / (1.0 - p + _BINARY_KL_EPS)
        )
        valid = torch.where(
            advantages > 0,
            (binary_kl <= clip_ratio_high) | (p <= p_old),
            (binary_kl <= clip_ratio_low) | (p >= p_old),
        )
    return _dppo_surrogate(log_prob, log_ratio, advantages, response_mask, valid, clip_ratio_c)
