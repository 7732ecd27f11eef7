import pytest
import torch

from posttrain.algorithms.reward_shaping import groups_with_reward_variance, overlong_penalty
from posttrain.errors import ConfigError


def test_overlong_penalty_at_the_boundaries():
    # max 20, buffer 4: no penalty up to 16, then -1/4 per token, -1 at 20, never below -1
    lengths = torch.tensor([0, 16, 17, 18, 20, 25])
    out = overlong_penalty(lengths, max_response_length=20, buffer_length=4, penalty_factor=1.0)
    assert out.dtype.is_floating_point
    assert out.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])


def test_overlong_penalty_factor_scales_and_floors():
    out = overlong_penalty(torch.tensor([16, 17, 18, 20, 25]), 20, 4, penalty_factor=0.5)
    assert out.tolist() == pytest.approx([0.0, -0.125, -0.25, -0.5, -0.5])


@pytest.mark.parametrize(
    ("max_len", "buffer", "factor", "message"),
    [
        (20, 0, 1.0, "buffer_length must be in"),
        (20, 21, 1.0, "buffer_length must be in"),
        (0, 0, 1.0, "max_response_length must be > 0"),
        (20, 4, -1.0, "penalty_factor must be >= 0"),
    ],
)
def test_overlong_penalty_config_errors(max_len, buffer, factor, message):
    with pytest.raises(ConfigError, match=message):
        overlong_penalty(torch.tensor([1]), max_len, buffer, factor)


def test_groups_with_reward_variance():
    ids = ["a", "a", "b", "b", "c", "d", "d"]
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.0, 0.0])
    keep = groups_with_reward_variance(ids, scores)
    # a differs; b and d are all equal; c is a group of one
    assert keep.tolist() == [True, True, False, False, False, False, False]


def test_groups_with_reward_variance_tensor_ids_and_int_scores():
    keep = groups_with_reward_variance(torch.tensor([0, 0, 1, 1]), torch.tensor([1, 1, 0, 1]))
    assert keep.tolist() == [False, False, True, True]


def test_groups_with_reward_variance_length_mismatch():
    with pytest.raises(ValueError, match="3 entries for 2 scores"):
        groups_with_reward_variance(["a", "a", "b"], torch.tensor([1.0, 0.0]))
