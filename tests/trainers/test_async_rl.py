"""Asynchronous RL on Ray: a rollout pool of its own samples ahead of the trainer, within the staleness bound."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from posttrain.errors import ConfigError
from posttrain.trainers.rl import RLTrainer
from tests.trainers.test_rl_e2e import reward_file, rl_config

SPLIT = [
    "trainer.backend=ray",
    "resources.rollout=gen",
    "+resources.pools.gen.n_workers_per_node=1",
    "trainer.val_every=0",
    "trainer.val_before_train=false",
]


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_rollouts_run_one_step_ahead_within_the_bound(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path, ray_cluster: None
) -> None:
    run = tmp_path / "run"
    cfg = rl_config(
        tiny_model_dir, arithmetic_data, run, *SPLIT, "async_rl.staleness=1", "trainer.total_steps=4",
        "trainer.save_every=2", "algorithm.rollout_correction.rollout_is=token", reward_file(tmp_path),
    )  # fmt: skip
    trainer = RLTrainer(cfg)
    trainer.fit()
    train = [r for r in rows(run) if "async/staleness" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    staleness = [r["async/staleness"] for r in train]
    assert all(0 <= s <= 1 for s in staleness), staleness
    assert staleness[0] == 0, "the first batch is sampled with the initial weights"
    assert max(staleness) == 1, "later batches were sampled while the previous step trained"
    for r in train:
        assert r["async/dropped_samples"] == 0.0
        assert r["async/staleness_max"] == r["async/staleness"], (
            "one version per batch without partial rollouts"
        )
        assert r["async/staleness_count_0"] + r["async/staleness_count_1"] == 16.0  # 4 prompts x 4 samples
        assert r["async/weight_sync_s"] > 0 and r["async/publish_wait_s"] >= 0
        assert 0.0 <= r["async/trainer_idle_share"] <= 1.0 and 0.0 <= r["async/rollout_idle_share"] <= 1.0
        assert "rollout/logprob_diff_mean" in r, (
            "old log-probs are recomputed: the off-policy gap is measured"
        )
        assert r["actor/grad_norm"] > 0  # the reward file's scores vary within groups
    # the producer drew prompts ahead; the checkpoint and the loader stand after the last trained batch
    assert trainer.loader.state_dict() == {"epoch": 0, "position": 4}
    state = torch.load(run / "step_4" / "trainer_state.pt", weights_only=False)
    assert state["dataloader"] == {"epoch": 0, "position": 4}

    # resumed: the producer restarts from the trained state and the run continues at step 5
    resumed = RLTrainer(rl_config(tiny_model_dir, arithmetic_data, run, *SPLIT, "async_rl.staleness=1",
                                  "trainer.total_steps=5", reward_file(tmp_path)))  # fmt: skip
    resumed.fit()
    steps = [r["step"] for r in rows(run) if "async/staleness" in r]
    assert steps == [1, 2, 3, 4, 5] and resumed.loader.state_dict() == {"epoch": 0, "position": 5}


@pytest.mark.slow  # a Ray run of ~90 s; the fast suite keeps the k=1 run above
def test_partial_rollouts_train_no_token_older_than_the_bound(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path, ray_cluster: None
) -> None:
    run = tmp_path / "run"
    cfg = rl_config(
        tiny_model_dir, arithmetic_data, run, *SPLIT, "async_rl.staleness=1", "async_rl.partial_rollout=true",
        "async_rl.partial_chunk_tokens=2", "trainer.total_steps=4", "trainer.save_every=0",
        "algorithm.rollout_correction.rollout_is=token", reward_file(tmp_path),
    )  # fmt: skip
    trainer = RLTrainer(cfg)
    trainer.fit()
    train = [r for r in rows(run) if "async/staleness_max" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for r in train:
        # staleness of a sample = trainer version - the oldest version among its tokens
        assert 0 <= r["async/staleness_max"] <= 1, r
        assert r["async/staleness_count_0"] + r["async/staleness_count_1"] == 16.0
        assert r["async/token_staleness_mean"] <= r["async/staleness_mean"] + 1e-9
        assert 0 <= r["async/mixed_version_samples"] <= 16
        assert r["async/dropped_samples"] == 0.0 and r["async/weight_sync_s"] > 0
        assert "rollout/logprob_diff_mean" in r and r["actor/grad_norm"] > 0
    assert train[0]["async/staleness_max"] == 0


@pytest.mark.slow
def test_the_deterministic_schedule_repeats_exactly(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path, ray_cluster: None
) -> None:
    runs = []
    for attempt in range(2):
        run = tmp_path / f"run{attempt}"
        cfg = rl_config(
            tiny_model_dir, arithmetic_data, run, *SPLIT, "async_rl.staleness=2", "async_rl.deterministic=true",
            "trainer.total_steps=5", "trainer.save_every=0", reward_file(tmp_path),
        )  # fmt: skip
        RLTrainer(cfg).fit()
        runs.append([r for r in rows(run) if "async/staleness" in r])
    first, second = runs
    assert [r["async/staleness"] for r in first] == [0, 1, 2, 2, 2], (
        "batch i sampled with version max(0, i-2)"
    )
    for a, b in zip(first, second, strict=True):
        for key in ("reward/mean", "actor/grad_norm", "actor/pg_loss", "rollout/logprob_diff_mean"):
            assert a[key] == b[key], (key, a["step"])


@pytest.mark.parametrize(
    "extra, message",
    [
        (["async_rl.staleness=1", "trainer.backend=ray"], "pool of its own"),
        (["async_rl.staleness=-1"], "staleness must be >= 0"),
        (["async_rl.sync_every=2"], "needs async_rl.staleness >= 1"),
        ([*SPLIT, "async_rl.staleness=1", "async_rl.sync_every=2"], "batches would always be too old"),
        ([*SPLIT, "async_rl.staleness=1", "algorithm.dynamic_sampling=true"], "dynamic_sampling"),
        (["async_rl.partial_rollout=true"], "partial_rollout needs async_rl.staleness >= 1"),
        (["async_rl.partial_chunk_tokens=0"], "partial_chunk_tokens must be >= 1"),
        (
            [*SPLIT, "async_rl.staleness=1", "async_rl.partial_rollout=true", "async_rl.deterministic=true"],
            "partial_rollout does not support async_rl.deterministic",
        ),
        (
            [*SPLIT, "async_rl.staleness=1", "async_rl.partial_rollout=true", "rollout.stop=[Answer]"],
            "partial_rollout does not support rollout.stop",
        ),
    ],
)
def test_settings_that_cannot_work_are_refused(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path, extra: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        RLTrainer(rl_config(tiny_model_dir, arithmetic_data, tmp_path / "run", *extra))
