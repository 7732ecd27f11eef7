import math

import numpy as np
import pytest
import torch

from posttrain.algorithms.advantages import (
    compute_gae_advantages,
    compute_grpo_advantages,
    compute_reinforce_plus_plus_advantages,
    group_index,
    group_stats,
    masked_whiten,
    required_inputs,
)
from posttrain.algorithms.registry import ADVANTAGE_ESTIMATORS, get_advantage_estimator
from posttrain.errors import ConfigError

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


def test_group_ids_in_a_tensor_are_compared_by_value():
    # a 0-d tensor hashes by identity: without converting, every row would be a group of its own
    index, n_groups = group_index(torch.tensor([0, 0, 1, 1]))
    assert index.tolist() == [0, 0, 1, 1] and n_groups == 2
    index, n_groups = group_index(np.array(["a", "b", "a"], dtype=object))
    assert index.tolist() == [0, 1, 0] and n_groups == 2


def test_group_index_first_seen_order():
    index, n_groups = group_index(["x", "y", "x", "z"])
    assert index.tolist() == [0, 1, 0, 2] and n_groups == 3


def test_length_mismatch():
    with pytest.raises(ValueError, match="group_ids has 1 entries for a batch of 2 rows"):
        compute_grpo_advantages(torch.zeros(2, 1), torch.ones(2, 1), ["a"])


def test_registered_as_grpo():
    assert get_advantage_estimator("grpo") is compute_grpo_advantages


# ---- shared helpers ------------------------------------------------------------------------------
ALL_ESTIMATORS = {
    "gae",
    "gpg",
    "grpo",
    "grpo_passk",
    "opo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
}


def test_every_verl_estimator_is_registered():
    assert set(ADVANTAGE_ESTIMATORS.names()) >= ALL_ESTIMATORS


def test_required_inputs():
    assert required_inputs("gae") == {"values"}
    assert required_inputs("remax") == {"reward_baselines"}
    assert required_inputs("grpo") == set()
    for name in ALL_ESTIMATORS - {"gae", "remax"}:
        assert required_inputs(name) == frozenset(), name


def test_unknown_estimator_lists_every_valid_name():
    with pytest.raises(ConfigError, match=r"unknown advantage estimator 'gea'") as info:
        required_inputs("gea")
    for name in ALL_ESTIMATORS:
        assert name in str(info.value)


def _call(name, rewards, mask, group_ids, **options):
    """Call estimator `name`, supplying its required inputs by name (an unknown one fails the test)."""
    batch_size, width = rewards.shape
    supplied = {
        "values": torch.linspace(-1.0, 1.0, batch_size * width).reshape(batch_size, width),
        "reward_baselines": torch.full((batch_size,), 0.25),
    }
    inputs = {key: supplied[key] for key in required_inputs(name)}
    return get_advantage_estimator(name)(rewards, mask, group_ids, **inputs, **options)


@pytest.mark.parametrize("name", sorted(ALL_ESTIMATORS))
def test_every_estimator_zero_outside_mask_and_no_gradient(name):
    # two samples per prompt; row 0 has a tool-output hole at position 1, row 2 trailing padding
    mask = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.float32)
    rewards = torch.tensor(
        [[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.0, 2.0, 0.0, 0.0], [0.0, 0.0, 0.5, 0.0]]
    )
    rewards.requires_grad_(True)
    advantages, returns = _call(name, rewards, mask, ["p", "p", "q", "q"])
    for out in (advantages, returns):
        assert out.shape == (4, 4)
        assert not out.requires_grad
        assert torch.isfinite(out).all()
        assert (out[mask == 0] == 0).all()
    assert (advantages[mask == 1] != 0).any()


def test_masked_whiten_unbiased_and_ignores_masked_entries():
    values = torch.tensor([[1.0, float("nan")], [2.0, 3.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    # valid {1, 2, 3}: mean 2, unbiased variance ((1 + 0 + 1) / 2) = 1 -> -1, 0, 1 (up to the 1e-8)
    whitened = masked_whiten(values, mask)
    torch.testing.assert_close(whitened[mask == 1], torch.tensor([-1.0, 0.0, 1.0]))
    shifted = masked_whiten(values, mask, shift_mean=False)
    torch.testing.assert_close(shifted[mask == 1], torch.tensor([1.0, 2.0, 3.0]))


def test_masked_whiten_needs_two_valid_tokens():
    with pytest.raises(ValueError, match="at least 2 valid tokens, got 1"):
        masked_whiten(torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0, 0.0]]))


def test_group_stats_singleton_convention():
    stats = group_stats(torch.tensor([1.0, 3.0, 5.0]), ["x", "y", "x"])
    assert stats.size.tolist() == [2.0, 1.0, 2.0]
    assert stats.mean.tolist() == [3.0, 0.0, 3.0]  # the singleton "y": mean 0, std 1 (verl)
    torch.testing.assert_close(stats.std, torch.tensor([2.0 * math.sqrt(2.0), 1.0, 2.0 * math.sqrt(2.0)]))


