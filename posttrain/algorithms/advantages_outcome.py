"""Outcome advantage estimators with a per-prompt baseline: RLOO, REINFORCE++-baseline, ReMax, OPO, GPG,
GRPO pass@k, GDPO (GRPO itself lives in `advantages.py`).

Each scores a response by s_i = sum_t token_level_rewards[i, t] (the whole row, as verl: the outcome
reward sits on the last valid token), subtracts a baseline built from the other samples of its prompt
(rows sharing a group id) or from a greedy rollout, and broadcasts the result to the response tokens.
Same calling convention as every estimator (see `advantages.py`); both outputs are zero outside the
response mask, so a masked token inside a response (tool output) gets advantage 0.

Pure: no I/O, no distributed code. Registered on import (`posttrain.algorithms` imports this module).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from posttrain.algorithms.advantages import (
    GroupIds,
    check_batch,
    group_stats,
    group_sum,
    masked_whiten,
    zero_outside_mask,
)
from posttrain.algorithms.registry import register_advantage
from posttrain.errors import ConfigError


def _to_tokens(sequence_advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Broadcast (B,) per-response advantages to the (B, R) response tokens, 0 outside the mask."""
    return zero_outside_mask(sequence_advantages.unsqueeze(-1).expand(response_mask.shape), response_mask)


