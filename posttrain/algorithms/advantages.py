"""Advantage estimators: from per-token rewards to per-token advantages and returns.

Every estimator is registered by the name verl users know (`@register_advantage("grpo")`) and shares one
calling convention, so the driver can call any of them the same way:

    advantages, returns = estimator(token_level_rewards, response_mask, group_ids, **options)

* `token_level_rewards` (B, R) float, `response_mask` (B, R), `group_ids` length B (the `uid` column:
  one id per prompt, shared by its n samples; any hashables);
* `options` are keyword-only. Inputs the caller must supply have no default (`values` for GAE,
  `reward_baselines` for ReMax); `required_inputs(name)` lists them, so the driver can pass exactly what
  an estimator asks for. Tunable options have defaults (`gamma`, `lam`, `norm_by_std`, `epsilon`).
  An estimator that does not use `group_ids` ignores it;
* both outputs are (B, R), zero outside the response mask, and carry no gradient.

`response_mask` may have zeros inside a response (tool output in a multi-turn rollout): such tokens get
advantage 0, and the estimators that run a recursion over tokens (GAE, REINFORCE++) step over them as if
they were absent. Shared helpers: `group_index`, `group_stats`, `masked_whiten`, `required_inputs`.
The group-baseline family beyond GRPO lives in `advantages_outcome.py`.

Pure: no I/O, no distributed code.
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from posttrain.algorithms.registry import get_advantage_estimator, register_advantage

GroupIds = Sequence[Hashable] | np.ndarray


class AdvantageEstimator(Protocol):
    """The shape of a registered advantage estimator (see the module docstring)."""

    def __call__(
        self,
        token_level_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        group_ids: GroupIds,
        **kwargs: object,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def required_inputs(name: str) -> frozenset[str]:
    """The inputs the caller must supply to estimator `name`: its keyword-only parameters without default.

    `required_inputs("gae") == {"values"}`, `required_inputs("grpo") == set()`. An unknown name raises
    ConfigError listing the valid names.
    """
    parameters = inspect.signature(get_advantage_estimator(name)).parameters.values()
    return frozenset(
        p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is p.empty
    )


def group_index(group_ids: GroupIds) -> tuple[torch.Tensor, int]:
    """Map arbitrary hashable group ids to dense ints 0..G-1 (first-seen order); returns (index (B,), G).
    A tensor (or array) of ids is compared by value (its elements would hash by identity)."""
    if hasattr(group_ids, "tolist"):
        group_ids = group_ids.tolist()
    dense: dict[Hashable, int] = {}
    index = [dense.setdefault(g, len(dense)) for g in group_ids]
    return torch.tensor(index, dtype=torch.long), len(dense)


@dataclass(frozen=True)
class GroupStats:
    """Per-row statistics of the row's group, each (B,). See `group_stats`."""

    index: torch.Tensor  # dense group number of each row (long)
    n_groups: int
    size: torch.Tensor  # number of samples in the row's group
    mean: torch.Tensor  # group mean of the scores; 0 for a group of one
    std: torch.Tensor  # unbiased (n-1) group standard deviation; 1 for a group of one


