"""The critic's loss: clipped value regression (PPO, Schulman et al. 2017; as in verl and OpenAI baselines).

Pure tensor code: no I/O, no distributed code.
"""

from __future__ import annotations

import torch

from posttrain.algorithms.aggregation import masked_mean
from posttrain.errors import ConfigError


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange_value: float = 0.5,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per token L = 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2), as a (B, R) tensor.

    The clipped term keeps one update from moving a value estimate more than `cliprange_value` away from
    the value the advantages were computed with. The caller aggregates the per-token loss like the policy
    loss (same mode and mini-batch totals). Metrics: `vf_clipfrac` (share of tokens where the clipped term
    was larger), `vpred_mean`, `vf_explained_var` (1 - Var(R - V) / Var(R) over valid tokens).
    """
    if cliprange_value <= 0:
        raise ConfigError(f"critic.cliprange_value must be > 0, got {cliprange_value}")
    # clamp V itself into [V_old - c, V_old + c] (as verl): V_old + clamp(V - V_old) rounds, so an unclipped
    # V would come back one ulp off and count as clipped in vf_clipfrac
    clipped = values.clamp(old_values - cliprange_value, old_values + cliprange_value)
    unclipped_loss = (values - returns) ** 2
    clipped_loss = (clipped - returns) ** 2
    per_token = 0.5 * torch.maximum(unclipped_loss, clipped_loss)
    with torch.no_grad():
        residual_var = (
            masked_mean((returns - values) ** 2, response_mask)
            - masked_mean(returns - values, response_mask) ** 2
        )
        returns_var = masked_mean(returns**2, response_mask) - masked_mean(returns, response_mask) ** 2
        metrics = {
            "vf_clipfrac": masked_mean((clipped_loss > unclipped_loss).float(), response_mask).item(),
            "vpred_mean": masked_mean(values, response_mask).item(),
            "vf_explained_var": (1.0 - residual_var / returns_var.clamp(min=1e-8)).item(),
        }
    return per_token, metrics
