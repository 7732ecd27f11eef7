"""Config loading: YAML defaults equal the schema, overrides apply, unknown keys and bad types are named."""

from __future__ import annotations

import pytest
import yaml

from posttrain.config.load import YAML_DIR, from_dict, load_config, to_dict
from posttrain.config.schema import RLConfig, SFTConfig
from posttrain.errors import ConfigError


@pytest.mark.parametrize(("name", "schema"), [("rl", RLConfig), ("sft", SFTConfig)])
def test_yaml_defaults_equal_schema_defaults(name: str, schema: type) -> None:
    on_disk = yaml.safe_load((YAML_DIR / f"{name}.yaml").read_text())
    on_disk.pop("defaults", None)
    assert on_disk == to_dict(schema())


def test_overrides_are_applied_and_typed() -> None:
    cfg = load_config(
        RLConfig,
        "rl",
        ["actor.optim.lr=0.5", "data.train_files=[a.parquet,b.parquet]", "trainer.n_workers_per_node=2"],
    )
    assert cfg.actor.optim.lr == 0.5
    assert cfg.data.train_files == ("a.parquet", "b.parquet")
    assert cfg.trainer.world_size == 2
    with pytest.raises(AttributeError):
        cfg.actor.optim.lr = 1.0  # type: ignore[misc]  (frozen)


def test_unknown_override_key_is_named_with_suggestion() -> None:
    with pytest.raises(
        ConfigError, match=r"unknown config key 'actor\.optim\.lrr'; did you mean 'actor\.optim\.lr'"
    ):
        load_config(RLConfig, "rl", ["actor.optim.lrr=0.1"])
    with pytest.raises(ConfigError, match=r"unknown config key 'trainr\.nnodes'; did you mean 'trainer'"):
        load_config(RLConfig, "rl", ["trainr.nnodes=2"])


def test_unknown_key_in_a_config_file_is_named() -> None:
    data = to_dict(RLConfig())
    data["rollout"]["temprature"] = 0.7
    with pytest.raises(
        ConfigError, match=r"unknown config key 'rollout\.temprature'; did you mean 'rollout\.temperature'"
    ):
        from_dict(RLConfig, data)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("actor.optim.lr=fast", "'actor.optim.lr' must be a number"),
        ("trainer.nnodes=1.5", "'trainer.nnodes' must be an integer"),
        ("actor.use_kl_loss=maybe", "'actor.use_kl_loss' must be true or false"),
        ("actor.optim.betas=[0.9]", "'actor.optim.betas' needs 2 values"),
        ("trainer.backend=slurm", "'trainer.backend' must be one of 'ray', 'local'; got 'slurm'"),
        ("actor.optim.lr_schedule=linear", "'actor.optim.lr_schedule' must be one of 'constant', 'cosine'"),
        ("data.overlong_prompts=truncate", "'data.overlong_prompts' must be one of 'filter', 'error'"),
        ("notakey", "not of the form key=value"),
    ],
)
def test_bad_values_are_named(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("[", r"\[")):
        load_config(RLConfig, "rl", [override])


@pytest.mark.parametrize(
    ("override", "new_key"),
    [
        ("actor.lr=1e-4", "actor.optim.lr"),
        ("actor.warmup_steps=3", "actor.optim.warmup_steps"),
        ("critic.lr=1e-4", "critic.optim.lr"),
        ("critic.grad_clip=2", "critic.optim.grad_clip"),
    ],
)
def test_moved_keys_name_their_new_place(override: str, new_key: str) -> None:
    old_key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"config key '{old_key}' has moved: use '{new_key}'"):
        load_config(RLConfig, "rl", [override])
    data = to_dict(RLConfig())
    data[old_key.split(".")[0]][old_key.split(".")[1]] = 1.0
    with pytest.raises(ConfigError, match=rf"'{old_key}' has moved: use '{new_key}'"):
        from_dict(RLConfig, data)


def test_critic_and_sft_have_their_own_optimizer_sections() -> None:
    cfg = load_config(RLConfig, "rl", ["critic.optim.lr_schedule=cosine", "critic.mini_batch_size=8"])
    assert cfg.critic.optim.lr_schedule == "cosine" and cfg.critic.mini_batch_size == 8
    assert cfg.actor.optim.lr_schedule == "constant"
    sft = load_config(SFTConfig, "sft", ["optim.eps=1e-6", "trainer.collective_timeout_s=60"])
    assert sft.optim.eps == 1e-6 and sft.optim.lr == 1e-3 and sft.trainer.collective_timeout_s == 60


def test_loss_options_are_unset_unless_given() -> None:
    """An unset loss option is None (the chosen loss's own default); a given one is a number; null unsets."""
    cfg = load_config(RLConfig, "rl", ["actor.policy_loss=sapo", "actor.tau_neg=2"])
    assert cfg.actor.tau_neg == 2.0 and isinstance(cfg.actor.tau_neg, float)
    assert cfg.actor.tau_pos is None and cfg.actor.clip_ratio_low is None and cfg.actor.loss_beta is None
    cfg = load_config(RLConfig, "rl", ["algorithm=dapo", "actor.clip_ratio_low=null"])
    assert cfg.actor.clip_ratio_low is None and cfg.actor.clip_ratio_high == 0.28
    with pytest.raises(ConfigError, match=r"'actor\.tau_pos' must be a number"):
        load_config(RLConfig, "rl", ["actor.tau_pos=warm"])
