"""The README's main job, end to end: GRPO after an SFT warm start must visibly teach the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.demo import run_demo


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
