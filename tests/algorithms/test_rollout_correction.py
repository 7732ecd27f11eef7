import math
import re

import pytest
import torch

from posttrain.algorithms.rollout_correction import (
    RS_OPTIONS,
    RolloutCorrection,
    apply_rollout_correction,
    importance_weights,
    rejection_mask,
)
from posttrain.errors import ConfigError


def _log_ratio(rows):
    """log r from rows of ratios r = pi_old / pi_rollout (None = padding, stored as a wild ratio 100)."""
    return torch.tensor(
        [[math.log(r if r is not None else 100.0) for r in row] for row in rows], dtype=torch.float64
    )


def _mask(rows):
    return torch.tensor([[0.0 if r is None else 1.0 for r in row] for row in rows], dtype=torch.float64)


# --- importance weights --------------------------------------------------------------------------------


def test_sequence_weight_is_the_capped_product_of_the_token_ratios():
    rows = [[2.0, 1.5, None], [0.5, None, None]]
    weights, metrics = importance_weights(_log_ratio(rows), _mask(rows), "sequence", threshold=2.0)
    # row 0: 2 * 1.5 = 3 (the padding's 100 does not enter) -> capped at 2; row 1: 0.5
    torch.testing.assert_close(weights, torch.tensor([[2.0, 2.0, 0.0], [0.5, 0.0, 0.0]], dtype=torch.float64))
    assert metrics["rollout_is_mean"] == pytest.approx((2 + 2 + 0.5) / 3)
    assert metrics["rollout_is_max"] == pytest.approx(2.0)
    # counted per sequence: row 0's 3 > 2, nothing below 1 / 2
    assert metrics["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 2)
    assert metrics["rollout_is_ratio_fraction_low"] == 0.0


def test_token_weights_are_capped_per_token_and_carry_no_gradient():
    rows = [[0.25, 1.0, 3.0]]
    log_ratio = _log_ratio(rows).requires_grad_(True)
    weights, metrics = importance_weights(log_ratio, _mask(rows), "token", threshold=2.0)
    torch.testing.assert_close(weights, torch.tensor([[0.25, 1.0, 2.0]], dtype=torch.float64))
    assert not weights.requires_grad
    assert metrics["rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)
    assert metrics["rollout_is_ratio_fraction_low"] == pytest.approx(1 / 3)  # 0.25 < 1 / 2


# --- rejection sampling --------------------------------------------------------------------------------
# row 0: ratios [1, 1.2, 3]; row 1: [0.9, 0.8] + padding; row 2: empty (all padding)
RS_ROWS = [[1.0, 1.2, 3.0], [0.9, 0.8, None], [None, None, None]]


def _reject(rs, threshold):
    bounds = RolloutCorrection(rollout_rs=rs, rollout_rs_threshold=threshold).rejection_bounds()
    return rejection_mask(_log_ratio(RS_ROWS), _mask(RS_ROWS), bounds)


@pytest.mark.parametrize(
    ("rs", "threshold", "kept_row0", "kept_row1"),
    [
        # weight bounds [0.5, 2] per token: row 0's 3 is out
        ("token_k1", "0.5_2.0", [1, 1, 0], [1, 1]),
        # one number u means [1/u, u]; the sequence weight 1 * 1.2 * 3 = 3.6 is out, 0.9 * 0.8 = 0.72 in
        ("seq_sum_k1", "2.0", [0, 0, 0], [1, 1]),
        # geometric means 3.6^(1/3) = 1.533 and sqrt(0.72) = 0.849, both in [0.5, 2]
        ("seq_mean_k1", "0.5_2.0", [1, 1, 1], [1, 1]),
        # k2 = (log r)^2 / 2: row 0's largest is (log 3)^2 / 2 = 0.603 > 0.5; row 1's 0.025
        ("seq_max_k2", "0.5", [0, 0, 0], [1, 1]),
        # k3 = r - 1 - log r per token: [0, 0.0177, 0.9014] and [0.0054, 0.0231]; bound 0.1
        ("token_k3", "0.1", [1, 1, 0], [1, 1]),
        # sum of k3 over row 1: 0.0285 <= 0.03
        ("seq_sum_k3", "0.03", [0, 0, 0], [1, 1]),
    ],
)
def test_each_rejection_option_hand_computed(rs, threshold, kept_row0, kept_row1):
    keep, _ = _reject(rs, threshold)
    assert keep[0].tolist() == kept_row0
    assert keep[1, :2].tolist() == kept_row1


def test_chained_options_must_all_pass_and_report_their_fractions():
    keep, metrics = _reject("token_k1,seq_max_k2", "0.5_2.0,0.5")
    assert keep[0].tolist() == [0, 0, 0] and keep[1, :2].tolist() == [1, 1]
    assert metrics["rollout_rs_token_k1_masked_fraction"] == pytest.approx(1 / 5)
    assert metrics["rollout_rs_seq_max_k2_masked_fraction"] == pytest.approx(3 / 5)
    assert metrics["rollout_rs_masked_fraction"] == pytest.approx(3 / 5)
    # sequences with a valid token: 2 (the empty row is none); one of them lost tokens
    assert metrics["rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 2)


@pytest.mark.parametrize(
    ("rs", "threshold", "message"),
    [
        ("token_k4", "2.0", "rollout_rs option 'token_k4'; valid: token_k1, token_k2, token_k3, seq_sum_k1"),
        ("token_k1", None, "give algorithm.rollout_correction.rollout_rs_threshold too"),
        ("token_k1,seq_max_k2", "1.5,2.0,3.0", "one spec shared by all options or one per option"),
        ("token_k2", "0.1_0.5", "token_k2 takes one upper bound"),
        # Hydra reads 0.5_2 as the number 0.52: bounds [1.92, 0.52] are refused with the hint
        ("token_k1", "0.52", "Hydra reads 0.5_2 as 0.52"),
        ("seq_mean_k1", "two", "is not a number"),
    ],
)
def test_rejection_spec_errors(rs, threshold, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        RolloutCorrection(rollout_rs=rs, rollout_rs_threshold=threshold)


def test_every_option_is_accepted():
    for option in RS_OPTIONS:
        RolloutCorrection(
            rollout_rs=option, rollout_rs_threshold="0.5_2.0" if option.endswith("k1") else "1.0"
        )


# --- modes ---------------------------------------------------------------------------------------------


def test_mode_combinations_that_would_be_ignored_or_double_counted_are_refused():
    with pytest.raises(ConfigError, match="loss_type=reinforce applies to bypass_mode=true only"):
        RolloutCorrection(loss_type="reinforce")
    with pytest.raises(ConfigError, match="has no effect with bypass_mode and loss_type=ppo_clip"):
        RolloutCorrection(rollout_is="token", bypass_mode=True)
    with pytest.raises(ConfigError, match="rollout_is must be null, 'token' or 'sequence'"):
        RolloutCorrection(rollout_is="tokens")
    with pytest.raises(ConfigError, match="takes no tis_cap"):
        RolloutCorrection.from_options({"tis_cap": 2.0})


def test_decoupled_and_bypass_modes_measure_different_ratios():
    log_prob = torch.tensor([[math.log(0.4)]])
    old = torch.tensor([[math.log(0.2)]])
    rollout = torch.tensor([[math.log(0.1)]])
    mask = torch.ones(1, 1)
    decoupled = apply_rollout_correction(log_prob, old, rollout, mask, RolloutCorrection(rollout_is="token"))
    # pi_old / pi_rollout = 2
    assert decoupled.weights.item() == pytest.approx(2.0) and decoupled.old_log_prob is old
    bypass = RolloutCorrection(
        rollout_is="token", rollout_is_threshold=10.0, bypass_mode=True, loss_type="reinforce"
    )
    corrected = apply_rollout_correction(log_prob, old, rollout, mask, bypass)
    # pi_theta / pi_rollout = 4, and the rollout log-probs are the old policy
    assert corrected.weights.item() == pytest.approx(4.0)
    assert corrected.old_log_prob.item() == pytest.approx(math.log(0.1))
    # bypass with the PPO ratio: no weights, the ratio pi_theta / pi_rollout corrects
    plain = apply_rollout_correction(log_prob, old, rollout, mask, RolloutCorrection(bypass_mode=True))
    assert plain.weights is None and plain.keep is None
