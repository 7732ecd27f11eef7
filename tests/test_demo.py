"""The README's main job, end to end: GRPO after an SFT warm start must visibly teach the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.config.load import load_config
from posttrain.config.schema import RLConfig, SFTConfig
from posttrain.demo import RL_OVERRIDES, SFT_OVERRIDES, run_demo


def test_the_demo_stages_configs_load_and_the_rl_stage_survives_a_dead_worker(tmp_path: Path) -> None:
    """Every embedded override is a real key (unknown ones fail to load), and a rank lost mid-run (one CI
    machine's fate at step ~265 of 300) restarts from the last checkpoint instead of failing the demo."""
    sft = load_config(SFTConfig, "sft", [f"model.path={tmp_path}", *SFT_OVERRIDES])
    assert sft.optim.lr_schedule == "constant" and sft.trainer.stop_at_val_nll == 0.7
    rl = load_config(RLConfig, "rl", [f"model.path={tmp_path}", *RL_OVERRIDES])
    assert rl.trainer.max_restarts >= 1
    assert rl.trainer.collective_timeout_s <= 300, "a hung collective must cost minutes, not the CI budget"
    assert 0 < rl.trainer.save_every <= 20, "a restart redoes at most the steps since the last checkpoint"


@pytest.mark.slow
def test_demo_raises_held_out_accuracy(tmp_path: Path, ray_cluster: None) -> None:
    summary = run_demo(tmp_path / "demo", n_workers=2)
    before, after = summary["before"]["val/acc"], summary["after_acc_last3"]
    assert before <= 0.45, f"the warm start must leave room to learn (before={before:.1%})"
    # The gain depends on the warm start and on the machine's numerics: +19.3 points (24.2% -> 43.5%, last-3 mean)
    # in the clean-clone CI run of b937802 (cosine SFT recipe), +38.5 (21.9% -> 60.4%) with the constant-lr
    # recipe of 392b9b8 on an AMD EPYC. The bound is about half the lowest measured gain: GRPO must visibly teach.
    assert after - before >= 0.10, f"accuracy {before:.1%} -> {after:.1%} (mean of the last 3 validations)"
    assert summary["train_reward_last5"] > summary["train_reward_first5"]
