import math

import pytest
import torch

from posttrain.algorithms.policy_loss import compute_policy_loss
from posttrain.algorithms.policy_loss_variants import (
    cispo_loss,
    dro_loss,
    geo_mean_loss,
    gpg_loss,
    gspo_loss,
    sapo_loss,
)
from posttrain.algorithms.registry import get_policy_loss
from posttrain.errors import ConfigError

# --- GSPO ----------------------------------------------------------------------------------------------
# Two rows of three valid tokens and one padding token (log-prob 7.0, which must not enter the mean).
# old log-probs are 0, so the token log-ratios are the log-probs.
#   row 0: mean log-ratio (0.0003 - 0.0003 + 0.0003) / 3 = 1e-4 -> s = e^1e-4 = 1.000100005, inside
#          [1 - 3e-4, 1 + 4e-4]: unclipped.
#   row 1: mean log-ratio 0.3 / 3 = 0.1 -> s = e^0.1 = 1.105170918 > 1.0004 with A > 0: clipped.
GSPO_LOG_PROB = [[0.0003, -0.0003, 0.0003, 7.0], [0.3, 0.0, 0.0, 7.0]]
GSPO_ADV = torch.tensor([[1.0, -2.0, 0.5, 1.0], [1.0, 1.0, 1.0, 1.0]])
GSPO_MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]])


def test_gspo_hand_computed():
    log_prob = torch.tensor(GSPO_LOG_PROB, requires_grad=True)
    loss, metrics = compute_policy_loss(gspo_loss, log_prob, torch.zeros(2, 4), GSPO_ADV, GSPO_MASK)
    # row 0: -A * s = [-s, 2s, -0.5s], sum 0.5 * 1.000100005 = 0.500050003
    # row 1: -A * 1.0004 for three tokens, sum -3.0012
    # token-mean over 6: (0.500050003 - 3.0012) / 6
    assert loss.item() == pytest.approx(-0.416858333, rel=1e-5)
    assert metrics["pg_clipfrac"] == pytest.approx(3 / 6)
    assert metrics["ratio_mean"] == pytest.approx((1.000100005 + 1.105170918) / 2, rel=1e-6)
    assert metrics["ratio_max"] == pytest.approx(1.105170918, rel=1e-6)
    assert metrics["ppo_kl"] == pytest.approx(-0.3003 / 6, rel=1e-4)


def test_gspo_per_token_gradient_is_straight_through():
    log_prob = torch.tensor(GSPO_LOG_PROB, requires_grad=True)
    loss, _ = compute_policy_loss(gspo_loss, log_prob, torch.zeros(2, 4), GSPO_ADV, GSPO_MASK)
    loss.backward()
    # d(-A_t * sg[s] * pi_t / sg[pi_t]) / d log pi_t = -A_t * s: each token only sees its own advantage
    # (1.000100005 / 6 = 0.166683334). Row 1 is clipped: no gradient. Padding: no gradient.
    expected = torch.tensor(
        [[-0.166683334, 0.333366668, -0.083341667, 0.0], [0.0, 0.0, 0.0, 0.0]],
    )
    torch.testing.assert_close(log_prob.grad, expected, rtol=1e-5, atol=1e-7)


def test_gspo_defaults_and_registry():
    assert get_policy_loss("gspo") is gspo_loss
    with pytest.raises(ConfigError, match="gspo"):
        gspo_loss(
            torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), clip_ratio_low=1.0
        )


# --- SAPO ----------------------------------------------------------------------------------------------


