"""Clipped value loss against numbers computed by hand."""

from __future__ import annotations

import pytest
import torch

from posttrain.algorithms.aggregation import aggregate_loss
from posttrain.algorithms.value_loss import clipped_value_loss
from posttrain.errors import ConfigError


def test_clipped_value_loss_by_hand() -> None:
    values = torch.tensor([[1.0, 0.0, 5.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 0.0]])
    returns = torch.tensor([[2.0, 1.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    per_token, metrics = clipped_value_loss(values, old, returns, mask, cliprange_value=0.5)
    loss = aggregate_loss(per_token, mask, "token-mean")
    # token 0: unclipped (1-2)^2 = 1, clipped V = 0.5 -> (0.5-2)^2 = 2.25 -> 0.5*2.25 = 1.125
    # token 1: unclipped (0-1)^2 = 1, clipped V = 0 -> 1 -> 0.5; token 2 masked. token-mean: (1.125+0.5)/2
    assert loss.item() == pytest.approx(0.8125)
    assert metrics["vf_clipfrac"] == pytest.approx(0.5)
    loss.backward()
    # token 0 takes the clipped branch, whose value is constant in V there (clamp saturated): zero gradient;
    # token 1: d/dV 0.5*(V-1)^2 / 2 tokens = (0-1)/2 = -0.5 (both branches equal; max picks the first)
    assert values.grad[0].tolist() == pytest.approx([0.0, -0.5, 0.0])


def test_unclipped_values_are_not_counted_as_clipped() -> None:
    # |V - V_old| = 0.9 and 0.7 < c = 1: nothing is clipped. V_old + (V - V_old) is 0.5999999999999999 for V = 0.6
    # in float64, whose loss against R = 1 is one ulp above (V - R)^2: that rounding must not count as a clip
    values = torch.tensor([[0.6, 0.4]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-0.3, -0.3]], dtype=torch.float64)
    returns = torch.tensor([[1.0, 1.0]], dtype=torch.float64)
    per_token, metrics = clipped_value_loss(values, old, returns, torch.ones_like(old), cliprange_value=1.0)
    assert metrics["vf_clipfrac"] == 0.0
    # 0.5 * (0.6 - 1)^2 = 0.08, 0.5 * (0.4 - 1)^2 = 0.18, exactly the unclipped losses
    assert per_token.tolist() == [[0.5 * (0.6 - 1.0) ** 2, 0.5 * (0.4 - 1.0) ** 2]]
    per_token.sum().backward()
    assert values.grad[0].tolist() == pytest.approx([0.6 - 1.0, 0.4 - 1.0])


def test_bad_cliprange_is_rejected() -> None:
    x = torch.zeros(1, 1)
    with pytest.raises(ConfigError, match="cliprange_value must be > 0"):
        clipped_value_loss(x, x, x, torch.ones(1, 1), cliprange_value=0.0)
