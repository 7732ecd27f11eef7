import math

import pytest
import torch

from posttrain.algorithms.advantages_outcome import (
    compute_gdpo_advantages,
    compute_gpg_advantages,
    compute_grpo_passk_advantages,
    compute_opo_advantages,
    compute_reinforce_plus_plus_baseline_advantages,
    compute_remax_advantages,
    compute_rloo_advantages,
)
from posttrain.algorithms.registry import get_advantage_estimator
from posttrain.errors import ConfigError

EPS = 1e-6
# a: three samples; b: a group of one; c: two samples with equal scores
GROUP_IDS = ["a", "a", "a", "b", "c", "c"]
SCORES = [1.0, 0.0, 0.0, 0.5, 1.0, 1.0]
MASK = torch.tensor(
    [
        [1, 1, 1, 0],  # 3 model tokens
        [1, 0, 1, 1],  # 3 model tokens around a tool-output token
        [1, 1, 0, 0],  # 2
        [1, 1, 1, 1],  # 4
        [1, 0, 0, 0],  # 1
        [1, 1, 1, 1],  # 4
    ],
    dtype=torch.float32,
)


def _rewards(scores=SCORES, mask=MASK):
    """Each score on its row's last valid token."""
    rewards = torch.zeros(mask.shape)
    for i, score in enumerate(scores):
        rewards[i, int(mask[i].nonzero().max())] = score
    return rewards


def _per_row(values):
    return torch.tensor(values)[:, None] * MASK


def test_registered_names():
    assert get_advantage_estimator("rloo") is compute_rloo_advantages
    assert (
        get_advantage_estimator("reinforce_plus_plus_baseline")
        is compute_reinforce_plus_plus_baseline_advantages
    )
    assert get_advantage_estimator("remax") is compute_remax_advantages
    assert get_advantage_estimator("opo") is compute_opo_advantages
    assert get_advantage_estimator("gpg") is compute_gpg_advantages
    assert get_advantage_estimator("grpo_passk") is compute_grpo_passk_advantages


def test_rloo_leave_one_out():
    advantages, returns = compute_rloo_advantages(_rewards(), MASK, GROUP_IDS)
    # a: 1 - (0 + 0) / 2 = 1; 0 - (1 + 0) / 2 = -0.5 (twice); b alone: its raw score; c equal: 0
    expected = _per_row([1.0, -0.5, -0.5, 0.5, 0.0, 0.0])
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, expected)
    assert advantages[1, 1] == 0  # the tool-output token


def test_reinforce_plus_plus_baseline_centres_then_whitens_over_tokens():
    advantages, returns = compute_reinforce_plus_plus_baseline_advantages(_rewards(), MASK, GROUP_IDS)
    # centred: a (mean 1/3): 2/3 on 3 tokens, -1/3 on 3 + 2 tokens; b alone: 0.5 on 4; c: 0 on 1 + 4.
    # 17 valid tokens: mean (2 - 5/3 + 2) / 17 = 7/51 = 0.1372549, unbiased variance 0.1605392
    top, bottom, alone, equal = 1.321305, -1.174493, 0.905338, -0.342560
    expected = _per_row([top, bottom, bottom, alone, equal, equal])
    torch.testing.assert_close(advantages, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(returns, advantages)
    assert advantages[1, 1] == 0


def test_remax_greedy_baseline():
    rewards = torch.tensor(
        [
            [0.0, 0.0, 1.0],
            [-0.1, 3.0, 1.0],  # per-token reward -0.1 (e.g. KL), a stray 3 on a tool-output token, outcome 1
            [0.0, 2.0, 0.0],  # padded after token 1
        ]
    )
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    baselines = torch.tensor([0.5, 1.0, 2.0])
    advantages, returns = compute_remax_advantages(rewards, mask, ["a", "a", "b"], reward_baselines=baselines)
    # undiscounted return-to-go over valid tokens, minus the greedy reward of the row's prompt
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 1.0], [0.9, 0.0, 1.0], [2.0, 2.0, 0.0]]))
    torch.testing.assert_close(advantages, torch.tensor([[0.5, 0.5, 0.5], [-0.1, 0.0, 0.0], [0.0, 0.0, 0.0]]))


