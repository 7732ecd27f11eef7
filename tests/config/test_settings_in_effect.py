"""A key set while the switch that uses it is off is refused, naming the key and the switch (it would be
ignored otherwise: config.json would record it and nothing would read it); defaults are never refused; the verl
converter leaves out what verl ignores as well."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.commands.verl_convert import convert
from posttrain.config.load import load_config
from posttrain.config.schema import DistillConfig, DPOConfig, RLConfig, RMConfig, SFTConfig
from posttrain.demo import RL_OVERRIDES, SFT_OVERRIDES
from posttrain.errors import ConfigError
from posttrain.trainers.dpo import check_dpo_config
from posttrain.trainers.rm import check_rm_config
from posttrain.trainers.settings_in_effect import check_settings_in_effect, unused_rl_settings
from posttrain.trainers.sft import check_sft_config


def _rl(*overrides: str) -> RLConfig:
    return load_config(RLConfig, "rl", list(overrides))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.kl_coef=0.5"], r"algorithm.kl_coef=0.5 is set, but algorithm.use_kl_in_reward=false"),
        (
            ["algorithm.max_gen_rounds=3"],
            r"algorithm.max_gen_rounds=3 is set, but algorithm.dynamic_sampling=false",
        ),
        (
            ["algorithm.rollout_correction.bypass_mode=true", "actor.reuse_log_probs_on_policy=false"],
            r"actor.reuse_log_probs_on_policy=False is set, but algorithm.rollout_correction.bypass_mode=true",
        ),
        (
            ["trainer.val_every=0", "trainer.val_before_train=false", "rollout.val_temperature=0.7"],
            r"rollout.val_temperature=0.7 is set, but no validation",
        ),
        (
            ["algorithm.kl_ctrl_type=adaptive", "algorithm.kl_target=3.0"],
            r"algorithm.kl_ctrl_type=adaptive, algorithm.kl_target=3.0 are set, but algorithm.use_kl_in_reward",
        ),
        (
            ["algorithm.use_kl_in_reward=true", "actor.use_kl_loss=false", "algorithm.kl_horizon=5"],
            r"algorithm.kl_horizon=5 is set, but algorithm.kl_ctrl_type=fixed",
        ),
        (
            ["actor.use_kl_loss=false", "actor.kl_loss_coef=0.5", "actor.kl_loss_type=k2"],
            r"actor.kl_loss_coef=0.5, actor.kl_loss_type=k2 are set, but actor.use_kl_loss=false",
        ),
        (
            ["critic.model_path=/nonexistent", "critic.optim.lr=0.001"],
            r"critic.model_path=/nonexistent, critic.optim.lr=0.001 are set, but critic.enable=false",
        ),
        (["algorithm.critic_warmup=3"], r"algorithm.critic_warmup=3 is set, but critic.enable=false"),
        (["model.lora.alpha=32"], r"model.lora.alpha=32.0 is set, but model.lora.rank=0"),
        (["agent.tool_parser=nonexistent"], r"agent.tool_parser=nonexistent is set, but agent.enable=false"),
        (["async_rl.on_stale=regenerate"], r"async_rl.on_stale=regenerate is set, but async_rl.staleness=0"),
        (
            ["async_rl.staleness=1", "async_rl.partial_chunk_tokens=8"],
            r"async_rl.partial_chunk_tokens=8 is set, but async_rl.partial_rollout=false",
        ),
        (
            ["algorithm.rollout_correction.rollout_is_threshold=5.0"],
            r"rollout_is_threshold=5.0 is set, but rollout_is is null",
        ),
        (
            ["reward.gsm8k_method=flexible", "reward.custom_function_path=f.py"],
            r"gsm8k_method=flexible is set",
        ),
        (["reward.timeout_s=3"], r"reward.timeout_s=3.0 is set, but reward.custom_function_path is empty"),
        (
            ["reward.overlong_penalty_factor=2"],
            r"overlong_penalty_factor=2.0 is set, but reward.overlong_buffer_len=0",
        ),
        (["trainer.restart_wait_s=5"], r"trainer.restart_wait_s=5.0 is set, but trainer.max_restarts=0"),
        (
            ["trainer.backend=local", "ray.address=10.0.0.1:6379", "trainer.cpus_per_worker=2"],
            r"ray.address=10.0.0.1:6379, trainer.cpus_per_worker=2.0 are set, but trainer.backend=local",
        ),
        (["ray.address=auto", "ray.num_cpus=4"], r"ray.num_cpus=4 is set, but ray.address is set"),
        (
            ["model.remove_padding=false", "model.share_prompt=false", "model.pack_row_tokens=512"],
            r"model.pack_row_tokens=512 is set, but model.remove_padding=false",
        ),
    ],
)
def test_rl_settings_that_would_be_ignored_are_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_settings_in_effect(_rl(*overrides))


def test_defaults_and_the_switched_on_features_are_not_refused() -> None:
    assert unused_rl_settings(_rl()) == []
    assert unused_rl_settings(_rl(*RL_OVERRIDES)) == []
    switched_on = _rl(
        "algorithm.use_kl_in_reward=true",
        "actor.use_kl_loss=false",
        "algorithm.kl_ctrl_type=adaptive",
        "algorithm.kl_target=3.0",
        "critic.enable=true",
        "critic.optim.lr=0.001",
        "algorithm.critic_warmup=2",
        "model.lora.rank=4",
        "model.lora.alpha=8",
        "reward.overlong_buffer_len=4",
        "reward.overlong_penalty_factor=2",
        "trainer.max_restarts=1",
        "trainer.restart_wait_s=5",
    )
    assert unused_rl_settings(switched_on) == []


def test_a_cuda_run_on_ray_without_a_gpu_share_is_refused() -> None:
    with pytest.raises(ConfigError, match="trainer.device=cuda with trainer.gpus_per_worker=0"):
        check_settings_in_effect(_rl("trainer.device=cuda", "trainer.gpus_per_worker=0"))


def test_fractional_gpu_shares_of_one_process_group_on_a_node_are_refused() -> None:
    # Ray would pack both ranks onto one GPU; NCCL refuses two ranks on one device at start-up
    shared = ("trainer.device=cuda", "trainer.gpus_per_worker=0.5", "trainer.n_workers_per_node=2")
    with pytest.raises(ConfigError, match="trainer.gpus_per_worker=0.5 with trainer.n_workers_per_node=2"):
        check_settings_in_effect(_rl(*shared, "data.train_batch_prompts=2"))
    check_settings_in_effect(_rl("trainer.device=cuda", "trainer.gpus_per_worker=0.5"))  # one per node: fine


def test_critic_warmup_shortens_the_actors_schedule() -> None:
    """The actor trains total_steps - critic_warmup steps: its cosine schedule must end at the last one."""
    from posttrain.trainers.setup import actor_spec

    cfg = _rl("critic.enable=true", "algorithm.adv_estimator=gae", "algorithm.critic_warmup=5")
    assert actor_spec(cfg, threads=1).engine.total_steps == cfg.trainer.total_steps - 5


def test_validation_sampling_is_untruncated() -> None:
    from posttrain.trainers.setup import sampling_params

    _, val = sampling_params(_rl("rollout.min_p=0.1", "rollout.top_k=5", "rollout.val_temperature=0.7"))
    assert (val.min_p, val.top_k, val.top_p, val.temperature) == (0.0, 0, 1.0, 0.7)


def test_the_verl_converter_leaves_out_what_verl_ignores_too() -> None:
    """verl's default kl_loss_type (low_var_kl) is carried over only when its KL loss is on."""
    base = {"algorithm.adv_estimator": "grpo", "actor_rollout_ref.rollout.n": 4}
    off = convert(base)
    assert not [m for m in off.mapped if m.key == "actor.kl_loss_type"]
    assert any(s.verl_key.endswith("kl_loss_type") and "use_kl_loss=false" in s.reason for s in off.no_effect)
    assert unused_rl_settings(_rl(*off.overrides())) == []
    on = convert({**base, "actor_rollout_ref.actor.use_kl_loss": True})
    assert "actor.kl_loss_type=low_var_kl" in on.overrides()