def test_shape_errors():
    with pytest.raises(ValueError, match=r"values is \(2, 3\), expected \(2, 2\)"):
        compute_gae_advantages(torch.zeros(2, 2), torch.ones(2, 2), ["a", "b"], values=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="must both be"):
        compute_reinforce_plus_plus_advantages(torch.zeros(2, 2), torch.ones(2, 3), ["a", "b"])


# ---- GAE -----------------------------------------------------------------------------------------
def test_gae_monte_carlo_when_gamma_and_lam_are_one():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    mask = torch.ones(1, 3)
    values = torch.tensor([[0.2, 0.4, 0.6]])
    advantages, returns = compute_gae_advantages(rewards, mask, ["a"], values=values)
    # gamma = lam = 1: A_t = R - V_t = 0.8, 0.6, 0.4; returns = A + V = 1 everywhere
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 1.0]]))
    # whitened: mean 0.6, unbiased std 0.2
    torch.testing.assert_close(advantages, torch.tensor([[1.0, 0.0, -1.0]]))


def test_gae_discounted_with_tool_output_and_padding():
    # row 0: model, tool output (masked), model (reward 1), padding; garbage critic values at 9 and 7
    # row 1: four model tokens, reward 2 on the last, V = 1 everywhere
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 2.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, 0.5, 7.0], [1.0, 1.0, 1.0, 1.0]])
    advantages, returns = compute_gae_advantages(rewards, mask, ["a", "b"], values=values, gamma=0.5, lam=0.5)
    # row 0, t=2: delta = 1 + 0.5 * 0 - 0.5 = 0.5 (V after the last valid token is 0, not the pad's 7)
    #        t=0: delta = 0 + 0.5 * 0.5 - 0.5 = -0.25 (next value is V_2, skipping the tool token's 9)
    #             A_0 = -0.25 + 0.25 * 0.5 = -0.125
    # row 1: A_3 = 2 - 1 = 1; A_2 = -0.5 + 0.25 * 1 = -0.25; A_1 = -0.5 + 0.25 * -0.25 = -0.5625;
    #        A_0 = -0.5 + 0.25 * -0.5625 = -0.640625
    expected_returns = torch.tensor([[0.375, 0.0, 1.0, 0.0], [0.359375, 0.4375, 0.75, 2.0]])
    torch.testing.assert_close(returns, expected_returns)
    # whitened over the 6 valid tokens: mean -0.0130208, unbiased variance 0.4107829
    expected = torch.tensor([[-0.174715, 0.0, 0.80044, 0.0], [-0.979219, -0.857324, -0.369746, 1.580564]])
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=0)


def test_gae_groups_play_no_role():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    values = torch.tensor([[0.1, 0.2], [0.3, 0.4]])
    same, _ = compute_gae_advantages(rewards, torch.ones(2, 2), ["a", "a"], values=values)
    apart, _ = compute_gae_advantages(rewards, torch.ones(2, 2), ["a", "b"], values=values)
    torch.testing.assert_close(same, apart)


# ---- REINFORCE++ ---------------------------------------------------------------------------------
def test_reinforce_plus_plus_discounted_return_across_tool_output():
    # row 0: reward 0.2 (e.g. KL) on token 0, a tool-output token holding a stray 5 (ignored), outcome 1
    rewards = torch.tensor([[0.2, 5.0, 1.0, 0.0], [0.0, 0.0, 0.0, 2.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    advantages, returns = compute_reinforce_plus_plus_advantages(rewards, mask, ["a", "a"], gamma=0.5)
    # row 0: G_2 = 1; the tool token passes it through undiscounted; G_0 = 0.2 + 0.5 * 1 = 0.7
    # row 1: G = 0.25, 0.5, 1, 2
    torch.testing.assert_close(returns, torch.tensor([[0.7, 0.0, 1.0, 0.0], [0.25, 0.5, 1.0, 2.0]]))
    # whitened over {0.7, 1, 0.25, 0.5, 1, 2}: mean 0.9083333, unbiased variance 0.3704167
    expected = torch.tensor([[-0.342305, 0.0, 0.150614, 0.0], [-1.081684, -0.670918, 0.150614, 1.793679]])
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=0)


def test_reinforce_plus_plus_undiscounted_outcome_reaches_the_first_turn():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]])
    advantages, returns = compute_reinforce_plus_plus_advantages(rewards, mask, ["a", "a"])
    torch.testing.assert_close(returns[0], torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0]))
    # valid returns {1, 1, 1, 1, 0, 0, 0}: mean 4/7, unbiased std sqrt(2/7)
    high, low = (3 / 7) / math.sqrt(2 / 7), (-4 / 7) / math.sqrt(2 / 7)
    torch.testing.assert_close(advantages[0], torch.tensor([high, high, 0.0, 0.0, high, high]))
    torch.testing.assert_close(advantages[1], torch.tensor([low, low, low, 0.0, 0.0, 0.0]))
