"""The Bradley-Terry loss with margin and reward centering against hand computations (incl. identical pairs)."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algorithms.reward_model_loss import bradley_terry_loss
from posttrain.errors import ConfigError


def softplus(x: float) -> float:
    """-log sigmoid(-x) = log(1 + e^x)."""
    return math.log1p(math.exp(x))


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_bradley_terry_by_hand() -> None:
    losses, m = bradley_terry_loss(t(1.0, 0.0, 2.0), t(0.0, 0.0, 3.0))
    # -log sigmoid(d) = log(1 + e^-d) for d = 1, 0, -1
    assert losses.tolist() == pytest.approx([softplus(-1.0), math.log(2.0), softplus(1.0)], abs=1e-12)
    assert m["accuracy"].tolist() == [1.0, 0.0, 0.0]  # a tie is not a win
    assert m["ties"].tolist() == [0.0, 1.0, 0.0]
    assert m["margin"].tolist() == [1.0, 0.0, -1.0]
    assert m["center"].tolist() == [1.0, 0.0, 25.0]


def test_margin_shifts_the_difference() -> None:
    losses, m = bradley_terry_loss(t(1.0, 1.0), t(0.0, 0.0), margin=t(0.5, 3.0))
    assert losses.tolist() == pytest.approx([softplus(-0.5), softplus(2.0)], abs=1e-12)
    assert m["accuracy"].tolist() == [1.0, 1.0]  # accuracy compares the scores, not the margin
    assert m["margin"].tolist() == [1.0, 1.0]


def test_centering_adds_coef_times_sum_squared() -> None:
    coef = 0.01
    losses, m = bradley_terry_loss(t(1.5, -2.0), t(0.5, 1.0), center_coef=coef)
    expected = [softplus(-1.0) + coef * 2.0**2, softplus(3.0) + coef * (-1.0) ** 2]
    assert losses.tolist() == pytest.approx(expected, abs=1e-12)
    assert m["bt_loss"].tolist() == pytest.approx([softplus(-1.0), softplus(3.0)], abs=1e-12)


def test_identical_chosen_and_rejected() -> None:
    """Equal scores: the BT term is log 2 and pushes the two scores apart equally (zero net gradient for one
    shared sequence); centering pulls both towards 0 by 2 * coef * (r_c + r_r)."""
    coef = 0.1
    chosen = t(0.7).requires_grad_()
    rejected = t(0.7).requires_grad_()
    losses, m = bradley_terry_loss(chosen, rejected, center_coef=coef)
    assert losses.item() == pytest.approx(math.log(2.0) + coef * 1.4**2, abs=1e-12)
    assert m["accuracy"].item() == 0.0 and m["ties"].item() == 1.0
    losses.sum().backward()
    assert chosen.grad is not None and rejected.grad is not None
    assert chosen.grad.item() == pytest.approx(-0.5 + 2 * coef * 1.4, abs=1e-12)
    assert rejected.grad.item() == pytest.approx(0.5 + 2 * coef * 1.4, abs=1e-12)
    # without centering the two gradients cancel: a sequence scored as both sides gets no update
    shared = t(0.7).requires_grad_()
    bradley_terry_loss(shared, shared)[0].sum().backward()
    assert shared.grad is not None and shared.grad.item() == 0.0


def test_gradient_matches_the_formula() -> None:
    chosen, rejected = t(0.3, -1.0).requires_grad_(), t(1.0, -2.5).requires_grad_()
    bradley_terry_loss(chosen, rejected, margin=t(0.2, 0.0))[0].sum().backward()
    d = [0.3 - 1.0 - 0.2, -1.0 + 2.5]
    sig = [1 / (1 + math.exp(x)) for x in d]  # sigmoid(-d): d/dr_c of -log sigmoid(d) is -sigmoid(-d)
    assert chosen.grad is not None and rejected.grad is not None
    assert chosen.grad.tolist() == pytest.approx([-s for s in sig], abs=1e-12)
    assert rejected.grad.tolist() == pytest.approx(sig, abs=1e-12)


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="center_rewards_coefficient must be >= 0"):
        bradley_terry_loss(t(1.0), t(0.0), center_coef=-0.1)
    with pytest.raises(ValueError, match="must both be"):
        bradley_terry_loss(t(1.0, 2.0), t(0.0))
