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
        ["actor.lr=0.5", "data.train_files=[a.parquet,b.parquet]", "trainer.n_workers_per_node=2"],
    )
    assert cfg.actor.lr == 0.5
    assert cfg.data.train_files == ("a.parquet", "b.parquet")
    assert cfg.trainer.world_size == 2
    with pytest.raises(AttributeError):
        cfg.actor.lr = 1.0  # type: ignore[misc]  (frozen)


def test_unknown_override_key_is_named_with_suggestion() -> None:
    with pytest.raises(ConfigError, match=r"unknown config key 'actor\.lrr'; did you mean 'actor\.lr'"):
        load_config(RLConfig, "rl", ["actor.lrr=0.1"])
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
        ("actor.lr=fast", "'actor.lr' must be a number"),
        ("trainer.nnodes=1.5", "'trainer.nnodes' must be an integer"),
        ("actor.use_kl_loss=maybe", "'actor.use_kl_loss' must be true or false"),
        ("actor.betas=[0.9]", "'actor.betas' needs 2 values"),
        ("notakey", "not of the form key=value"),
    ],
)
def test_bad_values_are_named(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("[", r"\[")):
        load_config(RLConfig, "rl", [override])
