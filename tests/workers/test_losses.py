"""Losses by name: the registry, option checks, and rollout correction + aggregation applied once by `ppo`."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.errors import ConfigError
from posttrain.workers.losses import LOSSES, LossSpec, build_loss, with_totals

# One row, five tokens, the fifth padding; old log-probs 0, so the ratios are exp(log_prob). The PPO losses
# per token are [-1.2, 0.8, -1.1, 3.0] (see tests/algorithms/test_policy_loss.py).
LOG_PROBS = torch.tensor([[math.log(r) for r in (1.5, 0.5, 1.1, 4.0, 10.0)]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
# pi_old / pi_rollout = [0.5, 1, 3, 4, 8]; capped at 2 -> weights [0.5, 1, 2, 2, 2]
ROLLOUT = torch.tensor([[-math.log(w) for w in (0.5, 1.0, 3.0, 4.0, 8.0)]])


def _batch(**meta: float) -> Batch:
    return Batch.from_dict(
        {
            keys.RESPONSE_MASK: MASK,
            keys.ADVANTAGES: torch.tensor([[1.0, -1.0, 1.0, -1.0, 1.0]]),
            keys.OLD_LOG_PROBS: torch.zeros(1, 5),
            keys.ROLLOUT_LOG_PROBS: ROLLOUT,
            keys.REF_LOG_PROB: LOG_PROBS - 0.5,  # log-ratio to the reference 0.5 on every token
        },
        meta=meta,
    )


def test_the_losses_are_registry_entries() -> None:
    import posttrain.workers.preference  # noqa: F401 - registers `preference` (as the DPO trainer's workers do)
    import posttrain.workers.reward_model  # noqa: F401 - registers `bradley_terry` (the reward model's workers)

    assert LOSSES.names() == ["bradley_terry", "cross_entropy", "ppo", "preference", "value"]
    with pytest.raises(
        ConfigError, match=r"unknown loss 'dpo'; valid: bradley_terry, cross_entropy, ppo, preference, value"
    ):
        build_loss(LossSpec("dpo"), 1)


TOKEN_TIS = {"rollout_is": "token", "rollout_is_threshold": 2.0}


def test_ppo_applies_the_rollout_correction_and_aggregation_once() -> None:
    loss_fn = build_loss(LossSpec("ppo", {"rollout_correction": TOKEN_TIS}), dp_size=1)
    loss, metrics = loss_fn(LOG_PROBS, None, _batch())
    # per-token losses [-1.2, 0.8, -1.1, 3.0] times weights [0.5, 1, 2, 2] = [-0.6, 0.8, -2.2, 6.0]; mean 1.0
    assert loss.item() == pytest.approx(1.0)
    assert metrics["actor/pg_loss:sum"] == pytest.approx(1.0)
    assert metrics["actor/rollout_is_mean"] == pytest.approx(5.5 / 4)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 4)  # the policy loss's metrics, prefixed


def test_the_removed_tis_cap_names_its_replacement() -> None:
    with pytest.raises(ConfigError, match="tis_cap was replaced by verl's rollout correction"):
        build_loss(LossSpec("ppo", {"tis_cap": 2.0}), dp_size=1)


def test_without_meta_totals_a_micro_batch_counts_rows_with_a_valid_token() -> None:
    spec = LossSpec("ppo", {"loss_agg_mode": "seq-mean-token-sum"})
    mb = Batch.from_dict(
        {
            keys.RESPONSE_MASK: torch.tensor([[1.0, 1.0], [0.0, 0.0]]),  # the second row is padding
            keys.ADVANTAGES: torch.tensor([[1.0, 1.0], [1.0, 1.0]]),
            keys.OLD_LOG_PROBS: torch.zeros(2, 2),
        }
    )
    loss, _ = build_loss(spec, dp_size=1)(torch.zeros(2, 2), None, mb)
    # ratio 1: per-token loss -1; one sequence with token sum -2 (not -2 over 2 rows)
    assert loss.item() == pytest.approx(-2.0)


def test_ppo_normalises_every_term_by_the_mini_batch_totals() -> None:
    spec = LossSpec(
        "ppo",
        {"rollout_correction": TOKEN_TIS, "use_kl_loss": True, "kl_loss_coef": 0.1, "kl_loss_type": "k1"},
    )
    # this micro-batch holds 4 of the mini-batch's 8 tokens, on 2 ranks: sums / 8 * 2
    loss, metrics = build_loss(spec, dp_size=2)(LOG_PROBS, None, _batch(global_tokens=8, global_seqs=2))
    # policy: 4.0 / 8 * 2 = 1.0; k1 KL is 0.5 on each of 4 tokens: 2.0 / 8 * 2 = 0.5, times 0.1
    assert loss.item() == pytest.approx(1.0 + 0.1 * 0.5)
    assert metrics["actor/kl_loss"] == pytest.approx(0.5)


def test_ppo_passes_only_the_options_given_and_rejects_others() -> None:
    loss_fn = build_loss(LossSpec("ppo", {"clip_ratio_c": 10.0}), dp_size=1)
    _, metrics = loss_fn(LOG_PROBS, None, _batch())
    assert metrics["actor/pg_clipfrac_lower"] == 0.0  # the loose dual bound reached the loss
    with pytest.raises(
        ConfigError, match=r"policy loss 'vanilla' takes no option 'beta'; valid: .*clip_ratio_c"
    ):
        build_loss(LossSpec("ppo", {"beta": 0.1}), 1)
    with pytest.raises(
        ConfigError, match=r"policy loss 'sapo' takes no option 'clip_ratio_low'; valid: .*tau_neg"
    ):
        build_loss(LossSpec("ppo", {"policy_loss": "sapo", "clip_ratio_low": 0.2}), 1)


def test_value_loss_is_aggregated_by_the_entry() -> None:
    # the numbers of tests/algorithms/test_value_loss.py: per token [1.125, 0.5, masked], token-mean 0.8125
    mb = Batch.from_dict(
        {
            keys.RESPONSE_MASK: torch.tensor([[1.0, 1.0, 0.0]]),
            keys.VALUES: torch.zeros(1, 3),
            keys.RETURNS: torch.tensor([[2.0, 1.0, 9.0]]),
        }
    )
    loss_fn = build_loss(LossSpec("value", {"cliprange_value": 0.5, "loss_agg_mode": "token-sum"}), 1)
    loss, metrics = loss_fn(torch.tensor([[1.0, 0.0, 5.0]]), None, mb)
    assert loss.item() == pytest.approx(1.625)
    assert metrics["critic/vf_loss:sum"] == pytest.approx(1.625)
    assert metrics["critic/vf_clipfrac"] == pytest.approx(0.5)
    with pytest.raises(ConfigError, match=r"loss 'value' takes no option 'clip_ratio'"):
        build_loss(LossSpec("value", {"clip_ratio": 0.2}), 1)
    # seq-mean-token-sum-norm divides the token sum 1.625 by the configured constant, as the policy loss does
    norm = {"cliprange_value": 0.5, "loss_agg_mode": "seq-mean-token-sum-norm"}
    by_width, _ = build_loss(LossSpec("value", norm), 1)(torch.tensor([[1.0, 0.0, 5.0]]), None, mb)
    by_factor, _ = build_loss(LossSpec("value", {**norm, "loss_scale_factor": 13.0}), 1)(
        torch.tensor([[1.0, 0.0, 5.0]]), None, mb
    )
    assert (by_width.item(), by_factor.item()) == pytest.approx((1.625 / 3, 1.625 / 13))


def test_cross_entropy_takes_no_options() -> None:
    mb = Batch.from_dict({"loss_mask": torch.tensor([[0.0, 1.0, 1.0]])})
    loss, metrics = build_loss(LossSpec("cross_entropy"), 1)(torch.tensor([[-9.0, -1.0, -2.0]]), None, mb)
    assert loss.item() == pytest.approx(1.5)
    assert metrics["sft/nll"] == pytest.approx(1.5)
    with pytest.raises(ConfigError, match=r"loss 'cross_entropy' takes no option 'loss_agg_mode'"):
        build_loss(LossSpec("cross_entropy", {"loss_agg_mode": "token-sum"}), 1)


def test_on_several_ranks_missing_totals_are_refused_not_replaced_by_a_micro_batchs_own() -> None:
    # each rank normalising by its own micro-batch would scale the gradient by ranks x micro-batches
    with pytest.raises(ConfigError, match="2 data-parallel ranks needs the mini-batch totals"):
        build_loss(LossSpec("ppo"), dp_size=2)(LOG_PROBS, None, _batch())
    with pytest.raises(ConfigError, match="global_seqs missing"):
        build_loss(LossSpec("ppo"), dp_size=2)(LOG_PROBS, None, _batch(global_tokens=8))


def test_a_group_counts_the_totals_of_the_whole_mini_batch_for_its_loss() -> None:
    batch = Batch.from_dict(
        {
            keys.RESPONSE_MASK: torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]]),
            keys.LOSS_MASK: torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0]]),
        }
    )
    counted = with_totals(batch, "ppo")
    assert (counted.meta[keys.GLOBAL_TOKENS], counted.meta[keys.GLOBAL_SEQS]) == (3.0, 2)
    assert batch.meta == {}  # the caller's batch is left as it was
    sft = with_totals(batch, "cross_entropy")  # SFT's loss counts its own mask
    assert (sft.meta[keys.GLOBAL_TOKENS], sft.meta[keys.GLOBAL_SEQS]) == (1.0, 1)
    given = Batch.from_dict(
        {keys.RESPONSE_MASK: torch.ones(1, 2)}, meta={"global_tokens": 7, "global_seqs": 5}
    )
    assert with_totals(given, "value").meta == {"global_tokens": 7, "global_seqs": 5}  # set ones are kept
