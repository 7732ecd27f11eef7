import pytest
import torch

from posttrain.algorithms.kl_control import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    make_kl_controller,
)
from posttrain.errors import ConfigError, PosttrainError


def test_fixed_controller_never_moves():
    ctrl = make_kl_controller("fixed", coef=0.05)
    assert isinstance(ctrl, FixedKLController)
    ctrl.update(current_kl=10.0, n_steps=1000)
    assert ctrl.value == 0.05
    restored = FixedKLController(0.05)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == 0.05


def test_on_resume_a_changed_config_wins_over_the_checkpoints_coefficient():
    # a fixed coefficient never moved: a different one in the checkpoint means the config changed it, or the
    # run was adaptive before; either way the configured value is the one asked for now
    changed = FixedKLController(0.2)
    changed.load_state_dict(FixedKLController(0.05).state_dict())
    assert changed.value == 0.2
    drifted = AdaptiveKLController(0.1, target_kl=1.0, horizon=10)
    drifted.update(1.5, n_steps=1)
    switched = FixedKLController(0.01)
    switched.load_state_dict(drifted.state_dict())
    assert switched.value == 0.01
    adaptive = AdaptiveKLController(0.3, target_kl=1.0, horizon=10)  # switched from fixed to adaptive
    adaptive.load_state_dict(FixedKLController(0.05).state_dict())
    assert adaptive.value == 0.3
    adaptive.load_state_dict({"value": 0.4})  # a checkpoint from before `kind` was saved: adaptive's own
    assert adaptive.value == 0.4


def test_adaptive_controller_trajectory():
    ctrl = make_kl_controller("adaptive", coef=0.1, target_kl=1.0, horizon=10)
    assert isinstance(ctrl, AdaptiveKLController)
    # KL 1.5: error 0.5 clipped to 0.2; coef *= 1 + 0.2 * 1 / 10 = 1.02
    ctrl.update(1.5, n_steps=1)
    assert ctrl.value == pytest.approx(0.102)
    # KL 1.1: error 0.1; coef *= 1 + 0.1 * 2 / 10 = 1.02
    ctrl.update(1.1, n_steps=2)
    assert ctrl.value == pytest.approx(0.10404)
    # KL 0.5: error -0.5 clipped to -0.2; coef *= 1 - 0.2 * 5 / 10 = 0.9
    ctrl.update(0.5, n_steps=5)
    assert ctrl.value == pytest.approx(0.093636)
    # on target: unchanged
    ctrl.update(1.0, n_steps=10)
    assert ctrl.value == pytest.approx(0.093636)


def test_adaptive_state_round_trip():
    ctrl = AdaptiveKLController(0.1, target_kl=1.0, horizon=10)
    ctrl.update(1.5, n_steps=1)
    restored = AdaptiveKLController(0.1, target_kl=1.0, horizon=10)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == pytest.approx(0.102)
    with pytest.raises(ConfigError, match="no 'value' key"):
        restored.load_state_dict({})


def test_adaptive_rejects_non_finite_kl():
    with pytest.raises(PosttrainError, match="non-finite KL"):
        AdaptiveKLController(0.1, target_kl=1.0, horizon=10).update(float("nan"), n_steps=1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "adaptive", "coef": 0.1, "target_kl": 0.0, "horizon": 10}, "target_kl must be > 0"),
        ({"kind": "adaptive", "coef": 0.1, "target_kl": 0.1, "horizon": 0}, "horizon must be > 0"),
        ({"kind": "adaptive", "coef": 0.1}, "needs target_kl and horizon"),
        ({"kind": "fixed", "coef": -0.1}, "kl coef must be a finite number >= 0"),
        ({"kind": "pid", "coef": 0.1}, r"unknown KL controller kind 'pid'; valid: fixed, adaptive"),
    ],
)
def test_make_kl_controller_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        make_kl_controller(**kwargs)


def test_apply_kl_penalty_hand_computed():
    scores = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    old = torch.tensor([[-1.0, -2.0, -1.0, 0.0], [-1.0, -1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, -1.0, 3.0], [-2.0, -1.5, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    rewards, metrics = apply_kl_penalty(scores, old, ref, mask, kl_coef=0.1, kind="kl")
    # k1 = old - ref: row 0 [0.5, -1, 0], row 1 [1, 0.5]; padding and the empty row 2 get no penalty
    expected = torch.tensor([[-0.05, 0.1, 1.0, 0.0], [-0.1, 0.45, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(rewards, expected)
    # sequence KL: row 0 -0.5, row 1 1.5 -> mean over the 2 non-empty rows 0.5
    assert metrics["kl_in_reward"] == pytest.approx(0.5)
    # token means: -0.5 / 3 and 1.5 / 2 -> mean 0.2916667
    assert metrics["kl_in_reward_token_mean"] == pytest.approx(0.29166667)
    assert metrics["kl_coef"] == pytest.approx(0.1)


def test_apply_kl_penalty_carries_no_gradient_and_checks_the_kind():
    old = torch.zeros(1, 2, requires_grad=True)
    rewards, _ = apply_kl_penalty(torch.ones(1, 2), old, torch.zeros(1, 2), torch.ones(1, 2), 0.1, "k3")
    assert not rewards.requires_grad
    with pytest.raises(ConfigError, match="unknown KL estimator 'k9'"):
        apply_kl_penalty(torch.ones(1, 2), old, torch.zeros(1, 2), torch.ones(1, 2), 0.1, "k9")
