"""`posttrain dpo`'s YAML defaults equal DPOConfig's; list overrides of the loss reach the config."""

from __future__ import annotations

import yaml

from posttrain.config.load import YAML_DIR, load_config, to_dict
from posttrain.config.schema import DPOConfig


def test_dpo_yaml_defaults_equal_schema_defaults() -> None:
    assert yaml.safe_load((YAML_DIR / "dpo.yaml").read_text()) == to_dict(DPOConfig())


def test_loss_list_override() -> None:
    cfg = load_config(DPOConfig, "dpo", ["dpo.loss_type=[sigmoid,sft]", "dpo.loss_weights=[1.0,0.2]"])
    assert cfg.dpo.loss_type == ("sigmoid", "sft") and cfg.dpo.loss_weights == (1.0, 0.2)