@register_advantage("rloo")
def compute_rloo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE Leave-One-Out (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style
    Optimization for Learning from Human Feedback in LLMs"; Kool et al. 2019).

    The baseline of response i is the mean score of the other n-1 samples of its prompt:

        A_i = s_i - 1/(n-1) * sum_{j != i} s_j  =  n/(n-1) * (s_i - mean_g)

    broadcast to the response tokens; returns = advantages.

    Edge cases, as verl: a group of size one has no other sample, so A_i = s_i (no baseline); a group
    whose scores are all equal gets 0; a masked token inside a response gets 0.
    """
    check_batch(token_level_rewards, response_mask)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        stats = group_stats(scores, group_ids)  # mean is 0 for a group of one
        scale = torch.where(stats.size > 1, stats.size / (stats.size - 1).clamp(min=1.0), 1.0)
        advantages = _to_tokens((scores - stats.mean) * scale, response_mask)
    return advantages, advantages.clone()


@register_advantage("reinforce_plus_plus_baseline")
def compute_reinforce_plus_plus_baseline_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large
    Language Models"): group mean as baseline, then whitening over the whole batch.

        A'_i = s_i - mean_g                 broadcast to the response tokens
        A    = masked_whiten(A')            (mean 0, unbiased std 1 over all valid tokens of the batch)

    returns = advantages. The batch statistics count tokens, so long responses weigh more (as verl).

    Edge cases, as verl: a group of size one has mean 0 (A'_i = s_i); an all-equal group has A' = 0 but,
    after whitening, -mu/sigma of the batch (not 0) like every other token; a masked token inside a
    response gets 0 and does not enter the batch statistics. Fewer than 2 valid tokens in the batch
    raises ValueError (whitening).
    """
    check_batch(token_level_rewards, response_mask)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        stats = group_stats(scores, group_ids)
        centred = _to_tokens(scores - stats.mean, response_mask)
        advantages = zero_outside_mask(masked_whiten(centred, response_mask), response_mask)
    return advantages, advantages.clone()


@register_advantage("remax")
def compute_remax_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    *,
    reward_baselines: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023, "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method
    for Aligning Large Language Models"): the greedy rollout's reward as baseline.

        G_t = sum_{t' >= t} r_t' m_t'       (undiscounted return-to-go over valid tokens)
        A_t = G_t - b_i                     b_i = reward_baselines[i], the reward of the greedy
                                            response to row i's prompt (B,)

    returns = G. With an outcome reward only, A_t = s_i - b_i on every token. `group_ids` is ignored.

    Edge cases: no groups are involved (a prompt sampled once is fine); a masked token inside a response
    gets 0 and its reward is not counted in G, as verl; trailing padding contributes nothing.
    """
    check_batch(token_level_rewards, response_mask, reward_baselines=reward_baselines)
    with torch.no_grad():
        rewards = zero_outside_mask(token_level_rewards, response_mask)
        returns = rewards.flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        advantages = zero_outside_mask(
            returns - reward_baselines.to(returns.dtype).unsqueeze(-1), response_mask
        )
        returns = zero_outside_mask(returns, response_mask)
    return advantages, returns


@register_advantage("opo")
def compute_opo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-Policy RL with Optimal reward baseline (Hao et al. 2025, "On-Policy RL with Optimal Reward
    Baseline"): the length-weighted group mean as baseline.

        b_g = sum_{j in g} L_j s_j / sum_{j in g} L_j,   A_i = s_i - b_g

    with L_j = sum_t response_mask[j, t], the number of model tokens of response j; broadcast to the
    response tokens; returns = advantages.

    Edge cases, as verl: a group of size one has baseline 0 (A_i = s_i); a group whose scores are all
    equal gets 0; a masked token inside a response (tool output) gets 0 and does not count in L. A group
    whose responses are all empty (sum L = 0) gets baseline 0 where verl divides 0 by 0 (its rows have no
    valid token, so their advantages are 0 either way, but not NaN here).
    """
    check_batch(token_level_rewards, response_mask)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        lengths = response_mask.to(scores.dtype).sum(dim=-1)
        stats = group_stats(scores, group_ids)
        weighted = group_sum(lengths * scores, stats.index, stats.n_groups)
        total = group_sum(lengths, stats.index, stats.n_groups)
        baselines = torch.where(total > 0, weighted / total.clamp(min=torch.finfo(total.dtype).tiny), 0.0)
        baselines = torch.where(stats.size > 1, baselines[stats.index], 0.0)
        advantages = _to_tokens(scores - baselines, response_mask)
    return advantages, advantages.clone()


@register_advantage("gpg")
def compute_gpg_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    *,
    f_norm: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group Policy Gradient (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline
    for Model Reasoning"), as verl computes it:

        A_i = alpha * (s_i - mean_g) / f_norm,     alpha = B / max(#{j : s_j != 0}, 1)

    over the B rows of the batch; broadcast to the response tokens; returns = advantages. alpha rescales
    the batch gradient for the samples that carry no signal; verl counts the samples with a non-zero
    score (the paper writes B / (B - M), M the samples with zero advantage). verl pairs it with the
    "gpg" policy loss (no ratio clipping).

    Edge cases, as verl: a group of size one has mean 0 (A_i = alpha * s_i); a group whose scores are all
    equal gets 0; a batch of all-zero scores has alpha = B; a masked token inside a response gets 0.
    """
    check_batch(token_level_rewards, response_mask)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        stats = group_stats(scores, group_ids)
        alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1).to(scores.dtype)
        advantages = _to_tokens(alpha * (scores - stats.mean) / f_norm, response_mask)
    return advantages, advantages.clone()


@register_advantage("grpo_passk")
def compute_grpo_passk_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    *,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO for pass@k (verl's `grpo_passk`, after Chen et al. 2025, arXiv:2503.19595): only the best
    sample of each group is reinforced, by its margin over the runner-up.

        A_best = (s_(1) - s_(2)) / (std_g + epsilon)    norm_by_std=True
        A_best =  s_(1) - s_(2)                         norm_by_std=False
        A_i    = 0                                      every other sample

    with s_(1) >= s_(2) the two highest scores of the group and std_g its unbiased standard deviation;
    broadcast to the best sample's response tokens; returns = advantages.

    Edge cases: a group of size one raises ConfigError (pass@k needs n >= 2 samples per prompt; verl
    raises too); a group whose best score is shared (in particular an all-equal group) gets 0 everywhere;
    a masked token inside a response gets 0.
    """
    check_batch(token_level_rewards, response_mask)
    with torch.no_grad():
        scores = token_level_rewards.sum(dim=-1)
        stats = group_stats(scores, group_ids)
        if bool((stats.size < 2).any()):
            row = int(torch.nonzero(stats.size < 2)[0].item())
            raise ConfigError(
                f"grpo_passk needs at least 2 samples per prompt (rollout.n >= 2); "
                f"group {group_ids[row]!r} has 1"
            )
        sequence_advantages = torch.zeros_like(scores)
        for group in range(stats.n_groups):
            rows = torch.nonzero(stats.index == group).squeeze(-1)
            top = torch.topk(scores[rows], 2)
            margin = top.values[0] - top.values[1]
            if norm_by_std:
                margin = margin / (stats.std[rows[0]] + epsilon)
            sequence_advantages[rows[top.indices[0]]] = margin
        advantages = _to_tokens(sequence_advantages, response_mask)
    return advantages, advantages.clone()


@register_advantage("gdpo")
def compute_gdpo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    *,
    reward_components: torch.Tensor | None = None,
    reward_weights: Sequence[float] | None = None,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO, Group reward-Decoupled Normalization Policy Optimization (NVIDIA, 2026, arXiv:2601.05242):
    with several rewards, normalise each one within its group before adding them, instead of GRPO's
    normalising of their sum, in which a reward with a large spread drowns the others.

    With s_ik the k-th reward of response i (`reward_components` (B, K)) and w_k its weight
    (`reward_weights`, default all 1):

        A_ik = (s_ik - mean_g s_k) / (std_g s_k + epsilon)     (s_ik - mean_g s_k without norm_by_std)
        A'_i = sum_k w_k A_ik                                  broadcast to the response tokens
        A    = masked_whiten(A')                               over all valid tokens of the batch

    with GRPO's group statistics (unbiased std; a group of one has mean 0 and std 1). returns = advantages.
    Without `reward_components` the one reward is the row's score sum_t token_level_rewards (GRPO followed
    by batch whitening); with them, token_level_rewards is not used (as verl: shaping or a KL penalty in
    the reward does not reach GDPO's components).

    Edge cases: as GRPO's per component, then whitening's: fewer than 2 valid tokens in the batch raises
    ValueError; a masked token inside a response gets 0 and does not enter the batch statistics.
    """
    check_batch(token_level_rewards, response_mask)
    with torch.no_grad():
        if reward_components is None:
            components = token_level_rewards.sum(dim=-1, keepdim=True)
        else:
            components = reward_components.to(token_level_rewards.dtype)
            if components.dim() != 2 or components.shape[0] != token_level_rewards.shape[0]:
                raise ValueError(
                    f"reward_components is {tuple(components.shape)}, expected ({token_level_rewards.shape[0]}, K)"
                )
        n_components = components.shape[1]
        weights = torch.ones(n_components) if reward_weights is None else torch.tensor(list(reward_weights))
        if weights.numel() != n_components:
            raise ConfigError(f"gdpo: {weights.numel()} reward weights for {n_components} reward components")
        combined = torch.zeros_like(components[:, 0])
        for k in range(n_components):
            stats = group_stats(components[:, k], group_ids)
            normalised = components[:, k] - stats.mean
            if norm_by_std:
                normalised = normalised / (stats.std + epsilon)
            combined = combined + float(weights[k]) * normalised
        advantages = zero_outside_mask(
            masked_whiten(_to_tokens(combined, response_mask), response_mask), response_mask
        )
    return advantages, advantages.clone()
