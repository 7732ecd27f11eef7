"""The README's main job, end to end: GRPO after an SFT warm start must visibly teach the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.demo import run_demo


@pytest.mark.slow
def test_demo_raises_held_out_accuracy_by_30_points(tmp_path: Path, ray_cluster: None) -> None:
    summary = run_demo(tmp_path / "demo", n_workers=2)
    before, after = summary["before"]["val/acc"], summary["after_acc_last3"]
    assert before <= 0.45, f"the warm start must leave room to learn (before={before:.1%})"
    # measured +44 points over 300 steps from the 27% warm start (+32 after 200)
    assert after - before >= 0.30, f"accuracy {before:.1%} -> {after:.1%} (mean of the last 3 validations)"
    assert summary["train_reward_last5"] > summary["train_reward_first5"]
    assert summary["total_seconds"] < 15 * 60
