import math

import pytest
import torch

from posttrain.algorithms.advantages import required_inputs
from posttrain.algorithms.advantages_token_baseline import (
    compute_optimal_token_baseline_advantages,
    compute_tir_optimal_token_baseline_advantages,
)

OTB = compute_optimal_token_baseline_advantages
TIR = compute_tir_optimal_token_baseline_advantages


def _inputs(probs, sum_pi_squared=0.5):
    """old log-probs of the sampled tokens, and sum_v pi_v^2 (the same at every position)."""
    old = torch.tensor([[math.log(p) for p in row] for row in probs])
    return {"old_log_probs": old, "sum_pi_squared": torch.full_like(old, sum_pi_squared)}


def test_baseline_per_position_weighted_by_path_variance():
    # group "g": rows a (reward 1 at the end) and b (reward 0); "h": a group of one (reward 2)
    # w_t = 1 - 2 pi_t + 0.5: a [0.5, 0.5] (pi 0.5, 0.5); b [0.5, 1.0] (pi 0.5, 0.25); W = cumsum:
    # a [0.5, 1.0], b [0.5, 1.5]. G: a [1, 1], b [0, 0].
    # B_0 = (1 * 0.5 + 0 * 0.5) / 1.0 = 0.5;  B_1 = (1 * 1.0 + 0 * 1.5) / 2.5 = 0.4
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 2.0]])
    mask = torch.ones(3, 2)
    inputs = _inputs([[0.5, 0.5], [0.5, 0.25], [0.5, 0.5]])
    adv, ret = OTB(rewards, mask, ["g", "g", "h"], **inputs)
    torch.testing.assert_close(
        adv, torch.tensor([[0.5, 0.6], [-0.5, -0.4], [2.0, 2.0]]), atol=1e-6, rtol=1e-6
    )
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0], [0.0, 0.0], [2.0, 2.0]]))


def test_rollout_is_weights_scale_the_path_variance_by_their_square():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    inputs = _inputs([[0.5, 0.5], [0.5, 0.25]])
    # rho = 2 on row b: its w is 4x: W_b = [2, 6]. B_0 = 0.5 / 2.5 = 0.2, B_1 = 1 / 7
    rho = torch.tensor([[1.0, 1.0], [2.0, 2.0]])
    adv, _ = OTB(rewards, torch.ones(2, 2), ["g", "g"], rollout_is_weights=rho, **inputs)
    torch.testing.assert_close(adv[0], torch.tensor([0.8, 1 - 1 / 7]), atol=1e-6, rtol=1e-6)


def test_the_single_longest_response_gets_no_baseline_past_the_second_longest():
    # c: 3 tokens, reward 1 at the end; d: 1 token, reward 1. pi 0.5 -> w 0.5 everywhere.
    # W: c [0.5, 1, 1.5], d [0.5, 0.5, 0.5]; G: c [1, 1, 1], d [1, 0, 0] (masked after t0)
    # B = [1, 1, 1] (only c is valid at t1, t2): c's advantages would all be 0
    rewards = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    inputs = _inputs([[0.5] * 3, [0.5] * 3])
    adv, _ = OTB(rewards, mask, ["g", "g"], **inputs)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    adv, _ = OTB(rewards, mask, ["g", "g"], handle_zero_tail=False, **inputs)
    torch.testing.assert_close(adv, torch.zeros(2, 3))


def test_tir_aligns_the_kth_model_token_of_each_response():
    # e: model tokens at columns 0 and 2 (tool output at 1), reward 1; f: columns 0 and 1, reward 0.
    # pi 0.5 -> w 0.5: W_e = [0.5, 0.5, 1.0], W_f = [0.5, 1.0, 1.0]; G_e = [1, 1, 1], G_f = 0.
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    inputs = _inputs([[0.5] * 3, [0.5] * 3])
    # packed: k0 = (e t0, f t0): B = (1 * 0.5) / 1.0 = 0.5; k1 = (e t2, f t1): B = (1 * 1.0) / 2.0 = 0.5
    adv, _ = TIR(rewards, mask, ["g", "g"], **inputs)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.0, 0.5], [-0.5, -0.5, 0.0]]), atol=1e-6, rtol=1e-6)
    # by column instead: t1 holds only f (B = 0), t2 only e (B = its own return 1)
    adv, _ = OTB(rewards, mask, ["g", "g"], **inputs)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.0, 0.0], [-0.5, 0.0, 0.0]]), atol=1e-6, rtol=1e-6)


def test_tir_leaves_empty_rows_out_of_their_group():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    adv, ret = TIR(rewards, mask, ["g", "g"], **_inputs([[0.5, 0.5], [0.5, 0.5]]))
    # the one non-empty response is a group of one: no baseline
    torch.testing.assert_close(adv, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    torch.testing.assert_close(ret, adv)


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_the_actor_inputs_are_required(name):
    assert required_inputs(name) == {"old_log_probs", "sum_pi_squared"}
