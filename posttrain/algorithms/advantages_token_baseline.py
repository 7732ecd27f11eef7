"""Optimal Token Baseline (OTB): a baseline per token position, weighted by how much gradient each path carries.

A group baseline subtracts one number per response. The variance-minimising baseline of a policy gradient is
instead b* = E[G ||grad log pi||^2] / E[||grad log pi||^2]. For a softmax policy the squared norm of the
score of token t with respect to its logits is ||e_t - pi||^2 = 1 - 2 pi_t + sum_v pi_v^2, and a response's
gradient up to position t accumulates these. verl's `optimal_token_baseline` (and its multi-turn variant
`tir_optimal_token_baseline`) estimate b* per position from the responses of one prompt:

    w_t = (1 - 2 pi_t + S_t) * rho_t^2      pi_t = exp(old_log_probs), S_t = sum_pi_squared = sum_v pi_v(t)^2,
                                            rho_t the rollout IS weight (1 when not given)
    W_t = sum_{t' <= t} w_t'                cumulative path-variance proxy (valid tokens only)
    G_t = sum_{t' >= t} r_t'                return-to-go (valid tokens only)
    B_t = sum_j G_jt W_jt / (sum_j W_jt + epsilon)       over the responses j of the group, at position t
    A_t = G_t - B_t                         returns = G

The two differ in what "position t" is: the column of the response (`optimal_token_baseline`), or the index
among the row's valid tokens (`tir_optimal_token_baseline`, so that in a multi-turn rollout with tool output
masked out, the k-th model token of each response is compared with the k-th of the others).

Same calling convention as every estimator (`advantages.py`); `old_log_probs` and `sum_pi_squared` are
required inputs. Pure: no I/O, no distributed code. Registered on import (`posttrain.algorithms` imports it).
"""

from __future__ import annotations

import torch

from posttrain.algorithms.advantages import GroupIds, check_batch, group_index, zero_outside_mask
from posttrain.algorithms.registry import register_advantage


def _check_inputs(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, *per_token: torch.Tensor
) -> None:
    check_batch(token_level_rewards, response_mask)
    for name, tensor in zip(("old_log_probs", "sum_pi_squared"), per_token, strict=True):
        if tensor.shape != token_level_rewards.shape:
            raise ValueError(f"{name} is {tuple(tensor.shape)}, expected {tuple(token_level_rewards.shape)}")


def _path_weights(
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    mask: torch.Tensor,
    rollout_is_weights: torch.Tensor | None,
) -> torch.Tensor:
    """W_t: the cumulative sum over valid tokens of (1 - 2 pi_t + S_t) * rho_t^2."""
    w = 1.0 - 2.0 * old_log_probs.exp() + sum_pi_squared
    if rollout_is_weights is not None:
        w = w * rollout_is_weights.square()
    return (w * mask).cumsum(dim=-1)


def _group_baselines(
    returns: torch.Tensor,
    path_weights: torch.Tensor,
    mask: torch.Tensor,
    index: torch.Tensor,
    n_groups: int,
    members: torch.Tensor,
    handle_zero_tail: bool,
    epsilon: float,
) -> torch.Tensor:
    """B (B, L) on aligned positions: per group and position, sum_j G W m / (sum_j W m + epsilon).

    `members` (B,) bool says which rows belong to their group (the others get 0). A group of one member
    gets 0 (no baseline). With `handle_zero_tail`, the single longest member of a group gets 0 past the
    second-longest member's length, where the baseline would be its own return (advantage 0).
    """
    weighted = torch.where(members.unsqueeze(-1), returns * path_weights * mask, 0.0)
    totals = torch.where(members.unsqueeze(-1), path_weights * mask, 0.0)
    index = index.to(returns.device)
    numerator = returns.new_zeros(n_groups, returns.shape[1]).index_add(0, index, weighted)
    denominator = torch.zeros_like(numerator).index_add(0, index, totals)
    baselines = (numerator / (denominator + epsilon))[index]
    sizes = torch.zeros(n_groups, dtype=torch.long, device=index.device).index_add(0, index, members.long())[
        index
    ]
    baselines = torch.where((sizes > 1).unsqueeze(-1) & members.unsqueeze(-1), baselines, 0.0)
    if handle_zero_tail:
        lengths = mask.sum(dim=-1)
        for group in range(n_groups):
            rows = torch.nonzero((index == group) & members).squeeze(-1)
            if rows.numel() < 2:
                continue
            ordered = torch.sort(lengths[rows], descending=True).values
            longest = rows[lengths[rows] == ordered[0]]
            if longest.numel() == 1 and ordered[0] > ordered[1]:
                baselines[longest[0], int(ordered[1]) :] = 0.0
    return baselines


