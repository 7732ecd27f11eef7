"""Every algorithm name and rollout-correction key is reachable from `posttrain train`'s config (the same
`load_config` and start-up checks the command runs), and an unknown one lists the valid ones."""

from __future__ import annotations

import pytest
import torch

from posttrain.algorithms.registry import get_advantage_estimator, get_kl_estimator
from posttrain.config.load import from_dict, load_config, to_dict
from posttrain.config.schema import RLConfig
from posttrain.data.batch import Batch
from posttrain.errors import ConfigError
from posttrain.trainers.checks import check_algorithm
from posttrain.trainers.setup import (
    advantage_kwargs,
    policy_loss_options,
    reuses_update_log_probs,
)


def _load(*overrides: str) -> RLConfig:
    return load_config(RLConfig, "rl", list(overrides))


def _start_up_checks(cfg: RLConfig) -> dict:
    """What `check_rl_config` runs on the algorithm (the rest needs a model and data files)."""
    options = policy_loss_options(cfg.actor, cfg.algorithm)
    check_algorithm(cfg, get_advantage_estimator(cfg.algorithm.adv_estimator))
    get_kl_estimator(cfg.actor.kl_loss_type)
    get_kl_estimator(cfg.algorithm.kl_penalty)
    return options


@pytest.mark.parametrize("loss", ["geo_mean", "dppo_tv", "dppo_kl"])
def test_new_policy_losses_take_their_options_under_verls_names(loss: str) -> None:
    cfg = _load(f"actor.policy_loss={loss}", "actor.clip_ratio_low=0.1", "actor.clip_ratio_high=0.2")
    options = _start_up_checks(cfg)
    assert options["policy_loss"] == loss
    assert options["clip_ratio_low"] == 0.1 and options["clip_ratio_high"] == 0.2
    if loss.startswith("dppo"):
        assert (
            _start_up_checks(_load(f"actor.policy_loss={loss}", "actor.clip_ratio_c=1e4"))["clip_ratio_c"]
            == 1e4
        )


@pytest.mark.parametrize("kind", ["k2+", "mse+"])
def test_new_kl_estimator_names(kind: str) -> None:
    _start_up_checks(_load(f"actor.kl_loss_type={kind}", f"algorithm.kl_penalty={kind}"))