def test_sapo_hand_computed():
    # t0: A=+1, r=1, tau_pos=1: gate = sigmoid(0) * 4 / 1 = 2           -> loss -2
    # t1: A=-1, r=1, tau_neg=1.05: gate = 0.5 * 4 / 1.05 = 1.9047619     -> loss +1.9047619
    # t2: A=+2, r=1+ln 3, tau_pos=1: sigmoid(ln 3) = 3/4, gate = 3      -> loss -6
    ratios = [1.0, 1.0, 1.0 + math.log(3.0)]
    log_prob = torch.tensor([[math.log(r) for r in ratios]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    loss, metrics = compute_policy_loss(sapo_loss, log_prob, torch.zeros(1, 3), adv, torch.ones(1, 3))
    assert loss.item() == pytest.approx((-2.0 + 1.9047619 - 6.0) / 3, rel=1e-6)
    assert metrics["pg_clipfrac"] == 0.0
    loss.backward()
    # d gate / d log pi = 4 * sigmoid * (1 - sigmoid) * r: 1 at r = 1 (the plain policy gradient -A),
    # and 4 * 3/4 * 1/4 * (1 + ln 3) = 1.5739592 for t2, times -A = -2; all over 3 tokens.
    expected = [-1.0 / 3, 1.0 / 3, -3.1479184 / 3]
    assert log_prob.grad[0].tolist() == pytest.approx(expected, rel=1e-5)


def test_sapo_rejects_non_positive_temperature():
    with pytest.raises(ConfigError, match="tau_pos and tau_neg must be > 0"):
        sapo_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), tau_neg=0.0)


# --- CISPO ---------------------------------------------------------------------------------------------
# ratios 0.5, 2, 6 (old log-probs 0); A = +1, -1, +1.
CISPO_RATIOS = [0.5, 2.0, 6.0]
CISPO_ADV = torch.tensor([[1.0, -1.0, 1.0]])


def _cispo_log_prob():
    return torch.tensor([[math.log(r) for r in CISPO_RATIOS]], requires_grad=True)


def test_cispo_default_bounds_hand_computed():
    # defaults: no lower bound, upper bound 1 + 3 = 4 -> w = [0.5, 2, 4]
    # L = -w * A * log pi: [-0.5 * ln 0.5, 2 * ln 2, -4 * ln 6] = [0.3465736, 1.3862944, -7.1670379]
    log_prob = _cispo_log_prob()
    loss, metrics = compute_policy_loss(cispo_loss, log_prob, torch.zeros(1, 3), CISPO_ADV, torch.ones(1, 3))
    assert loss.item() == pytest.approx((0.3465736 + 1.3862944 - 7.1670379) / 3, rel=1e-6)
    assert metrics["pg_clipfrac"] == pytest.approx(1 / 3)
    loss.backward()
    # gradient -w * A / 3 with w a constant: the clipped token t2 keeps its gradient (PPO would zero it)
    assert log_prob.grad[0].tolist() == pytest.approx([-0.5 / 3, 2.0 / 3, -4.0 / 3], rel=1e-6)


def test_cispo_explicit_bounds():
    log_prob = _cispo_log_prob()
    loss, metrics = compute_policy_loss(
        cispo_loss,
        log_prob,
        torch.zeros(1, 3),
        CISPO_ADV,
        torch.ones(1, 3),
        options={"clip_ratio_low": 0.2, "clip_ratio_high": 0.28},
    )
    loss.backward()
    # w = clip([0.5, 2, 6], 0.8, 1.28) = [0.8, 1.28, 1.28]; all three clipped
    assert log_prob.grad[0].tolist() == pytest.approx([-0.8 / 3, 1.28 / 3, -1.28 / 3], rel=1e-6)
    assert metrics["pg_clipfrac"] == pytest.approx(1.0)


# --- DRO -----------------------------------------------------------------------------------------------


def test_dro_hand_computed():
    log_prob = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -1.0]])
    adv = torch.tensor([[1.0, -2.0]])
    loss, metrics = compute_policy_loss(dro_loss, log_prob, old, adv, torch.ones(1, 2), options={"beta": 0.1})
    # t0: -(-1 * 1 - 0.05 * 0.5^2) = 1.0125;   t1: -(-2 * -2 - 0.05 * 1^2) = -3.95
    assert loss.item() == pytest.approx((1.0125 - 3.95) / 2)
    assert metrics["pg_clipfrac"] == 0.0
    assert metrics["ratio_mean"] == pytest.approx((1.6487213 + 0.3678794) / 2, rel=1e-6)
    assert metrics["ratio_max"] == pytest.approx(1.6487213, rel=1e-6)
    loss.backward()
    # dL/d log pi = -A + beta * (log pi - log pi_old): [-1 + 0.05, 2 - 0.1], over 2 tokens
    assert log_prob.grad[0].tolist() == pytest.approx([-0.475, 0.95])


