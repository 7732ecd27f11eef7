import math

import pytest
import torch

from posttrain.algorithms.aggregation import aggregate_loss
from posttrain.algorithms.policy_loss import compute_policy_loss, kl_loss, own_options, ppo_clip_loss
from posttrain.algorithms.registry import get_policy_loss
from posttrain.algorithms.rollout_correction import RolloutCorrection
from posttrain.errors import ConfigError

# One row, five tokens; the fifth is padding. old log-probs are 0, so ratio = exp(log_prob).
RATIOS = [1.5, 0.5, 1.1, 4.0, 10.0]
ADVANTAGES = torch.tensor([[1.0, -1.0, 1.0, -1.0, 1.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
OLD = torch.zeros(1, 5)


def _log_prob():
    return torch.tensor([[math.log(r) for r in RATIOS]], requires_grad=True)


def test_ppo_clip_hand_computed():
    # t0: r=1.5, A=+1: max(-1.5, -1.2) = -1.2       (clipped)
    # t1: r=0.5, A=-1: max(0.5, 0.8) = 0.8, min(0.8, 3) = 0.8   (clipped)
    # t2: r=1.1, A=+1: max(-1.1, -1.1) = -1.1       (inside the range)
    # t3: r=4.0, A=-1: max(4.0, 1.2) = 4.0, min(4.0, 3) = 3.0   (dual clip)
    # token-mean over 4 valid tokens: (-1.2 + 0.8 - 1.1 + 3.0) / 4 = 0.375
    loss, metrics = compute_policy_loss(ppo_clip_loss, _log_prob(), OLD, ADVANTAGES, MASK)
    assert loss.item() == pytest.approx(0.375)
    assert metrics["pg_clipfrac"] == pytest.approx(2 / 4)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(1 / 4)
    # mean(old - new) = -(ln 1.5 + ln 0.5 + ln 1.1 + ln 4) / 4 = -ln(3.3) / 4
    assert metrics["ppo_kl"] == pytest.approx(-0.29848062)
    assert all(isinstance(v, float) for v in metrics.values())


def test_gradient_flows_only_through_unclipped_tokens():
    log_prob = _log_prob()
    loss, _ = compute_policy_loss(ppo_clip_loss, log_prob, OLD, ADVANTAGES, MASK)
    loss.backward()
    # Only t2 is unclipped: d(-A * r)/d log_prob = -A * r = -1.1, divided by 4 tokens.
    # t3 is where the dual clip is active: its gradient is exactly zero.
    torch.testing.assert_close(log_prob.grad, torch.tensor([[0.0, 0.0, -0.275, 0.0, 0.0]]))
    assert log_prob.grad[0, 3].item() == 0.0


def test_without_dual_clip_the_same_token_would_have_gradient():
    """Control for the test above: with a loose dual bound, t3 (r=4, A=-1) gets gradient -A*r/4 = 1.0."""
    log_prob = _log_prob()
    loss, metrics = compute_policy_loss(
        ppo_clip_loss, log_prob, OLD, ADVANTAGES, MASK, options={"clip_ratio_c": 10.0}
    )
    loss.backward()
    assert log_prob.grad[0, 3].item() == pytest.approx(1.0)
    assert metrics["pg_clipfrac_lower"] == 0.0


def test_clip_higher():
    log_prob = torch.tensor([[math.log(1.25)]])
    adv = torch.ones(1, 1)
    mask = torch.ones(1, 1)
    symmetric, m1 = compute_policy_loss(ppo_clip_loss, log_prob, torch.zeros(1, 1), adv, mask)
    higher, m2 = compute_policy_loss(
        ppo_clip_loss, log_prob, torch.zeros(1, 1), adv, mask, options={"clip_ratio_high": 0.28}
    )
    assert symmetric.item() == pytest.approx(-1.2) and m1["pg_clipfrac"] == 1.0
    assert higher.item() == pytest.approx(-1.25) and m2["pg_clipfrac"] == 0.0


def test_aggregation_mode_is_honoured():
    loss, _ = compute_policy_loss(
        ppo_clip_loss, _log_prob(), OLD, ADVANTAGES, MASK, loss_agg_mode="seq-mean-token-sum"
    )
    assert loss.item() == pytest.approx(1.5)  # one sequence, token sum 1.5
    loss, _ = compute_policy_loss(
        ppo_clip_loss, _log_prob(), OLD, ADVANTAGES, MASK, global_tokens=8, dp_size=2
    )
    assert loss.item() == pytest.approx(1.5 / 8 * 2)


def test_huge_log_ratio_stays_finite():
    log_prob = torch.tensor([[100.0, 100.0]], requires_grad=True)
    adv = torch.tensor([[-1.0, 1.0]])
    loss, metrics = compute_policy_loss(ppo_clip_loss, log_prob, torch.zeros(1, 2), adv, torch.ones(1, 2))
    loss.backward()
    assert loss.item() == pytest.approx((3.0 - 1.2) / 2)
    assert torch.isfinite(log_prob.grad).all()
    assert metrics["ppo_kl"] == pytest.approx(-20.0)  # the clamped log-ratio


def test_invalid_clip_ratios():
    with pytest.raises(ConfigError, match="clip_ratio_c must be > 1.0"):
        ppo_clip_loss(_log_prob(), OLD, ADVANTAGES, MASK, clip_ratio_c=1.0)
    with pytest.raises(ConfigError, match="clip_ratio_low"):
        ppo_clip_loss(_log_prob(), OLD, ADVANTAGES, MASK, clip_ratio_low=1.5)


def test_registry_lookup():
    assert get_policy_loss("vanilla") is ppo_clip_loss
    with pytest.raises(ConfigError, match=r"unknown policy loss 'ppo2'; valid: .*vanilla"):
        get_policy_loss("ppo2")


def test_kl_loss_hand_computed():
    log_prob = torch.tensor([[-1.0, -2.0, 0.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    kl, metrics = kl_loss(log_prob, ref, mask, kind="k1")
    loss = aggregate_loss(kl, mask, "token-mean")
    assert loss.item() == pytest.approx((0.5 - 1.0) / 2)
    assert metrics["kl_loss"] == pytest.approx(-0.25)
    kl, metrics = kl_loss(log_prob, ref, mask, kind="low_var_kl")
    loss = aggregate_loss(kl, mask, "token-mean")
    assert loss.item() == pytest.approx((0.10653066 + 0.71828183) / 2)
    loss.backward()
    # d k3 / d log_prob = 1 - r, r = exp(ref - lp): [1 - e^-0.5, 1 - e], halved by the token mean
    expected = [(1 - math.exp(-0.5)) / 2, (1 - math.e) / 2, 0.0]
    assert log_prob.grad[0].tolist() == pytest.approx(expected, abs=1e-6)


# --- ratio stats and truncated importance sampling (TIS) ---------------------------------------------


def test_ratio_stats_ignore_padding():
    _, metrics = ppo_clip_loss(_log_prob(), OLD, ADVANTAGES, MASK)
    # valid ratios 1.5, 0.5, 1.1, 4.0; the padding's 10.0 is not the max
    assert metrics["ratio_mean"] == pytest.approx(7.1 / 4)
    assert metrics["ratio_max"] == pytest.approx(4.0)


# pi_old / pi_rollout = [0.5, 1, 3, 4, 8] (old is 0); capped at 2 -> weights [0.5, 1, 2, 2, 2]
ROLLOUT = torch.tensor([[-math.log(w) for w in (0.5, 1.0, 3.0, 4.0, 8.0)]])
TOKEN_TIS = RolloutCorrection(rollout_is="token", rollout_is_threshold=2.0)


def test_token_tis_weights_each_token_loss():
    log_prob = _log_prob()
    loss, metrics = compute_policy_loss(
        ppo_clip_loss,
        log_prob,
        OLD,
        ADVANTAGES,
        MASK,
        rollout_log_probs=ROLLOUT,
        rollout_correction=TOKEN_TIS,
    )
    # per-token losses [-1.2, 0.8, -1.1, 3.0] times [0.5, 1, 2, 2] = [-0.6, 0.8, -2.2, 6.0]; sum 4.0 over 4
    assert loss.item() == pytest.approx(1.0)
    assert metrics["rollout_is_mean"] == pytest.approx(5.5 / 4)
    assert metrics["rollout_is_ratio_fraction_high"] == pytest.approx(2 / 4)  # 3 and 4 exceed the cap
    loss.backward()
    # the weight is a constant factor: t2's gradient -1.1 / 4 becomes 2 * -1.1 / 4
    torch.testing.assert_close(log_prob.grad, torch.tensor([[0.0, 0.0, -0.55, 0.0, 0.0]]))


def test_correction_is_off_by_default_even_with_rollout_log_probs():
    loss, metrics = compute_policy_loss(
        ppo_clip_loss, _log_prob(), OLD, ADVANTAGES, MASK, rollout_log_probs=ROLLOUT
    )
    assert loss.item() == pytest.approx(0.375)
    assert not any(k.startswith("rollout_") for k in metrics)


def test_rejected_tokens_add_no_loss_but_keep_their_place_in_the_normaliser():
    # token_k1 with weight bounds [0.4, 2]: weights [0.5, 1, 3, 4] keep t0, t1 and reject t2, t3
    correction = RolloutCorrection(rollout_rs="token_k1", rollout_rs_threshold="0.4_2.0")
    log_prob = _log_prob()
    loss, metrics = compute_policy_loss(
        ppo_clip_loss,
        log_prob,
        OLD,
        ADVANTAGES,
        MASK,
        rollout_log_probs=ROLLOUT,
        rollout_correction=correction,
    )
    # kept losses -1.2 + 0.8, over the 4 valid tokens (not 2)
    assert loss.item() == pytest.approx(-0.1)
    assert metrics["rollout_rs_masked_fraction"] == pytest.approx(2 / 4)
    assert metrics["pg_clipfrac"] == pytest.approx(1.0)  # the loss saw the kept tokens only: both clipped
    loss.backward()
    assert log_prob.grad[0, 2:].abs().sum().item() == 0.0
    # a row's length counts its rejected tokens too: seq-mean-token-mean gives the same -0.4 / 4
    per_seq, _ = compute_policy_loss(
        ppo_clip_loss,
        _log_prob(),
        OLD,
        ADVANTAGES,
        MASK,
        rollout_log_probs=ROLLOUT,
        rollout_correction=correction,
        loss_agg_mode="seq-mean-token-mean",
    )
    assert per_seq.item() == pytest.approx(-0.1)


def test_bypass_mode_uses_the_rollout_log_probs_as_the_old_policy():
    bypass = RolloutCorrection(bypass_mode=True)
    log_prob = _log_prob()
    # pi_old given as 0 is ignored: the ratio is pi / pi_rollout = [1.5 * 0.5, 0.5 * 1, 1.1 * 3, 4 * 4]
    # = [0.75, 0.5, 3.3, 16], A = [+1, -1, +1, -1]: per token [-0.75, 0.8 (clipped at 0.8), -1.2 (clipped at
    # 1.2), 3 (dual clip)]
    loss, _ = compute_policy_loss(
        ppo_clip_loss, log_prob, OLD, ADVANTAGES, MASK, rollout_log_probs=ROLLOUT, rollout_correction=bypass
    )
    assert loss.item() == pytest.approx((-0.75 + 0.8 - 1.2 + 3.0) / 4)


def test_bypass_reinforce_weighs_gpg_by_pi_theta_over_pi_rollout():
    correction = RolloutCorrection(
        rollout_is="sequence", rollout_is_threshold=100.0, bypass_mode=True, loss_type="reinforce"
    )
    log_prob = torch.tensor([[math.log(0.5), math.log(0.25)]], requires_grad=True)
    rollout = torch.tensor([[math.log(0.25), math.log(0.25)]])
    adv = torch.tensor([[1.0, 1.0]])
    loss, metrics = compute_policy_loss(
        get_policy_loss("gpg"),
        log_prob,
        torch.zeros(1, 2),
        adv,
        torch.ones(1, 2),
        rollout_log_probs=rollout,
        rollout_correction=correction,
    )
    # w = (0.5 / 0.25) * (0.25 / 0.25) = 2 on both tokens: -2 * (log 0.5 + log 0.25) / 2 = 3 log 2
    assert loss.item() == pytest.approx(3 * math.log(2.0))
    assert metrics["rollout_is_mean"] == pytest.approx(2.0)
    loss.backward()
    torch.testing.assert_close(log_prob.grad, torch.tensor([[-1.0, -1.0]]))


def test_correction_config_errors():
    with pytest.raises(ConfigError, match="needs rollout_log_probs"):
        compute_policy_loss(ppo_clip_loss, _log_prob(), OLD, ADVANTAGES, MASK, rollout_correction=TOKEN_TIS)
    with pytest.raises(ConfigError, match="rollout_is_threshold must be > 0"):
        RolloutCorrection(rollout_is="token", rollout_is_threshold=0.0)


def test_loss_scale_factor_is_the_constant_of_seq_mean_token_sum_norm():
    loss, _ = compute_policy_loss(
        ppo_clip_loss,
        _log_prob(),
        OLD,
        ADVANTAGES,
        MASK,
        loss_agg_mode="seq-mean-token-sum-norm",
        loss_scale_factor=10.0,
    )
    # one sequence, token sum 1.5, divided by 10 instead of the width 5
    assert loss.item() == pytest.approx(1.5 / 10)


# --- the calling convention, for every registered loss ------------------------------------------------

ALL_LOSSES = [
    "vanilla",
    "gspo",
    "sapo",
    "cispo",
    "dro",
    "gpg",
    "clip_cov",
    "kl_cov",
    "geo_mean",
    "dppo_tv",
    "dppo_kl",
]
# Two rows, three and two valid tokens.
CONV_LOG_PROB = torch.tensor([[-1.0, -0.5, -2.0, -0.1], [-0.3, -1.2, -0.7, -0.9]])
CONV_OLD = torch.tensor([[-1.1, -0.4, -2.0, -3.0], [-0.2, -1.0, -0.7, -0.2]])
CONV_ADV = torch.tensor([[1.0, 1.0, 1.0, 1.0], [-0.5, -0.5, -0.5, -0.5]])
CONV_MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])


def _call(name, **kwargs):
    options = {"generator": torch.Generator().manual_seed(0)} if name == "clip_cov" else {}
    loss_fn = get_policy_loss(name)
    return compute_policy_loss(
        loss_fn, CONV_LOG_PROB, CONV_OLD, CONV_ADV, CONV_MASK, options=options, **kwargs
    )


def test_all_losses_are_registered():
    from posttrain.algorithms import POLICY_LOSSES

    assert sorted(ALL_LOSSES) == POLICY_LOSSES.names()


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_common_metrics(name):
    loss, metrics = _call(name)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "ratio_mean", "ratio_max"} <= metrics.keys()
    assert all(isinstance(v, float) for v in metrics.values())
    # ppo_kl = mean(old - new) over the 5 valid tokens: (-0.1 + 0.1 + 0 + 0.1 + 0.2) / 5
    assert metrics["ppo_kl"] == pytest.approx(0.06)


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_aggregation_mode_is_not_overridden(name):
    mean, _ = _call(name, loss_agg_mode="token-mean")
    total, _ = _call(name, loss_agg_mode="token-sum")
    assert total.item() == pytest.approx(mean.item() * 5, abs=1e-6)


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_token_tis_with_constant_weight_scales_every_loss(name):
    plain, _ = _call(name)
    # pi_old / pi_rollout = 2 everywhere, under a cap of 5: every token's loss doubles
    correction = RolloutCorrection(rollout_is="token", rollout_is_threshold=5.0)
    weighted, metrics = _call(name, rollout_log_probs=CONV_OLD - math.log(2.0), rollout_correction=correction)
    assert weighted.item() == pytest.approx(2.0 * plain.item(), abs=1e-6)
    assert metrics["rollout_is_mean"] == pytest.approx(2.0)


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_rollout_correction_without_rollout_log_probs_is_an_error(name):
    with pytest.raises(ConfigError, match="rollout_log_probs"):
        _call(name, rollout_correction=RolloutCorrection(rollout_is="token"))


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_global_totals_and_dp_size(name):
    local, _ = _call(name)
    # 5 local tokens out of 20 in the mini-batch, on 2 ranks: local sum / 20 * 2
    split, _ = _call(name, global_tokens=20, dp_size=2)
    assert split.item() == pytest.approx(local.item() * 5 / 20 * 2, abs=1e-6)


CALLER_ARGUMENTS = {
    "loss_agg_mode",
    "global_tokens",
    "global_seqs",
    "dp_size",
    "rollout_log_probs",
    "rollout_correction",
    "loss_scale_factor",
}


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_each_loss_returns_per_token_losses_that_the_caller_aggregates_once(name):
    options = {"generator": torch.Generator().manual_seed(0)} if name == "clip_cov" else {}
    per_token, _ = get_policy_loss(name)(CONV_LOG_PROB, CONV_OLD, CONV_ADV, CONV_MASK, **options)
    assert per_token.shape == CONV_MASK.shape
    loss, _ = _call(name, loss_agg_mode="seq-mean-token-mean")
    assert loss.item() == pytest.approx(aggregate_loss(per_token, CONV_MASK, "seq-mean-token-mean").item())
    # aggregation and truncated importance sampling are the caller's, never a loss's own arguments
    assert not CALLER_ARGUMENTS & own_options(get_policy_loss(name)).keys()


def test_each_loss_documents_its_own_defaults_in_its_signature():
    defaults = {name: own_options(get_policy_loss(name)) for name in ALL_LOSSES}
    assert defaults["vanilla"] == {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}
    assert defaults["gspo"] == {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}
    assert defaults["cispo"] == {"clip_ratio_low": 1.0, "clip_ratio_high": 3.0}
    assert defaults["sapo"] == {"tau_pos": 1.0, "tau_neg": 1.05}
    assert defaults["dro"] == {"beta": 0.05}
    assert defaults["gpg"] == {}
    assert defaults["kl_cov"] == {"kl_cov_ratio": 2e-4, "ppo_kl_coef": 0.1}  # verl's configured default
    assert defaults["geo_mean"] == {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4}
    assert defaults["dppo_tv"] == {"clip_ratio_low": 0.15, "clip_ratio_high": 0.15, "clip_ratio_c": 20.0}
    assert defaults["dppo_kl"] == {"clip_ratio_low": 0.05, "clip_ratio_high": 0.05, "clip_ratio_c": 20.0}
    assert defaults["clip_cov"] == {
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.2,
        "clip_cov_ratio": 2e-4,
        "clip_cov_lb": 1.0,
        "clip_cov_ub": 5.0,
        "generator": None,
    }