# --- the offline commands ----------------------------------------------------------------------------


@pytest.fixture
def text_rows(tmp_path: Path) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": [{"role": "user", "content": "1+1"}], "extra_info": {"answer": "2"}}\n')
    return str(path)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.val_every=5", r"trainer.val_every=5 is set, but data.val_files is empty"),
        ("trainer.stop_at_val_nll=0.7", r"trainer.stop_at_val_nll=0.7 needs validations during the run"),
        (
            "data.train_batch_prompts=7",
            r"data.train_batch_prompts=7 is set, but sft batches by optim.batch_size",
        ),
        ("model.lora.dropout=0.1", r"model.lora.dropout=0.1 is set, but model.lora.rank=0"),
        ("ray.address=10.0.0.1:6379", r"ray.address=10.0.0.1:6379 is set, but trainer.backend=local"),
        ("model.vision_tower=trained", r"model.vision_tower=trained is set, but .* is a text-only model"),
    ],
)
def test_sft_settings_that_would_be_ignored_are_refused(
    tiny_model_dir: Path, text_rows: str, override: str, message: str
) -> None:
    cfg = load_config(
        SFTConfig, "sft", [f"model.path={tiny_model_dir}", f"data.train_files=[{text_rows}]", override]
    )
    with pytest.raises(ConfigError, match=message):
        check_sft_config(cfg)


def test_the_demos_sft_settings_are_all_used(tiny_model_dir: Path, text_rows: str) -> None:
    files = [f"data.train_files=[{text_rows}]", f"data.val_files=[{text_rows}]"]
    check_sft_config(load_config(SFTConfig, "sft", [f"model.path={tiny_model_dir}", *files, *SFT_OVERRIDES]))


