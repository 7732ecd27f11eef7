"""Asynchronous RL on Ray: a rollout pool of its own samples ahead of the trainer, within the staleness bound."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from posttrain.config.schema import RLConfig
from posttrain.controller.roles import Rollout
from posttrain.data import keys
from posttrain.data.batch import Batch
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


@pytest.mark.slow  # ~60 s on Ray; the bound is also checked without Ray in test_streaming.py
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
        # one step per batch: the update's own forward gives the old log-probs (no separate pass), the
        # off-policy gap to the behaviour log-probs and the importance weights against them
        assert "timing/old_log_prob" not in r
        assert "rollout/logprob_diff_mean" in r and "actor/rollout_is_mean" in r
        if r["async/staleness"] == 0:  # sampled with the weights being trained: no gap beyond numerics
            assert r["rollout/logprob_diff_max"] < 1e-4
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
        (
            [*SPLIT, "async_rl.staleness=2", "async_rl.sync_every=2", "trainer.val_every=3"],
            "trainer.val_every=3 is not a multiple of async_rl.sync_every=2",
        ),
        ([*SPLIT, "async_rl.staleness=1", "algorithm.dynamic_sampling=true"], "async_rl.streaming=true"),
        (["async_rl.streaming=true"], "streaming needs async_rl.staleness >= 1"),
        (["async_rl.stream_extra_groups=-1"], "stream_extra_groups must be >= 0"),
        (["async_rl.stream_extra_groups=2"], "used only with async_rl.streaming=true"),
        (
            [*SPLIT, "async_rl.staleness=2", "async_rl.streaming=true", "async_rl.stream_extra_groups=2"],
            "stream_extra_groups needs algorithm.dynamic_sampling=true",
        ),
        (
            [*SPLIT, "async_rl.staleness=1", "async_rl.streaming=true", "async_rl.deterministic=true"],
            "streaming does not support async_rl.deterministic",
        ),
        (
            [*SPLIT, "async_rl.staleness=1", "async_rl.streaming=true", "async_rl.partial_rollout=true"],
            "streaming does not support async_rl.partial_rollout",
        ),
        (
            [*SPLIT, "async_rl.staleness=1", "async_rl.streaming=true", "rollout.name=hf"],
            "streaming needs rollout.name=native",
        ),
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


STREAM_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] % 3 == 0:
        return 0.5  # every sample of these prompts scores the same: dynamic sampling must drop the group
    return float(len(solution_str) % 2)
"""


class RecordingTrainer(RLTrainer):
    """Records every trained batch; SIGKILLs the rollout worker once, after the batch of step `kill_after`."""

    kill_after = 1

    def __init__(self, cfg: RLConfig) -> None:
        super().__init__(cfg)
        self.trained: list[tuple[int, Batch]] = []
        self.killed: int | None = None

    def _async_step_batch(self, rollout: Rollout) -> tuple[Batch, dict[str, float]]:
        batch, metrics = super()._async_step_batch(rollout)
        self.trained.append((self.step_count, batch))
        if self.step_count == self.kill_after and self.killed is None:
            assert self.groups is not None and self.groups.rollout_pool is not None
            self.killed = int(self.groups.rollout_pool.ping()[0]["pid"])
            os.kill(self.killed, signal.SIGKILL)
        return batch, metrics


@pytest.mark.slow  # a Ray run of ~60 s (a rollout worker restarted on the way); the fast suite has test_streaming.py
def test_streaming_trains_complete_groups_within_the_bound_and_survives_a_killed_rollout_worker(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path, ray_cluster: None
) -> None:
    reward = tmp_path / "stream_reward.py"
    reward.write_text(STREAM_REWARD)
    run, k = tmp_path / "run", 1  # stop strings end responses at varied lengths (the tiny model rarely ends)
    cfg = rl_config(
        tiny_model_dir, arithmetic_data, run, *SPLIT, f"async_rl.staleness={k}", "async_rl.streaming=true",
        "async_rl.stream_extra_groups=2", "algorithm.dynamic_sampling=true", "algorithm.max_gen_rounds=8",
        "data.max_response_length=12", 'rollout.stop=["1","3"]', "trainer.total_steps=4", "trainer.save_every=2", "trainer.max_restarts=1",
        "trainer.threads_per_worker=1", f"reward.custom_function_path={reward}",
    )  # fmt: skip
    trainer = RecordingTrainer(cfg)
    trainer.fit()
    assert trainer.killed is not None
    metrics = [r for r in rows(run) if "async/staleness" in r]
    assert [r["step"] for r in metrics] == [1, 2, 3, 4]
    assert metrics[-1]["fault/rollout_restarts"] == 1.0, "the killed worker was restarted in place"
    assert all(r["fault/restarts"] == 0.0 for r in metrics), "no whole-run restart"
    seen: list[str] = []
    lengths: set[int] = set()
    for step, batch in trainer.trained:
        versions, mask = batch[keys.ROLLOUT_VERSIONS], batch[keys.RESPONSE_MASK]
        ages = step - versions.masked_fill(versions < 0, 1 << 30).min(dim=1).values
        assert bool(((ages >= 0) & (ages <= k)).all()), (step, ages)  # every trained sample, every step
        lengths |= set(mask.sum(-1).long().tolist())
        uids = list(dict.fromkeys(batch[keys.UID]))
        assert len(uids) == 4 and len(batch) == 16
        for uid in uids:  # only groups whose scores differ (those of index % 3 == 0 never do)
            scores = {s for u, s in zip(batch[keys.UID], batch[keys.SCORE], strict=True) if u == uid}
            assert len(scores) > 1, (step, uid)
        seen += uids
    assert len(seen) == len(set(seen)), "a group was trained twice"
    assert len(lengths) >= 2, "responses of varied lengths"
    for r in metrics:
        assert r["async/staleness_max"] <= k and r["async/time_to_batch_s"] >= 0
        assert r["async/groups_filtered"] >= 0 and r["async/groups_carried_over"] >= 0
    assert sum(r["async/groups_filtered"] for r in metrics) > 0
    state = torch.load(run / "step_4" / "trainer_state.pt", weights_only=False)
    assert set(state["dataloader"]) == {"epoch", "position", "settled"}
