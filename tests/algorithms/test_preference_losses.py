"""Preference losses against hand computations (plain `math`), edge cases, combination and option checks.

TRL is not an oracle here: TRL 1.16 computes its DPO losses inside `DPOTrainer._compute_loss` from a model's
outputs (no standalone `dpo_loss` on log-prob tensors any more), and its `sigmoid` no longer takes label
smoothing. The formulas below were checked against that source: sigmoid (eps 0), hinge, ipo (per-token mean),
robust, apo_zero and sft (token-mean NLL of the chosen) are the same expressions."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algorithms.preference_losses import (
    PREFERENCE_LOSSES,
    PairLogps,
    PreferenceOptions,
    check_preference,
    needs_reference,
    preference_loss,
)
from posttrain.errors import ConfigError

BETA = 0.1


def t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# one pair: log pi(y_w) = -2, log pi(y_l) = -3 over 2 and 4 tokens; the reference gives -2.5 to both
PAIR = PairLogps(t(-2.0), t(-3.0), t(2.0), t(4.0), t(-2.5), t(-2.5))
H = (-2.0 + 2.5) - (-3.0 + 2.5)  # 1.0


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def value(name: str, pair: PairLogps = PAIR, **options: float) -> float:
    losses, _ = preference_loss(pair, [name], [], PreferenceOptions(**({"beta": BETA} | options)))
    return float(losses.mean())


def test_sigmoid_and_label_smoothing() -> None:
    assert value("sigmoid") == pytest.approx(-log_sigmoid(BETA * H), rel=1e-12)
    eps = 0.2
    expected = -(1 - eps) * log_sigmoid(BETA * H) - eps * log_sigmoid(-BETA * H)
    assert value("sigmoid", label_smoothing=eps) == pytest.approx(expected, rel=1e-12)


def test_robust() -> None:
    eps = 0.2
    expected = (-(1 - eps) * log_sigmoid(BETA * H) + eps * log_sigmoid(-BETA * H)) / (1 - 2 * eps)
    assert value("robust", label_smoothing=eps) == pytest.approx(expected, rel=1e-12)
    assert value("robust") == pytest.approx(value("sigmoid"), rel=1e-12)  # eps = 0: plain DPO


def test_hinge() -> None:
    assert value("hinge") == pytest.approx(1 - BETA * H, rel=1e-12)
    assert value("hinge", beta=2.0) == 0.0  # margin beyond 1/beta: no loss


def test_ipo_on_mean_token_log_probs() -> None:
    h = (-2.0 + 2.5) / 2 - (-3.0 + 2.5) / 4  # 0.375
    assert value("ipo") == pytest.approx((h - 1 / (2 * BETA)) ** 2, rel=1e-12)


def test_apo_zero() -> None:
    expected = (1 - sigmoid(BETA * 0.5)) + sigmoid(BETA * -0.5)
    assert value("apo_zero") == pytest.approx(expected, rel=1e-12)


def test_sft_is_token_mean_nll_of_chosen() -> None:
    pairs = PairLogps(t(-2.0, -6.0), t(-3.0, -1.0), t(2.0, 4.0), t(4.0, 1.0))
    assert value("sft", pairs) == pytest.approx((2.0 + 6.0) / (2 + 4), rel=1e-12)


def test_simpo() -> None:
    gamma = 0.5
    h = BETA * (-2.0 / 2 - -3.0 / 4) - gamma
    assert value("simpo", simpo_gamma=gamma) == pytest.approx(-log_sigmoid(h), rel=1e-12)


def test_orpo() -> None:
    mc, mr = -2.0 / 2, -3.0 / 4
    log_odds = (mc - mr) - (math.log(1 - math.exp(mc)) - math.log(1 - math.exp(mr)))
    nll = 2.0 / 2
    assert value("orpo") == pytest.approx(nll - BETA * log_sigmoid(log_odds), rel=1e-12)


def test_identical_chosen_and_rejected() -> None:
    """No preference signal: DPO gives log 2, IPO (1/(2 beta))^2, hinge 1, simpo -log sigma(-gamma), orpo the
    NLL + lambda log 2; accuracy 0 (a tie is not a win), margin 0; the loss's gradients on chosen and rejected
    cancel, so the same tokens on both sides get no update."""
    same = PairLogps(t(-2.0), t(-2.0), t(2.0), t(2.0), t(-2.5), t(-2.5))
    assert value("sigmoid", same) == pytest.approx(math.log(2))
    assert value("robust", same, label_smoothing=0.3) == pytest.approx(math.log(2))
    assert value("ipo", same) == pytest.approx((1 / (2 * BETA)) ** 2)
    assert value("hinge", same) == pytest.approx(1.0)
    assert value("simpo", same) == pytest.approx(-log_sigmoid(-0.5))
    assert value("orpo", same) == pytest.approx(1.0 + BETA * math.log(2))
    chosen, rejected = t(-2.0).requires_grad_(), t(-2.0).requires_grad_()
    for name in ("sigmoid", "ipo", "hinge", "robust", "simpo"):
        pair = PairLogps(chosen, rejected, t(2.0), t(2.0), t(-2.5), t(-2.5))
        losses, metrics = preference_loss(pair, [name], [], PreferenceOptions(beta=BETA))
        grad_c, grad_r = torch.autograd.grad(losses.sum(), [chosen, rejected])
        assert float(grad_c + grad_r) == pytest.approx(0.0, abs=1e-12), name
        assert float(metrics["rewards_accuracy"]) == 0.0
        assert float(metrics["rewards_margin"]) == 0.0


def test_empty_completions_do_not_divide_by_zero() -> None:
    empty = PairLogps(t(0.0), t(0.0), t(0.0), t(0.0), t(0.0), t(0.0))
    for name in PREFERENCE_LOSSES.names():
        assert math.isfinite(value(name, empty)), name


def test_combined_losses_are_weighted_sums_with_metrics() -> None:
    losses, metrics = preference_loss(PAIR, ["sigmoid", "sft"], [1.0, 0.5], PreferenceOptions(beta=BETA))
    assert float(losses) == pytest.approx(value("sigmoid") + 0.5 * value("sft"))
    assert float(metrics["rewards_chosen"]) == pytest.approx(BETA * 0.5)
    assert float(metrics["rewards_rejected"]) == pytest.approx(BETA * -0.5)
    assert float(metrics["rewards_margin"]) == pytest.approx(BETA * H)
    assert float(metrics["rewards_accuracy"]) == 1.0


def test_reference_free_losses_report_length_normalised_rewards() -> None:
    free = PairLogps(t(-2.0), t(-3.0), t(2.0), t(4.0))
    _, metrics = preference_loss(free, ["simpo"], [], PreferenceOptions(beta=2.0))
    assert float(metrics["rewards_chosen"]) == pytest.approx(2.0 * -1.0)
    with pytest.raises(ConfigError, match="needs reference log-probs"):
        preference_loss(free, ["sigmoid"], [], PreferenceOptions())
    assert not needs_reference(["simpo", "orpo", "sft"]) and needs_reference(["simpo", "ipo"])


@pytest.mark.parametrize(
    ("types", "weights", "options", "message"),
    [
        (
            ["dpo"],
            [],
            {},
            r"unknown preference loss 'dpo'; valid: apo_zero, hinge, ipo, orpo, robust, sft, sigmoid, simpo",
        ),
        ([], [], {}, r"dpo.loss_type is empty"),
        (["sigmoid", "sft"], [1.0], {}, r"dpo.loss_weights has 1 values for 2 losses"),
        (["sigmoid"], [], {"beta": 0.0}, r"dpo.beta must be > 0"),
        (["sigmoid"], [], {"label_smoothing": 0.5}, r"label_smoothing must be in \[0, 0.5\)"),
        (["hinge"], [], {"label_smoothing": 0.1}, r"applies to the sigmoid, robust and simpo losses only"),
    ],
)
def test_options_that_cannot_work_are_rejected(types, weights, options, message) -> None:
    with pytest.raises(ConfigError, match=message):
        check_preference(types, weights, PreferenceOptions(**options))