def test_remax_needs_one_baseline_per_row():
    with pytest.raises(ValueError, match=r"reward_baselines is \(1,\), expected \(2,\)"):
        compute_remax_advantages(
            torch.zeros(2, 2), torch.ones(2, 2), ["a", "b"], reward_baselines=torch.zeros(1)
        )


def test_opo_length_weighted_baseline():
    advantages, returns = compute_opo_advantages(_rewards(), MASK, GROUP_IDS)
    # a: lengths 3, 3, 2 (the tool token does not count) -> b = (3 * 1 + 0 + 0) / 8 = 0.375
    # b alone: baseline 0; c: (1 * 1 + 4 * 1) / 5 = 1 -> 0
    expected = _per_row([0.625, -0.375, -0.375, 0.5, 0.0, 0.0])
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, expected)


def test_opo_group_of_empty_responses_is_zero_not_nan():
    mask = torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, 1.0], [1.0, 0.0]])
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 1.0], [0.0, 0.0]])
    advantages, _ = compute_opo_advantages(rewards, mask, ["e", "e", "f", "f"])
    # f: lengths 2, 1 -> b = 2 / 3
    torch.testing.assert_close(
        advantages, torch.tensor([[0.0, 0.0], [0.0, 0.0], [1 / 3, 1 / 3], [-2 / 3, 0.0]])
    )


def test_gpg_alpha_counts_nonzero_scores():
    advantages, returns = compute_gpg_advantages(_rewards(), MASK, GROUP_IDS)
    # alpha = B / #nonzero = 6 / 4 = 1.5; a (mean 1/3): 1.5 * 2/3 = 1, 1.5 * -1/3 = -0.5;
    # b alone: 1.5 * 0.5 = 0.75; c equal: 0
    expected = _per_row([1.0, -0.5, -0.5, 0.75, 0.0, 0.0])
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, expected)
    halved, _ = compute_gpg_advantages(_rewards(), MASK, GROUP_IDS, f_norm=2.0)
    torch.testing.assert_close(halved, expected / 2)


def test_gpg_all_zero_scores():
    advantages, _ = compute_gpg_advantages(torch.zeros(2, 2), torch.ones(2, 2), ["a", "a"])
    assert (advantages == 0).all()


PASSK_IDS = ["a", "a", "a", "c", "c", "e", "e", "d", "d", "d"]
PASSK_SCORES = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 2.0, 1.0, 1.0, 0.0]


def _passk_batch():
    mask = torch.ones(len(PASSK_SCORES), 3)
    mask[0, 1] = 0  # the best sample of a has a tool-output token
    return _rewards(PASSK_SCORES, mask), mask


def test_grpo_passk_only_the_best_sample_moves():
    rewards, mask = _passk_batch()
    advantages, returns = compute_grpo_passk_advantages(rewards, mask, PASSK_IDS)
    # a: 1 - 0 over unbiased std sqrt(1/3); c equal: 0; e: row 6, (2 - 0) / sqrt(2); d: best shared: 0
    expected_seq = [1 / (math.sqrt(1 / 3) + EPS), 0, 0, 0, 0, 0, 2 / (math.sqrt(2) + EPS), 0, 0, 0]
    expected = torch.tensor(expected_seq)[:, None] * mask
    torch.testing.assert_close(advantages, expected)
    torch.testing.assert_close(returns, advantages)
    assert advantages[0].tolist() == pytest.approx([1.7320478, 0.0, 1.7320478], abs=1e-6)


def test_grpo_passk_without_std():
    rewards, mask = _passk_batch()
    advantages, _ = compute_grpo_passk_advantages(rewards, mask, PASSK_IDS, norm_by_std=False)
    expected = torch.tensor([1.0, 0, 0, 0, 0, 0, 2.0, 0, 0, 0])[:, None] * mask
    torch.testing.assert_close(advantages, expected)


