import math

import pytest
import torch

from posttrain.algorithms.policy_loss import compute_policy_loss
from posttrain.algorithms.policy_loss_cov import clip_cov_loss, kl_cov_loss
from posttrain.errors import ConfigError

# --- Clip-Cov ------------------------------------------------------------------------------------------
# Four valid tokens and one padding token. A = [2, 2, -2, -2] (mean 0); log pi = [-0.5, -3.5, -3.5, -0.5]
# (mean -2), centred [1.5, -1.5, -1.5, 1.5]: covariance [3, -3, 3, -3]. Tokens 0 and 2 lie in (1, 5).
# The padding token (A = 2, log pi = -0.5) would have covariance 3 too, but must never be picked.
ADV = torch.tensor([[2.0, 2.0, -2.0, -2.0, 2.0]])
LOG_PROB = [[-0.5, -3.5, -3.5, -0.5, -0.5]]
MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])


def _log_prob():
    return torch.tensor(LOG_PROB, requires_grad=True)


def _old(ratios=(1.0, 1.0, 1.0, 1.0, 1.0)):
    # old log-probs giving these ratios, leaving log pi (and so the covariance) unchanged
    return torch.tensor([[lp - math.log(r) for lp, r in zip(LOG_PROB[0], ratios, strict=True)]])


def test_clip_cov_removes_gradient_of_picked_tokens():
    log_prob = _log_prob()
    # clip_cov_ratio 0.5: floor(0.5 * 4) = 2 tokens to pick, exactly the two candidates
    loss, metrics = compute_policy_loss(
        clip_cov_loss, log_prob, _old(), ADV, MASK, options={"clip_cov_ratio": 0.5}
    )
    # ratio 1: losses -A = [-2, -2, 2, 2]; tokens 0 and 2 zeroed -> [0, -2, 0, 2], mean 0
    assert loss.item() == pytest.approx(0.0)
    assert metrics["clip_cov_frac"] == pytest.approx(0.5)
    assert metrics["pg_clipfrac"] == 0.0
    loss.backward()
    torch.testing.assert_close(log_prob.grad, torch.tensor([[0.0, -0.5, 0.0, 0.5, 0.0]]))


def test_clip_cov_skips_ppo_clipped_tokens():
    log_prob = _log_prob()
    # token 0 gets ratio 1.5 with A > 0: PPO clips it, so only token 2 is a candidate
    loss, metrics = compute_policy_loss(
        clip_cov_loss, log_prob, _old((1.5, 1, 1, 1, 1)), ADV, MASK, options={"clip_cov_ratio": 0.5}
    )
    # losses: max(-3, -2.4) = -2.4 (clipped), -2, 0 (removed), 2 -> sum -2.4, mean -0.6
    assert loss.item() == pytest.approx(-0.6)
    assert metrics["pg_clipfrac"] == pytest.approx(1 / 4)
    assert metrics["clip_cov_frac"] == pytest.approx(1 / 4)


def test_clip_cov_bounds_are_strict():
    # upper bound 3 excludes covariance 3: nothing removed, plain PPO losses [-2.4, -2, 2, 2] -> mean -0.1
    loss, metrics = compute_policy_loss(
        clip_cov_loss,
        _log_prob(),
        _old((1.5, 1, 1, 1, 1)),
        ADV,
        MASK,
        options={"clip_cov_ratio": 0.5, "clip_cov_ub": 3.0},
    )
    assert loss.item() == pytest.approx(-0.1)
    assert metrics["clip_cov_frac"] == 0.0


def test_clip_cov_random_pick_is_reproducible_with_a_generator():
    picks = set()
    for seed in range(20):
        grads = []
        for _ in range(2):
            log_prob = _log_prob()
            # default ratio 2e-4: max(floor(2e-4 * 4), 1) = 1 token, drawn among tokens 0 and 2
            loss, metrics = compute_policy_loss(
                clip_cov_loss,
                log_prob,
                _old(),
                ADV,
                MASK,
                options={"generator": torch.Generator().manual_seed(seed)},
            )
            assert metrics["clip_cov_frac"] == pytest.approx(1 / 4)
            loss.backward()
            grads.append(log_prob.grad.clone())
        torch.testing.assert_close(grads[0], grads[1])
        zeroed = {i for i in range(4) if grads[0][0, i] == 0.0}
        assert len(zeroed) == 1
        picks |= zeroed
    assert picks == {0, 2}  # both candidates get drawn, the padding never