def test_dro_rejects_non_positive_beta():
    with pytest.raises(ConfigError, match="dro: beta must be > 0"):
        dro_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), beta=0.0)


# --- GPG -----------------------------------------------------------------------------------------------


def test_gpg_hand_computed():
    log_prob = torch.tensor([[-1.0, -2.0, 5.0]], requires_grad=True)
    adv = torch.tensor([[1.0, -2.0, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # old log-probs do not enter the loss: -A * log pi = [1, -4], mean -1.5
    for old in (torch.zeros(1, 3), torch.full((1, 3), -4.0)):
        loss, metrics = compute_policy_loss(gpg_loss, log_prob, old, adv, mask)
        assert loss.item() == pytest.approx(-1.5)
        assert metrics["pg_clipfrac"] == 0.0
    loss.backward()
    assert log_prob.grad[0].tolist() == pytest.approx([-0.5, 1.0, 0.0])


# --- GMPO (geo_mean) -------------------------------------------------------------------------------------
# old log-probs 0. Row 0, A = +1: log-ratios [0.2, 0.6] -> clipped above at 0.4: [0.2, 0.4], mean 0.3.
# Row 1, A = -1: log-ratios [-0.6, 0.1] -> clipped below at -0.4: [-0.4, 0.1], mean -0.15. Third column padding.
GMPO_LOG_PROB = [[0.2, 0.6, 5.0], [-0.6, 0.1, 5.0]]
GMPO_ADV = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
GMPO_MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])


def test_geo_mean_hand_computed():
    log_prob = torch.tensor(GMPO_LOG_PROB, requires_grad=True)
    loss, metrics = compute_policy_loss(
        geo_mean_loss, log_prob, torch.zeros(2, 3), GMPO_ADV, GMPO_MASK, loss_agg_mode="seq-mean-token-mean"
    )
    # L_0 = -1 * e^0.3 = -1.3498588, L_1 = +e^-0.15 = 0.8607080; mean over the two sequences
    assert loss.item() == pytest.approx((-1.3498588 + 0.8607080) / 2, abs=1e-6)
    assert metrics["pg_clipfrac"] == pytest.approx(1 / 4)  # row 0's second token (A > 0)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(1 / 4)  # row 1's first token (A < 0)
    loss.backward()
    # d(-e^mean) / d l_t = -e^0.3 / 2 per unclipped token, then / 2 sequences; clipped tokens get none
    # row 1: d(e^mean) / d l_t = e^-0.15 / 2, / 2
    expected = torch.tensor([[-1.3498588 / 4, 0.0, 0.0], [0.0, 0.8607080 / 4, 0.0]])
    torch.testing.assert_close(log_prob.grad, expected, rtol=1e-5, atol=1e-7)


def test_geo_mean_takes_the_sequence_mean_of_the_advantage_and_honours_the_mode():
    log_prob = torch.zeros(1, 2)
    adv = torch.tensor([[2.0, 0.0]])
    per_token, metrics = geo_mean_loss(log_prob, torch.zeros(1, 2), adv, torch.ones(1, 2))
    # on-policy: ratio 1; A_i = mean(2, 0) = 1 on both tokens
    torch.testing.assert_close(per_token, torch.tensor([[-1.0, -1.0]]))
    assert metrics["ratio_mean"] == pytest.approx(1.0)
    total, _ = compute_policy_loss(
        geo_mean_loss, log_prob, torch.zeros(1, 2), adv, torch.ones(1, 2), loss_agg_mode="token-sum"
    )
    assert total.item() == pytest.approx(-2.0)
    with pytest.raises(ConfigError, match="geo_mean"):
        geo_mean_loss(log_prob, torch.zeros(1, 2), adv, torch.ones(1, 2), clip_ratio_low=-0.1)
