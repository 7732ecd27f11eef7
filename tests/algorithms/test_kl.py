import math

import pytest
import torch

from posttrain.algorithms.kl import kl_penalty
from posttrain.errors import ConfigError

LOG_PROB = torch.tensor([[-1.0, -2.0]])
REF_LOG_PROB = torch.tensor([[-1.5, -1.0]])
# log pi - log pi_ref = [0.5, -1.0]; log r = ref - lp = [-0.5, 1.0]


@pytest.mark.parametrize(
    ("kinds", "expected"),
    [
        (("k1", "kl"), [0.5, -1.0]),
        (("abs",), [0.5, 1.0]),
        (("k2", "mse"), [0.125, 0.5]),
        # r - log r - 1 = e^-0.5 + 0.5 - 1, e^1 - 1 - 1
        (("k3", "low_var_kl"), [math.exp(-0.5) - 0.5, math.e - 2.0]),
    ],
)
def test_estimators_hand_computed(kinds, expected):
    for kind in kinds:
        out = kl_penalty(LOG_PROB, REF_LOG_PROB, kind)
        torch.testing.assert_close(out, torch.tensor([expected]))


def test_k3_values_written_out():
    out = kl_penalty(LOG_PROB, REF_LOG_PROB, "k3")
    assert out[0].tolist() == pytest.approx([0.10653066, 0.71828183], abs=1e-6)


def test_k3_is_clamped_and_finite():
    log_prob = torch.tensor([[0.0, -30.0, 0.0]])
    ref = torch.tensor([[-30.0, 0.0, 0.0]])
    out = kl_penalty(log_prob, ref, "k3")
    # log r = -30 -> clamped to -20: e^-20 + 20 - 1 ~ 19 -> clamped to 10; log r = 30 -> e^20 ... -> 10
    assert out[0].tolist() == pytest.approx([10.0, 10.0, 0.0])
    assert torch.isfinite(out).all()


def test_unknown_kind_lists_valid():
    with pytest.raises(
        ConfigError,
        match=r"unknown KL estimator 'k4'; valid: abs, abs\+, k1, k1\+, k2, k2\+, k3, k3\+, kl, kl\+, "
        r"low_var_kl, low_var_kl\+, mse, mse\+",
    ):
        kl_penalty(LOG_PROB, REF_LOG_PROB, "k4")


@pytest.mark.parametrize(
    ("kinds", "expected_value"),
    [
        (("k1+", "kl+"), [0.5, -1.0]),
        (("abs+",), [0.5, 1.0]),
        (("k2+", "mse+"), [0.125, 0.5]),  # k2 itself: 0.5 * [0.5, -1.0]^2
        (("k3+", "low_var_kl+"), [0.10653066, 0.71828183]),
    ],
)
def test_straight_through_variants_have_the_value_of_the_estimator_and_the_gradient_of_k2(
    kinds, expected_value
):
    for kind in kinds:
        log_prob = LOG_PROB.clone().requires_grad_(True)
        out = kl_penalty(log_prob, REF_LOG_PROB, kind)
        assert out[0].tolist() == pytest.approx(expected_value, abs=1e-6)
        out.sum().backward()
        # d k2 / d log pi = log pi - log pi_ref = [0.5, -1.0]
        assert log_prob.grad[0].tolist() == pytest.approx([0.5, -1.0])


def test_k3_plus_gradient_differs_from_k3():
    log_prob = LOG_PROB.clone().requires_grad_(True)
    kl_penalty(log_prob, REF_LOG_PROB, "k3").sum().backward()
    # d k3 / d log pi = 1 - r: [1 - e^-0.5, 1 - e]
    assert log_prob.grad[0].tolist() == pytest.approx([0.39346934, -1.71828183], abs=1e-6)