def test_grpo_passk_rejects_a_group_of_one():
    with pytest.raises(ConfigError, match=r"at least 2 samples per prompt .* group 'b' has 1"):
        compute_grpo_passk_advantages(_rewards(), MASK, GROUP_IDS)


def test_group_ids_must_match_the_batch():
    with pytest.raises(ValueError, match="group_ids has 5 entries for a batch of 6 rows"):
        compute_rloo_advantages(_rewards(), MASK, GROUP_IDS[:5])


# --- GDPO ----------------------------------------------------------------------------------------------
# Two prompts of two samples, one token each; correctness on a 0/1 scale, format on a 0/10 scale.
GDPO_IDS = ["a", "a", "b", "b"]
GDPO_COMPONENTS = torch.tensor([[1.0, 10.0], [0.0, 0.0], [1.0, 0.0], [1.0, 10.0]])
GDPO_MASK = torch.ones(4, 1)


def test_gdpo_normalises_each_reward_within_its_group_then_whitens_the_sum():
    # per component, GRPO within the group (std unbiased, sqrt(0.5) for a pair 0, 1 apart):
    #   correctness: a [1, 0] -> [+0.7071068, -0.7071068]; b [1, 1] -> [0, 0]
    #   format:      a [10, 0] -> [+0.7071068, -0.7071068]; b [0, 10] -> [-0.7071068, +0.7071068]
    # sum [1.4142136, -1.4142136, -0.7071068, 0.7071068]: mean 0, unbiased var (2 * 2 + 2 * 0.5) / 3 = 5 / 3
    # whitened: sum / sqrt(5 / 3) = [1.0954451, -1.0954451, -0.5477226, 0.5477226]
    adv, ret = compute_gdpo_advantages(
        torch.zeros(4, 1), GDPO_MASK, GDPO_IDS, reward_components=GDPO_COMPONENTS
    )
    expected = torch.tensor([[1.0954451], [-1.0954451], [-0.5477226], [0.5477226]])
    torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret, adv)
    # GRPO on the summed reward [11, 0, 1, 11] would rank prompt b's samples like a's: +-0.7071068 each
    grpo = get_advantage_estimator("grpo")(GDPO_COMPONENTS.sum(-1, keepdim=True), GDPO_MASK, GDPO_IDS)[0]
    assert grpo[2].item() == pytest.approx(-0.7071061, abs=1e-5)


def test_gdpo_reward_weights_and_the_single_reward_fallback():
    # weights [1, 0.5]: sum [1.0606602, -1.0606602, -0.3535534, 0.3535534]; var (2 * 1.125 + 2 * 0.125) / 3
    adv, _ = compute_gdpo_advantages(
        torch.zeros(4, 1), GDPO_MASK, GDPO_IDS, reward_components=GDPO_COMPONENTS, reward_weights=[1.0, 0.5]
    )
    scale = math.sqrt(2.5 / 3)
    expected = torch.tensor([[1.0606602], [-1.0606602], [-0.3535534], [0.3535534]]) / scale
    torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-5)
    # without components: the row score is the one reward (GRPO, then whitening)
    rewards = torch.tensor([[1.0], [0.0], [0.0], [1.0]])
    adv, _ = compute_gdpo_advantages(rewards, GDPO_MASK, GDPO_IDS)
    # GRPO [0.7071, -0.7071, -0.7071, 0.7071]; whitened: / sqrt(4 * 0.5 / 3)
    expected = torch.tensor([[1.0], [-1.0], [-1.0], [1.0]]) * math.sqrt(0.5) / math.sqrt(2.0 / 3.0)
    torch.testing.assert_close(adv, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match="2 reward weights for 1 reward components"):
        compute_gdpo_advantages(rewards, GDPO_MASK, GDPO_IDS, reward_weights=[1.0, 2.0])