@pytest.mark.parametrize(
    ("schema", "name", "checker", "override", "message"),
    [
        (
            DPOConfig,
            "dpo",
            check_dpo_config,
            "dpo.simpo_gamma=1.0",
            r"dpo.simpo_gamma=1.0 is set, but it applies",
        ),
        (
            DPOConfig,
            "dpo",
            check_dpo_config,
            "dpo.loss_type=[simpo]",
            None,  # reference-free with the default reference: accepted
        ),
        (DPOConfig, "dpo", check_dpo_config, "trainer.val_every=5", r"trainer.val_every=5 is set"),
    ],
)
def test_pair_commands_refuse_settings_they_would_ignore(
    tiny_model_dir: Path, text_rows: str, schema: type, name: str, checker, override: str, message: str | None
) -> None:
    cfg = load_config(
        schema, name, [f"model.path={tiny_model_dir}", f"data.train_files=[{text_rows}]", override]
    )
    if message is None:
        checker(cfg)
    else:
        with pytest.raises(ConfigError, match=message):
            checker(cfg)


def test_rm_refuses_the_router_loss_it_does_not_add(tiny_moe_dir: Path, text_rows: str) -> None:
    overrides = [
        f"model.path={tiny_moe_dir}",
        f"data.train_files=[{text_rows}]",
        "model.router_aux_loss_coef=0.5",
    ]
    with pytest.raises(
        ConfigError, match=r"router_aux_loss_coef=0.5 is set, but the reward model adds no router"
    ):
        check_rm_config(load_config(RMConfig, "rm", overrides))


def test_dpo_reference_source_without_a_reference_loss_is_refused(
    tiny_model_dir: Path, text_rows: str
) -> None:
    cfg = load_config(
        DPOConfig,
        "dpo",
        [
            f"model.path={tiny_model_dir}",
            f"data.train_files=[{text_rows}]",
            "dpo.loss_type=[simpo]",
            "dpo.reference=columns",
        ],
    )
    with pytest.raises(
        ConfigError, match=r"dpo.reference=columns is set, but no loss in dpo.loss_type=\['simpo'\]"
    ):
        check_dpo_config(cfg)


def test_distill_refuses_rl_batch_key(tiny_model_dir: Path, text_rows: str) -> None:
    from posttrain.trainers.distill import check_distill_config

    cfg = load_config(
        DistillConfig,
        "distill",
        [
            f"model.path={tiny_model_dir}",
            f"distill.teacher_path={tiny_model_dir}",
            f"data.train_files=[{text_rows}]",
            "data.train_batch_prompts=7",
        ],
    )
    with pytest.raises(ConfigError, match=r"data.train_batch_prompts=7 is set, but distill batches"):
        check_distill_config(cfg)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["actor.ppo_epochs=0"], r"actor.ppo_epochs must be >= 1"),
        (["critic.ppo_epochs=0"], r"critic.ppo_epochs must be >= 1"),
        (["critic.micro_batch_size=0"], r"critic.micro_batch_size must be > 0"),
        (["critic.cliprange_value=0"], r"critic.cliprange_value must be > 0"),
        (
            ["algorithm.critic_warmup=10"],
            r"critic_warmup=10 critic-only steps leave none of trainer.total_steps=10",
        ),
    ],
)
def test_a_model_that_would_never_train_is_refused_before_the_workers_start(
    overrides: list[str], message: str
) -> None:
    """ppo_epochs=0 left the actor or critic untrained with exit status 0; a warm-up as long as the run never
    trained the actor; the others failed only at the first update, after a whole generation."""
    from posttrain.trainers.checks import check_update_counts

    cfg = _rl("critic.enable=true", "algorithm.adv_estimator=gae", "trainer.total_steps=10", *overrides)
    with pytest.raises(ConfigError, match=message):
        check_update_counts(cfg)
    check_update_counts(_rl("critic.enable=true", "algorithm.adv_estimator=gae", "algorithm.critic_warmup=9"))


def test_verls_critic_warmup_counts_from_step_one() -> None:
    """verl updates the actor once critic_warmup <= global_steps (from 1): its N is N - 1 critic-only steps."""
    overrides = convert({"algorithm.adv_estimator": "gae", "trainer.critic_warmup": 3}).overrides()
    assert "algorithm.critic_warmup=2" in overrides


def test_verls_resume_path_mode_maps_to_resume_from() -> None:
    given = {"trainer.resume_mode": "resume_path", "trainer.resume_from_path": "runs/a/step_4"}
    assert {"trainer.resume=true", "trainer.resume_from=runs/a/step_4"} <= set(convert(given).overrides())


def test_verls_reward_model_maps_to_reward_model_path() -> None:
    """verl's reward_model.enable=true scores with the model alone (its reward manager returns rm_scores);
    it was refused as 'not converted'."""
    given = {
        "reward_model.enable": True,
        "reward_model.model.path": "/m/rm",
        "reward_model.micro_batch_size_per_gpu": 8,
    }
    assert {"reward.model.path=/m/rm", "reward.model.micro_batch_size=8"} <= set(convert(given).overrides())
    off = convert({"reward_model.enable": False, "reward_model.model.path": "/m/rm"})
    assert not [o for o in off.overrides() if o.startswith("reward.model")]
    assert "needs reward_model.model.path" in str(convert({"reward_model.enable": True}).unmapped)