def group_sum(values: torch.Tensor, index: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Sum of (B,) `values` within each of the `n_groups` groups given by `index`: (G,)."""
    zeros = torch.zeros(n_groups, dtype=values.dtype, device=values.device)
    return zeros.index_add(0, index, values)


def group_stats(scores: torch.Tensor, group_ids: GroupIds) -> GroupStats:
    """Group size, mean and unbiased std of (B,) sequence `scores`, broadcast back to rows.

    A group of one sample gets mean 0 and std 1, as verl: its "baseline" is then no baseline at all
    (the raw score), instead of the score itself (always advantage 0) or an undefined std.
    """
    if len(group_ids) != scores.shape[0]:
        raise ValueError(f"group_ids has {len(group_ids)} entries for a batch of {scores.shape[0]} rows")
    index, n_groups = group_index(group_ids)
    index = index.to(scores.device)
    counts = group_sum(torch.ones_like(scores), index, n_groups)
    means = group_sum(scores, index, n_groups) / counts
    sq_dev = group_sum((scores - means[index]) ** 2, index, n_groups)
    stds = (sq_dev / (counts - 1).clamp(min=1.0)).sqrt()
    singleton = counts == 1
    means = torch.where(singleton, torch.zeros_like(means), means)
    stds = torch.where(singleton, torch.ones_like(stds), stds)
    return GroupStats(index, n_groups, counts[index], means[index], stds[index])


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Whiten `values` with the mean and variance of its entries where `mask` is 1, as verl.

        whitened = (values - mu) / sqrt(var + eps),   mu = sum(v m) / n,   var = sum((v - mu)^2 m) / (n - 1)

    with n = sum(m) (unbiased variance, verl's `masked_var`). `shift_mean=False` adds mu back. Every entry
    is transformed, masked ones included (multiply by the mask to zero them); values at masked positions
    do not enter the statistics, even if NaN. Raises ValueError when fewer than 2 entries are valid (the
    unbiased variance is undefined; verl raises too).
    """
    weights = mask.to(values.dtype)
    valid_values = torch.where(weights > 0, values, torch.zeros_like(values))
    count = weights.sum()
    if count.item() < 2:
        raise ValueError(
            f"masked_whiten needs at least 2 valid tokens, got {count.item():g}; "
            "whitening over a batch this small is undefined (use a larger batch)"
        )
    mean = (valid_values * weights).sum() / count
    var = ((valid_values - mean) ** 2 * weights).sum() / (count - 1)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    return whitened if shift_mean else whitened + mean


def zero_outside_mask(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`values` where `mask` is 1, exactly 0 elsewhere (also where `values` is NaN or inf)."""
    return torch.where(mask > 0, values, torch.zeros_like(values))


def check_batch(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, **tensors: torch.Tensor
) -> None:
    """Raise ValueError unless rewards and mask are (B, R) alike and every extra tensor matches its name.

    Extra tensors are checked by name: `values` must be (B, R), `reward_baselines` (B,).
    """
    if token_level_rewards.dim() != 2 or token_level_rewards.shape != response_mask.shape:
        raise ValueError(
            f"token_level_rewards {tuple(token_level_rewards.shape)} and response_mask "
            f"{tuple(response_mask.shape)} must both be (B, R)"
        )
    batch_size = token_level_rewards.shape[0]
    expected = {"values": tuple(token_level_rewards.shape), "reward_baselines": (batch_size,)}
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(f"{name} is {tuple(tensor.shape)}, expected {expected[name]}")


@register_advantage("grpo")
def compute_grpo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative outcome advantages (GRPO, Shao et al. 2024, "DeepSeekMath").

    Each response i gets the score s_i = sum_t token_level_rewards[i, t] (the outcome reward sits on its
    last token; the sum is taken over the whole row, as verl does). Within its group g (same prompt):

        A_i = (s_i - mean_g) / (std_g + epsilon)      norm_by_std=True (GRPO)
        A_i =  s_i - mean_g                           norm_by_std=False (Dr. GRPO, Liu et al. 2025)

    with std_g the unbiased (n-1) standard deviation, as `torch.std` and verl. A_i is broadcast to every
    response token and multiplied by `response_mask`; returns = advantages (no critic).

    Edge cases, as verl: a group of size one has mean 0 and std 1 (so A_i = s_i / (1 + eps), the raw
    score, rather than an undefined std); a group whose scores are all equal gets advantage 0 (no signal);
    a masked token inside a response gets 0.
    """
    check_batch(token_level_rewards, response_mask)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        stats = group_stats(scores, group_ids)
        advantages = scores - stats.mean
        if norm_by_std:
            advantages = advantages / (stats.std + epsilon)
        advantages = advantages.unsqueeze(-1) * response_mask.to(advantages.dtype)
    return advantages, advantages.clone()


@register_advantage("gae")
def compute_gae_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    *,
    values: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, "High-Dimensional Continuous Control
    Using Generalized Advantage Estimation"), per token with critic `values` (B, R), as verl's PPO.

    Backwards over the valid tokens t of a row, with t' the next valid token (V(t') = 0 after the last):

        delta_t = r_t + gamma * V(t') - V(t)
        A_t     = delta_t + gamma * lam * A_t'          (A = 0 after the last valid token)
        returns = A + values                            (the critic's target, before whitening)

    then the advantages are whitened over all valid tokens of the batch (`masked_whiten`: mean 0,
    unbiased std 1). `group_ids` is ignored.

    Edge cases: a masked token inside a response (tool output) is skipped as verl's masked GAE does: it
    passes the next valid token's V and A through unchanged, so the discount is applied once per model
    token and its own reward and value are ignored. Trailing padding is skipped the same way, so the value
    after the last valid token is 0 whatever the padding holds. Groups play no role (size one or all
    equal changes nothing). Fewer than 2 valid tokens in the batch raises ValueError (whitening).
    Both outputs are zeroed outside the mask (verl leaves whatever the recursion put there).
    """
    check_batch(token_level_rewards, response_mask, values=values)
    with torch.no_grad():
        valid = response_mask > 0
        next_value = torch.zeros_like(token_level_rewards[:, 0])
        next_advantage = torch.zeros_like(next_value)
        advantages = torch.zeros_like(token_level_rewards)
        for t in reversed(range(token_level_rewards.shape[1])):
            delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
            advantage = delta + gamma * lam * next_advantage
            next_value = torch.where(valid[:, t], values[:, t], next_value)
            next_advantage = torch.where(valid[:, t], advantage, next_advantage)
            advantages[:, t] = next_advantage
        returns = zero_outside_mask(advantages + values, response_mask)
        advantages = zero_outside_mask(masked_whiten(advantages, response_mask), response_mask)
    return advantages, returns


@register_advantage("reinforce_plus_plus")
def compute_reinforce_plus_plus_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    *,
    gamma: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
    Models"): discounted return-to-go of the token-level rewards, whitened over the batch.

        G_t = r_t + gamma * G_t'          (t' the next valid token; G = 0 after the last valid token)
        A   = masked_whiten(G)            (mean 0, unbiased std 1 over all valid tokens of the batch)

    returns = G. The token-level rewards usually hold the outcome score on the last token minus a
    per-token KL penalty. `group_ids` is ignored.

    Edge cases: a masked token inside a response (tool output) passes G_t' through unchanged and its own
    reward is ignored, so earlier turns still see the final reward (verl's fix for observation spans;
    older verl reset G to 0 at every masked token). Groups play no role. Fewer than 2 valid tokens in the
    batch raises ValueError (whitening). Both outputs are zero outside the mask.
    """
    check_batch(token_level_rewards, response_mask)
    with torch.no_grad():
        valid = response_mask > 0
        running = torch.zeros_like(token_level_rewards[:, 0])
        returns = torch.zeros_like(token_level_rewards)
        for t in reversed(range(token_level_rewards.shape[1])):
            running = torch.where(valid[:, t], token_level_rewards[:, t] + gamma * running, running)
            returns[:, t] = running
        returns = zero_outside_mask(returns, response_mask)
        advantages = zero_outside_mask(masked_whiten(returns, response_mask), response_mask)
    return advantages, returns
