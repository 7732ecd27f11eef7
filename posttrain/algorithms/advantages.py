"""Advantage estimators: from per-token rewards to per-token advantages and returns.

Every estimator is registered by name (`@register_advantage("grpo")`) and shares one calling convention,
so the driver can call any of them the same way:

    advantages, returns = estimator(token_level_rewards, response_mask, group_ids, **options)

* `token_level_rewards` (B, R) float, `response_mask` (B, R), `group_ids` length B (the `uid` column:
  one id per prompt, shared by its n samples);
* `options` are keyword-only and estimator-specific (`norm_by_std` for GRPO; later `values`, `gamma`,
  `lam` for GAE, ...). An estimator that needs an extra tensor takes it as a keyword argument; one that
  does not use `group_ids` simply ignores it.
* both outputs are (B, R), zero outside the response mask, and carry no gradient.

Pure: no I/O, no distributed code.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

import numpy as np
import torch

from posttrain.algorithms.registry import register_advantage


class AdvantageEstimator(Protocol):
    """The shape of a registered advantage estimator (see the module docstring)."""

    def __call__(
        self,
        token_level_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        group_ids: Sequence[Hashable] | np.ndarray,
        **kwargs: object,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def group_index(group_ids: Sequence[Hashable] | np.ndarray) -> tuple[torch.Tensor, int]:
    """Map arbitrary hashable group ids to dense ints 0..G-1 (first-seen order); returns (index (B,), G)."""
    dense: dict[Hashable, int] = {}
    index = [dense.setdefault(g, len(dense)) for g in group_ids]
    return torch.tensor(index, dtype=torch.long), len(dense)


@register_advantage("grpo")
def compute_grpo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: Sequence[Hashable] | np.ndarray,
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
    score, rather than an undefined std); a group whose scores are all equal gets advantage 0 (no signal).
    """
    batch_size = token_level_rewards.shape[0]
    if len(group_ids) != batch_size:
        raise ValueError(f"group_ids has {len(group_ids)} entries for a batch of {batch_size} rows")
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        index, n_groups = group_index(group_ids)
        index = index.to(scores.device)
        zeros = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)
        counts = zeros.index_add(0, index, torch.ones_like(scores))
        means = zeros.index_add(0, index, scores) / counts
        sq_dev = zeros.index_add(0, index, (scores - means[index]) ** 2)
        stds = (sq_dev / (counts - 1).clamp(min=1.0)).sqrt()
        singleton = counts == 1
        means = torch.where(singleton, torch.zeros_like(means), means)
        stds = torch.where(singleton, torch.ones_like(stds), stds)

        advantages = scores - means[index]
        if norm_by_std:
            advantages = advantages / (stds[index] + epsilon)
        advantages = advantages.unsqueeze(-1) * response_mask.to(advantages.dtype)
    return advantages, advantages.clone()
