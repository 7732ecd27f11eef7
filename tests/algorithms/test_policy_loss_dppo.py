import math

import pytest
import torch

from posttrain.algorithms.policy_loss import compute_policy_loss
from posttrain.algorithms.policy_loss_dppo import dppo_kl_loss, dppo_tv_loss
from posttrain.errors import ConfigError

# One row of four tokens, A = [+1, +1, -1, -1]; probabilities of the sampled tokens before and after.
ADV = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
MASK = torch.ones(1, 4, dtype=torch.float64)
OLD_P = [0.5, 0.5, 0.2, 0.2]


def _logs(probs):
    return torch.tensor([[math.log(p) for p in probs]], dtype=torch.float64)


def test_dppo_tv_masks_tokens_that_moved_too_far_in_their_advantage_direction():
    # p = [0.7, 0.6, 0.1, 0.3]: p - p_old = [0.2, 0.1, -0.1, 0.1]; bound 0.15
    # t0 (A > 0, +0.2 > 0.15) is masked; t1 (+0.1), t2 (A < 0, -0.1 >= -0.15), t3 (A < 0, moved up) are kept
    log_prob = _logs([0.7, 0.6, 0.1, 0.3]).requires_grad_(True)
    loss, metrics = compute_policy_loss(dppo_tv_loss, log_prob, _logs(OLD_P), ADV, MASK)
    # ratios [1.4, 1.2, 0.5, 1.5]; L = -A * r * log p on kept tokens:
    # [0, -1.2 log 0.6, 0.5 log 0.1, 1.5 log 0.3] = [0, 0.6129907, -1.1512925, -1.8059592], mean over 4
    assert loss.item() == pytest.approx((0.6129907 - 1.1512925 - 1.8059592) / 4, abs=1e-6)
    assert metrics["pg_clipfrac"] == pytest.approx(1 / 4)
    assert metrics["pg_clipfrac_lower"] == 0.0
    loss.backward()
    # gradient -A * sg[r] on kept tokens, over 4 tokens
    torch.testing.assert_close(log_prob.grad, torch.tensor([[0.0, -0.3, 0.125, 0.375]], dtype=torch.float64))


def test_dppo_truncates_the_ratio_at_clip_ratio_c():
    log_prob = _logs([0.7, 0.6, 0.1, 0.3]).requires_grad_(True)
    loss, metrics = compute_policy_loss(
        dppo_tv_loss, log_prob, _logs(OLD_P), ADV, MASK, options={"clip_ratio_c": 1.3}
    )
    # t3's ratio 1.5 becomes 1.3; t0's 1.4 is above it too but t0 is masked, so it is not counted
    assert loss.item() == pytest.approx((0.6129907 - 1.1512925 + 1.3 * math.log(0.3)) / 4, abs=1e-6)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(1 / 4)


def test_dppo_kl_bounds_the_binary_kl():
    # D = p_old log(p_old / p) + (1 - p_old) log((1 - p_old) / (1 - p)), bound 0.05:
    # t0 (0.5 -> 0.7): 0.0871767 > 0.05, pushed up by A > 0: masked
    # t1 (0.5 -> 0.6): 0.0204110: kept
    # t2 (0.2 -> 0.05): 0.1397787 > 0.05, pushed down by A < 0: masked
    # t3 (0.2 -> 0.3): moved against A < 0's push: kept whatever D
    log_prob = _logs([0.7, 0.6, 0.05, 0.3]).requires_grad_(True)
    loss, metrics = compute_policy_loss(dppo_kl_loss, log_prob, _logs(OLD_P), ADV, MASK)
    # kept: -1.2 log 0.6 = 0.6129907 and 1.5 log 0.3 = -1.8059592
    assert loss.item() == pytest.approx((0.6129907 - 1.8059592) / 4, abs=1e-6)
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 4)
    loss.backward()
    torch.testing.assert_close(log_prob.grad, torch.tensor([[0.0, -0.3, 0.0, 0.375]], dtype=torch.float64))


def test_dppo_bounds_are_settable_and_checked():
    log_prob = _logs([0.7, 0.6, 0.05, 0.3])
    # a loose KL bound keeps every token
    _, metrics = dppo_kl_loss(log_prob, _logs(OLD_P), ADV, MASK, clip_ratio_low=1.0, clip_ratio_high=1.0)
    assert metrics["pg_clipfrac"] == 0.0
    with pytest.raises(ConfigError, match="divergence bounds"):
        dppo_tv_loss(log_prob, _logs(OLD_P), ADV, MASK, clip_ratio_low=-0.1)
    with pytest.raises(ConfigError, match="clip_ratio_c"):
        dppo_kl_loss(log_prob, _logs(OLD_P), ADV, MASK, clip_ratio_c=0.0)