@register_advantage("optimal_token_baseline")
def compute_optimal_token_baseline_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    *,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal Token Baseline by response column (verl's `optimal_token_baseline`; see the module docstring):

        A_t = G_t - sum_j G_jt W_jt / (sum_j W_jt + epsilon),   sums over the group's responses at column t

    `old_log_probs`, `sum_pi_squared` and the optional `rollout_is_weights` are (B, R). Defaults are verl's.

    Edge cases, as verl: a group of one response has no baseline (A = G); with `handle_zero_tail`, a group's
    single longest response gets baseline 0 past the second-longest length (its tail would otherwise be
    compared only with itself and get advantage 0). Rows without valid tokens count as group members (as
    verl). Both outputs are zero outside the mask (verl leaves returns there).
    """
    _check_inputs(token_level_rewards, response_mask, old_log_probs, sum_pi_squared)
    with torch.no_grad():
        mask = response_mask.to(token_level_rewards.dtype)
        returns = (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1)
        path = _path_weights(old_log_probs, sum_pi_squared, mask, rollout_is_weights)
        index, n_groups = group_index(group_ids)
        members = torch.ones(mask.shape[0], dtype=torch.bool, device=mask.device)
        baselines = _group_baselines(returns, path, mask, index, n_groups, members, handle_zero_tail, epsilon)
        advantages = zero_outside_mask(returns - baselines, response_mask)
    return advantages, zero_outside_mask(returns, response_mask)


@register_advantage("tir_optimal_token_baseline")
def compute_tir_optimal_token_baseline_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    *,
    old_log_probs: torch.Tensor,
    sum_pi_squared: torch.Tensor,
    rollout_is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    epsilon: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal Token Baseline by valid-token index, for multi-turn (tool-integrated) rollouts (verl's
    `tir_optimal_token_baseline`; see the module docstring).

    Each row's valid tokens are packed to the left (the k-th model token of every response lines up, tool
    output in between removed), then, at packed position k:

        A_k = G_k - sum_j G_jk W_jk / (sum_j W_jk + epsilon),   sums over the group's non-empty responses

    and the advantages go back to the tokens they came from. G and W are computed on the original columns,
    as `optimal_token_baseline` does, so G_k is still the return-to-go from that token.

    Edge cases, as verl: rows without valid tokens are left out of their group (advantage 0); a group of
    one response has no baseline; `handle_zero_tail` as `optimal_token_baseline`, on packed lengths. Both
    outputs are zero outside the mask.
    """
    _check_inputs(token_level_rewards, response_mask, old_log_probs, sum_pi_squared)
    with torch.no_grad():
        mask = response_mask.to(token_level_rewards.dtype)
        returns = (token_level_rewards * mask).flip(-1).cumsum(-1).flip(-1)
        path = _path_weights(old_log_probs, sum_pi_squared, mask, rollout_is_weights)
        valid = response_mask > 0
        lengths = valid.sum(dim=-1)
        width = max(int(lengths.max()), 1) if lengths.numel() else 1
        rows, cols = valid.nonzero(as_tuple=True)
        packed_index = valid.long().cumsum(dim=-1)[rows, cols] - 1
        packed_returns = returns.new_zeros(mask.shape[0], width)
        packed_path = torch.zeros_like(packed_returns)
        packed_returns[rows, packed_index] = returns[rows, cols]
        packed_path[rows, packed_index] = path[rows, cols]
        packed_mask = (torch.arange(width, device=mask.device) < lengths.unsqueeze(-1)).to(mask.dtype)
        index, n_groups = group_index(group_ids)
        baselines = _group_baselines(
            packed_returns, packed_path, packed_mask, index, n_groups, lengths > 0, handle_zero_tail, epsilon
        )
        advantages = torch.zeros_like(returns)
        advantages[rows, cols] = (packed_returns - baselines)[rows, packed_index]
    return advantages, zero_outside_mask(returns, response_mask)