def test_gdpo_with_and_without_reward_components() -> None:
    _start_up_checks(_load("algorithm.adv_estimator=gdpo"))
    cfg = _load(
        "algorithm.adv_estimator=gdpo",
        "algorithm.gdpo_reward_keys=[format,accuracy]",
        "algorithm.gdpo_reward_weights=[0.5,1.0]",
        "reward.custom_function_path=my_reward.py",
    )
    _start_up_checks(cfg)
    batch = Batch.from_dict(
        {"token_level_rewards": torch.zeros(2, 1)}, {"format": [1.0, 0.0], "accuracy": [0, 1]}
    )
    kwargs = advantage_kwargs(get_advantage_estimator("gdpo"), cfg.algorithm, batch)
    torch.testing.assert_close(kwargs["reward_components"], torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    assert kwargs["reward_weights"] == (0.5, 1.0)
    # a row whose score failed has no components: 0.0, as its score; a key no row has is an error
    failed = Batch.from_dict(
        {"token_level_rewards": torch.zeros(2, 1)}, {"format": [1.0, None], "accuracy": [None, 1.0]}
    )
    kwargs = advantage_kwargs(get_advantage_estimator("gdpo"), cfg.algorithm, failed)
    torch.testing.assert_close(kwargs["reward_components"], torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
    missing = Batch.from_dict({"token_level_rewards": torch.zeros(2, 1)}, {"format": [1.0, 0.0]})
    with pytest.raises(ConfigError, match="'accuracy' is not a value of the reward function's results"):
        advantage_kwargs(get_advantage_estimator("gdpo"), cfg.algorithm, missing)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["algorithm.gdpo_reward_keys=[format]"],
            "gdpo_reward_keys is set, but adv_estimator=grpo does not use it",
        ),
        (
            [
                "algorithm.adv_estimator=gdpo",
                "algorithm.gdpo_reward_keys=[a,b]",
                "algorithm.gdpo_reward_weights=[1.0]",
                "reward.custom_function_path=my_reward.py",
            ],
            "has 1 values for 2 algorithm.gdpo_reward_keys",
        ),
        # gdpo's advantage comes from the components: what shapes the token-level reward would be ignored
        *[
            (
                ["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[a]", *extra],
                message,
            )
            for extra, message in [
                (
                    ["reward.overlong_buffer_len=4", "reward.custom_function_path=r.py"],
                    "overlong_buffer_len=4",
                ),
                (["algorithm.use_kl_in_reward=true", "reward.custom_function_path=r.py"], "use_kl_in_reward"),
                (
                    ["algorithm.dynamic_sampling=true", "reward.custom_function_path=r.py"],
                    "filters on the score",
                ),
                (["agent.enable=true", "reward.custom_function_path=r.py"], "episodes keep the score only"),
                ([], "no reward.custom_function_path"),
            ]
        ],
        # the estimator is registered, but its per-token inputs come from an engine pass posttrain lacks
        (
            ["algorithm.adv_estimator=optimal_token_baseline"],
            "needs old_log_probs, sum_pi_squared per response token, which the trainer does not supply",
        ),
        (["algorithm.adv_estimator=tir_optimal_token_baseline"], "needs old_log_probs, sum_pi_squared"),
        # unknown names list the valid ones
        (["algorithm.adv_estimator=gdpoo"], "unknown advantage estimator 'gdpoo'; valid: gae, gdpo, gpg"),
        (
            ["actor.policy_loss=dppo"],
            "unknown policy loss 'dppo'; valid: cispo, clip_cov, dppo_kl, dppo_tv, dro, geo_mean",
        ),
        (
            ["actor.kl_loss_type=k4+"],
            "unknown KL estimator 'k4\\+'; valid: abs, abs\\+, k1, k1\\+, k2, k2\\+",
        ),
    ],
)
def test_refused_settings_say_why(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _start_up_checks(_load(*overrides))


# --- rollout correction ----------------------------------------------------------------------------------


def test_rollout_correction_keys_travel_to_the_loss() -> None:
    cfg = _load(
        "algorithm.rollout_correction.rollout_is=sequence",
        "algorithm.rollout_correction.rollout_is_threshold=5.0",
        "algorithm.rollout_correction.rollout_rs='token_k1,seq_max_k2'",
        "algorithm.rollout_correction.rollout_rs_threshold='0.5_2.0,0.1'",
    )
    options = _start_up_checks(cfg)
    assert options["rollout_correction"] == {
        "rollout_is": "sequence",
        "rollout_is_threshold": 5.0,
        "rollout_rs": "token_k1,seq_max_k2",
        "rollout_rs_threshold": "0.5_2.0,0.1",
        "bypass_mode": False,
        "loss_type": "ppo_clip",
    }
    # Hydra reads an unquoted 0.5_2.0 as the string it is, and a bare number as a number
    one = _load(
        "algorithm.rollout_correction.rollout_rs=token_k1",
        "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0",
    )
    assert one.algorithm.rollout_correction.rollout_rs_threshold == "0.5_2.0"
    two = _load(
        "algorithm.rollout_correction.rollout_rs=token_k2",
        "algorithm.rollout_correction.rollout_rs_threshold=2",
    )
    assert two.algorithm.rollout_correction.rollout_rs_threshold == "2"
    _start_up_checks(two)
    assert "rollout_correction" not in _start_up_checks(_load())  # off by default: nothing to send


def test_async_rl_reuses_the_update_log_probs_with_one_step_per_batch() -> None:
    # the proximal policy is the trainer's weights at the update, which one step per batch has not moved
    assert reuses_update_log_probs(_load("async_rl.staleness=1"))
    assert reuses_update_log_probs(
        _load("async_rl.staleness=2", "algorithm.rollout_correction.rollout_is=token")
    )
    assert not reuses_update_log_probs(_load("async_rl.staleness=1", "actor.ppo_epochs=2"))
    assert not reuses_update_log_probs(_load("async_rl.staleness=1", "actor.mini_batch_size=8"))
    assert not reuses_update_log_probs(_load("async_rl.staleness=1", "actor.reuse_log_probs_on_policy=false"))
    assert not reuses_update_log_probs(_load("async_rl.staleness=1", "algorithm.use_kl_in_reward=true"))


def test_bypass_mode_skips_the_old_log_prob_pass_whatever_the_number_of_updates() -> None:
    several_updates = ["actor.ppo_epochs=2"]
    assert not reuses_update_log_probs(_load(*several_updates))
    bypass = _load(*several_updates, "algorithm.rollout_correction.bypass_mode=true")
    assert reuses_update_log_probs(bypass)
    assert _start_up_checks(bypass)["rollout_correction"]["bypass_mode"] is True
    reinforce = _load(
        "actor.policy_loss=gpg",
        "algorithm.rollout_correction.bypass_mode=true",
        "algorithm.rollout_correction.loss_type=reinforce",
        "algorithm.rollout_correction.rollout_is=token",
    )
    _start_up_checks(reinforce)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["algorithm.rollout_correction.rollout_is=tokens"],
            "'algorithm.rollout_correction.rollout_is' must be one of",
        ),
        (
            ["algorithm.rollout_correction.rollout_rs=token_k1"],
            "give algorithm.rollout_correction.rollout_rs_threshold",
        ),
        (
            [
                "algorithm.rollout_correction.bypass_mode=true",
                "algorithm.rollout_correction.loss_type=reinforce",
                "algorithm.rollout_correction.rollout_is=token",
            ],
            "loss_type=reinforce weighs the REINFORCE loss -A \\* log pi: set actor.policy_loss=gpg",
        ),
        (
            [
                "algorithm.rollout_correction.bypass_mode=true",
                "algorithm.rollout_correction.rollout_is=token",
            ],
            "has no effect with bypass_mode and loss_type=ppo_clip",
        ),
        (
            ["actor.loss_scale_factor=512"],
            "loss_scale_factor=512.0 is set, but actor.loss_agg_mode=token-mean",
        ),
    ],
)
def test_rollout_correction_and_scale_errors(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _start_up_checks(_load(*overrides))


def test_loss_scale_factor_for_dr_grpo_aggregation() -> None:
    cfg = _load("actor.loss_agg_mode=seq-mean-token-sum-norm", "actor.loss_scale_factor=512")
    assert _start_up_checks(cfg)["loss_scale_factor"] == 512.0


def test_the_old_tis_cap_key_names_its_replacement() -> None:
    hint = "rollout_correction.rollout_is=token and algorithm.rollout_correction.rollout_is_threshold"
    with pytest.raises(ConfigError, match=f"config key 'actor.tis_cap' was removed: .*{hint}"):
        _load("actor.tis_cap=2.0")
    data = to_dict(RLConfig())
    data["actor"]["tis_cap"] = 2.0
    with pytest.raises(ConfigError, match="'actor.tis_cap' was removed"):
        from_dict(RLConfig, data)
