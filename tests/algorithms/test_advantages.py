import math

import numpy as np
import pytest
import torch

from posttrain.algorithms.advantages import compute_grpo_advantages, group_index
from posttrain.algorithms.registry import get_advantage_estimator

EPS = 1e-6
GROUP_IDS = ["a", "a", "b", "b", "b", "c", "d", "d"]
SCORES = [1.0, 0.0, 0.0, 1.0, 2.0, 0.5, 1.0, 1.0]
LENGTHS = [3, 1, 2, 3, 1, 2, 3, 3]
WIDTH = 3


def _batch():
    """Outcome scores on the last valid token of right-padded responses."""
    mask = (torch.arange(WIDTH) < torch.tensor(LENGTHS)[:, None]).float()
    rewards = torch.zeros(len(SCORES), WIDTH)
    for i, (score, length) in enumerate(zip(SCORES, LENGTHS, strict=True)):
        rewards[i, length - 1] = score
    return rewards, mask


def test_grpo_hand_computed():
    rewards, mask = _batch()
    advantages, returns = compute_grpo_advantages(rewards, mask, GROUP_IDS)
    # a: scores 1, 0 -> mean 0.5, unbiased std sqrt((0.25 + 0.25) / 1) = 0.70710678
    # b: scores 0, 1, 2 -> mean 1, unbiased std sqrt((1 + 0 + 1) / 2) = 1
    # c: a single sample -> mean 0, std 1 (as verl): the raw score 0.5
    # d: scores 1, 1 -> all equal: 0
    sqrt_half = math.sqrt(0.5)
    expected_seq = [
        0.5 / (sqrt_half + EPS),
        -0.5 / (sqrt_half + EPS),
        -1 / (1 + EPS),
        0.0,
        1 / (1 + EPS),
        0.5 / (1 + EPS),
        0.0,
        0.0,
    ]
    expected = torch.tensor(expected_seq)[:, None] * mask
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, advantages)
    assert advantages[0, 0].item() == pytest.approx(0.70710572, abs=1e-6)
    assert (advantages[mask == 0] == 0).all()  # nothing outside the response


def test_dr_grpo_no_std_normalisation():
    rewards, mask = _batch()
    advantages, _ = compute_grpo_advantages(rewards, mask, GROUP_IDS, norm_by_std=False)
    expected_seq = [0.5, -0.5, -1.0, 0.0, 1.0, 0.5, 0.0, 0.0]
    torch.testing.assert_close(advantages, torch.tensor(expected_seq)[:, None] * mask)


def _verl_reference(scores, group_ids, epsilon=EPS):
    """verl's loop: torch.mean / torch.std per group, (0, 1) for singletons."""
    groups: dict = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(scores[i])
    stats = {}
    for g, values in groups.items():
        if len(values) == 1:
            stats[g] = (torch.tensor(0.0), torch.tensor(1.0))
        else:
            stacked = torch.stack(values)
            stats[g] = (stacked.mean(), stacked.std())
    return torch.stack([(scores[i] - stats[g][0]) / (stats[g][1] + epsilon) for i, g in enumerate(group_ids)])


def test_matches_verl_reference_on_random_groups():
    torch.manual_seed(0)
    group_ids = np.array([f"p{i % 5}" for i in range(23)], dtype=object)  # numpy object column, uneven groups
    rewards = torch.randn(23, 4)
    mask = torch.ones(23, 4)
    advantages, _ = compute_grpo_advantages(rewards, mask, group_ids)
    expected = _verl_reference(rewards.sum(-1), list(group_ids))
    torch.testing.assert_close(advantages[:, 0], expected)


def test_no_gradient_and_any_hashable_ids():
    rewards = torch.tensor([[1.0], [0.0]], requires_grad=True)
    advantages, _ = compute_grpo_advantages(rewards, torch.ones(2, 1), [7, 7])
    assert not advantages.requires_grad
    assert advantages[:, 0].tolist() == pytest.approx([0.70710572, -0.70710572], abs=1e-6)


def test_group_index_first_seen_order():
    index, n_groups = group_index(["x", "y", "x", "z"])
    assert index.tolist() == [0, 1, 0, 2] and n_groups == 3


def test_length_mismatch():
    with pytest.raises(ValueError, match="group_ids has 1 entries for a batch of 2 rows"):
        compute_grpo_advantages(torch.zeros(2, 1), torch.ones(2, 1), ["a"])


def test_registered_as_grpo():
    assert get_advantage_estimator("grpo") is compute_grpo_advantages