def test_clip_cov_config_errors():
    with pytest.raises(ConfigError, match="clip_cov_ratio must be > 0"):
        clip_cov_loss(_log_prob(), _old(), ADV, MASK, clip_cov_ratio=0.0)
    with pytest.raises(ConfigError, match="clip_cov_lb < clip_cov_ub"):
        clip_cov_loss(_log_prob(), _old(), ADV, MASK, clip_cov_lb=5.0, clip_cov_ub=1.0)


# --- KL-Cov --------------------------------------------------------------------------------------------
# A = [2, 2, -2, -2]; log pi = [-0.5, -3.5, -3.0, -1.0] (mean -2), centred [1.5, -1.5, -1, 1]:
# covariance [3, -3, 2, -2]. Log-ratios [0.2, 0, 0.1, 0].
KL_ADV = torch.tensor([[2.0, 2.0, -2.0, -2.0]])
KL_LOG_PROB = [[-0.5, -3.5, -3.0, -1.0]]
KL_OLD = torch.tensor([[-0.7, -3.5, -3.1, -1.0]])


def test_kl_cov_penalises_the_top_covariance_token():
    log_prob = torch.tensor(KL_LOG_PROB, requires_grad=True)
    loss, metrics = compute_policy_loss(
        kl_cov_loss, log_prob, KL_OLD, KL_ADV, torch.ones(1, 4), options={"kl_cov_ratio": 0.25}
    )
    # one token (floor(0.25 * 4)): token 0. Losses -A * r: [-2 e^0.2, -2, 2 e^0.1, 2], plus
    # ppo_kl_coef * |0.2| = 0.1 * 0.2 on t0 (verl's configured default coefficient 0.1):
    # [-2.4228055, -2, 2.2103418, 2] -> mean -0.0531159
    assert loss.item() == pytest.approx(-0.0531159, abs=1e-6)
    assert metrics["kl_cov_frac"] == pytest.approx(0.25)
    assert metrics["ppo_kl_abs"] == pytest.approx(0.075)
    assert metrics["ppo_kl"] == pytest.approx(-0.075)
    assert metrics["pg_clipfrac"] == 0.0
    loss.backward()
    # -A * r (+ 0.1 * sign(log r) on t0), over 4: [(-2.4428055 + 0.1) / 4, -0.5, 2.2103418 / 4, 0.5]
    expected = [-0.5857014, -0.5, 0.5525855, 0.5]
    assert log_prob.grad[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_kl_cov_ratio_sets_how_many_tokens():
    log_prob = torch.tensor(KL_LOG_PROB)
    # floor(0.5 * 4) = 2 tokens: t0 and t2 (covariance 3 and 2); t2 adds |0.1| (coefficient 1 here):
    # [-2.4428055 + 0.2, -2, 2.2103418 + 0.1, 2] -> mean 0.0168841
    loss, metrics = compute_policy_loss(
        kl_cov_loss,
        log_prob,
        KL_OLD,
        KL_ADV,
        torch.ones(1, 4),
        options={"kl_cov_ratio": 0.5, "ppo_kl_coef": 1.0},
    )
    assert loss.item() == pytest.approx(0.0168841, abs=1e-6)
    assert metrics["kl_cov_frac"] == pytest.approx(0.5)
    # the default ratio 2e-4 still penalises at least one token
    default, _ = compute_policy_loss(kl_cov_loss, log_prob, KL_OLD, KL_ADV, torch.ones(1, 4))
    assert default.item() == pytest.approx(-0.0531159, abs=1e-6)


def test_kl_cov_config_errors():
    log_prob = torch.tensor(KL_LOG_PROB)
    with pytest.raises(ConfigError, match="kl_cov_ratio must be in"):
        kl_cov_loss(log_prob, KL_OLD, KL_ADV, torch.ones(1, 4), kl_cov_ratio=0.0)
    with pytest.raises(ConfigError, match="ppo_kl_coef must be >= 0"):
        kl_cov_loss(log_prob, KL_OLD, KL_ADV, torch.ones(1, 4), ppo_kl_coef=-1.0)
