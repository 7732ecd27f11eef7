"""GKD's generalised JSD and the on-policy reverse-KL advantages against hand computations."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algorithms.distillation import generalized_jsd, reverse_kl_advantages

# student S = [1/2, 1/2], teacher P = [1/4, 3/4] (logits = log-probabilities)
S = torch.tensor([[0.5, 0.5]]).log()
P = torch.tensor([[0.25, 0.75]]).log()
FORWARD_KL = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)  # KL(P || S) = 0.130812
REVERSE_KL = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)  # KL(S || P) = 0.143841


def test_beta_zero_is_forward_kl_and_one_is_reverse_kl():
    assert generalized_jsd(S, P, beta=0.0).item() == pytest.approx(FORWARD_KL, abs=1e-6)
    assert generalized_jsd(S, P, beta=1.0).item() == pytest.approx(REVERSE_KL, abs=1e-6)
    assert FORWARD_KL == pytest.approx(0.130812, abs=1e-6) and REVERSE_KL == pytest.approx(0.143841, abs=1e-6)


def test_beta_half_by_hand():
    m = [0.375, 0.625]  # 0.5 * P + 0.5 * S
    kl_p_m = 0.25 * math.log(0.25 / m[0]) + 0.75 * math.log(0.75 / m[1])
    kl_s_m = 0.5 * math.log(0.5 / m[0]) + 0.5 * math.log(0.5 / m[1])
    expected = 0.5 * kl_p_m + 0.5 * kl_s_m
    assert expected == pytest.approx(0.033822, abs=1e-6)
    assert generalized_jsd(S, P, beta=0.5).item() == pytest.approx(expected, abs=1e-6)


def test_beta_weights_the_mixture_towards_the_teacher():
    beta = 0.9  # M = 0.9 P + 0.1 S
    m = [0.9 * 0.25 + 0.1 * 0.5, 0.9 * 0.75 + 0.1 * 0.5]
    kl_p_m = 0.25 * math.log(0.25 / m[0]) + 0.75 * math.log(0.75 / m[1])
    kl_s_m = 0.5 * math.log(0.5 / m[0]) + 0.5 * math.log(0.5 / m[1])
    got = generalized_jsd(S, P, beta=beta).item()
    assert got == pytest.approx(beta * kl_p_m + (1 - beta) * kl_s_m, abs=1e-6)


def test_end_points_are_the_limits_of_the_scaled_divergence():
    eps, s, p = 1e-5, S.double(), P.double()
    assert generalized_jsd(s, p, beta=eps).item() / eps == pytest.approx(FORWARD_KL, rel=1e-3)
    assert generalized_jsd(s, p, beta=1 - eps).item() / eps == pytest.approx(REVERSE_KL, rel=1e-3)


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_identical_distributions_give_zero(beta):
    logits = torch.randn(3, 5, 11, dtype=torch.float64)
    out = generalized_jsd(logits, logits.clone(), beta=beta)
    assert out.shape == (3, 5)
    assert torch.allclose(out, torch.zeros_like(out), atol=1e-12)


def test_temperature_and_logit_shift():
    # logits are defined up to a constant per position; T = 2 on logits 2z is T = 1 on z
    out = generalized_jsd(2 * S + 3.0, 2 * P - 1.0, beta=0.0, temperature=2.0)
    assert out.item() == pytest.approx(FORWARD_KL, abs=1e-6)


def test_gradient_reaches_the_student_and_is_zero_at_the_teacher():
    student = P.clone().requires_grad_(True)
    generalized_jsd(student, P, beta=0.5).sum().backward()
    assert torch.allclose(student.grad, torch.zeros_like(student.grad), atol=1e-7)
    student = S.clone().requires_grad_(True)
    generalized_jsd(student, P, beta=0.5).sum().backward()
    assert student.grad.abs().sum() > 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd(S, P, beta=1.5)
    with pytest.raises(ValueError, match="shape"):
        generalized_jsd(S, torch.zeros(1, 3))


def test_reverse_kl_advantages():
    student = torch.tensor([[-1.0, -2.0, -0.5]])
    teacher = torch.tensor([[-1.5, -1.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv, rkl = reverse_kl_advantages(student, teacher, mask, kl_coef=2.0)
    assert torch.allclose(rkl, torch.tensor([[0.5, -1.0, 0.0]]))
    assert torch.allclose(adv, torch.tensor([[-1.0, 2.0, 0.0]]))
