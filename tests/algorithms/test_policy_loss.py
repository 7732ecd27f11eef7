import math

import pytest
import torch

from posttrain.algorithms.policy_loss import kl_loss, ppo_clip_loss
from posttrain.algorithms.registry import get_policy_loss
from posttrain.errors import ConfigError

# One row, five tokens; the fifth is padding. old log-probs are 0, so ratio = exp(log_prob).
RATIOS = [1.5, 0.5, 1.1, 4.0, 10.0]
ADVANTAGES = torch.tensor([[1.0, -1.0, 1.0, -1.0, 1.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
OLD = torch.zeros(1, 5)


def _log_prob():
    return torch.tensor([[math.log(r) for r in RATIOS]], requires_grad=True)


def test_ppo_clip_hand_computed():
    # t0: r=1.5, A=+1: max(-1.5, -1.2) = -1.2       (clipped)
    # t1: r=0.5, A=-1: max(0.5, 0.8) = 0.8, min(0.8, 3) = 0.8   (clipped)
    # t2: r=1.1, A=+1: max(-1.1, -1.1) = -1.1       (inside the range)
    # t3: r=4.0, A=-1: max(4.0, 1.2) = 4.0, min(4.0, 3) = 3.0   (dual clip)
    # token-mean over 4 valid tokens: (-1.2 + 0.8 - 1.1 + 3.0) / 4 = 0.375
    loss, metrics = ppo_clip_loss(_log_prob(), OLD, ADVANTAGES, MASK)
    assert loss.item() == pytest.approx(0.375)
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 4)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(1 / 4)
    # mean(old - new) = -(ln 1.5 + ln 0.5 + ln 1.1 + ln 4) / 4 = -ln(3.3) / 4
    assert metrics["ppo_kl"] == pytest.approx(-0.29848062)
    assert all(isinstance(v, float) for v in metrics.values())


def test_gradient_flows_only_through_unclipped_tokens():
    log_prob = _log_prob()
    loss, _ = ppo_clip_loss(log_prob, OLD, ADVANTAGES, MASK)
    loss.backward()
    # Only t2 is unclipped: d(-A * r)/d log_prob = -A * r = -1.1, divided by 4 tokens.
    # t3 is where the dual clip is active: its gradient is exactly zero.
    torch.testing.assert_close(log_prob.grad, torch.tensor([[0.0, 0.0, -0.275, 0.0, 0.0]]))
    assert log_prob.grad[0, 3].item() == 0.0


def test_without_dual_clip_the_same_token_would_have_gradient():
    """Control for the test above: with a loose dual bound, t3 (r=4, A=-1) gets gradient -A*r/4 = 1.0."""
    log_prob = _log_prob()
    loss, metrics = ppo_clip_loss(log_prob, OLD, ADVANTAGES, MASK, clip_ratio_c=10.0)
    loss.backward()
    assert log_prob.grad[0, 3].item() == pytest.approx(1.0)
    assert metrics["pg_clipfrac_lower"] == 0.0


def test_clip_higher():
    log_prob = torch.tensor([[math.log(1.25)]])
    adv = torch.ones(1, 1)
    mask = torch.ones(1, 1)
    symmetric, m1 = ppo_clip_loss(log_prob, torch.zeros(1, 1), adv, mask)
    higher, m2 = ppo_clip_loss(log_prob, torch.zeros(1, 1), adv, mask, clip_ratio_high=0.28)
    assert symmetric.item() == pytest.approx(-1.2) and m1["pg_clipfrac"] == 1.0
    assert higher.item() == pytest.approx(-1.25) and m2["pg_clipfrac"] == 0.0


def test_aggregation_mode_is_honoured():
    loss, _ = ppo_clip_loss(_log_prob(), OLD, ADVANTAGES, MASK, loss_agg_mode="seq-mean-token-sum")
    assert loss.item() == pytest.approx(1.5)  # one sequence, token sum 1.5
    loss, _ = ppo_clip_loss(_log_prob(), OLD, ADVANTAGES, MASK, global_tokens=8, dp_size=2)
    assert loss.item() == pytest.approx(1.5 / 8 * 2)


def test_huge_log_ratio_stays_finite():
    log_prob = torch.tensor([[100.0, 100.0]], requires_grad=True)
    adv = torch.tensor([[-1.0, 1.0]])
    loss, metrics = ppo_clip_loss(log_prob, torch.zeros(1, 2), adv, torch.ones(1, 2))
    loss.backward()
    assert loss.item() == pytest.approx((3.0 - 1.2) / 2)
    assert torch.isfinite(log_prob.grad).all()
    assert metrics["ppo_kl"] == pytest.approx(-20.0)  # the clamped log-ratio


def test_invalid_clip_ratios():
    with pytest.raises(ConfigError, match="clip_ratio_c must be > 1.0"):
        ppo_clip_loss(_log_prob(), OLD, ADVANTAGES, MASK, clip_ratio_c=1.0)
    with pytest.raises(ConfigError, match="clip_ratio_low"):
        ppo_clip_loss(_log_prob(), OLD, ADVANTAGES, MASK, clip_ratio_low=1.5)


def test_registry_lookup():
    assert get_policy_loss("vanilla") is ppo_clip_loss
    with pytest.raises(ConfigError, match=r"unknown policy loss 'ppo2'; valid: .*vanilla"):
        get_policy_loss("ppo2")


def test_kl_loss_hand_computed():
    log_prob = torch.tensor([[-1.0, -2.0, 0.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, metrics = kl_loss(log_prob, ref, mask, kind="k1")
    assert loss.item() == pytest.approx((0.5 - 1.0) / 2)
    assert metrics["kl_loss"] == pytest.approx(-0.25)
    loss, metrics = kl_loss(log_prob, ref, mask, kind="low_var_kl")
    assert loss.item() == pytest.approx((0.10653066 + 0.71828183) / 2)
    loss.backward()
    # d k3 / d log_prob = 1 - r, r = exp(ref - lp): [1 - e^-0.5, 1 - e], halved by the token mean
    expected = [(1 - math.exp(-0.5)) / 2, (1 - math.e) / 2, 0.0]
    assert log_prob.grad[0].tolist() == pytest.approx(expected, abs=1e-6)
