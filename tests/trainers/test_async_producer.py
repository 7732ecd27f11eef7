"""The whole-batch producer of asynchronous RL: weights handed over by the trainer are loaded by the producer
thread between its generation calls, so publishing never waits for a call in flight."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch

from posttrain.config.schema import RLConfig
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.rollout.base import SamplingParams
from posttrain.trainers.async_rollout import RolloutProducer
from tests.trainers.test_partial_rollout import Prompts, SlowPool


def producer_with(staleness: int, pool: SlowPool) -> RolloutProducer:
    cfg = RLConfig()
    cfg = replace(cfg, rollout=replace(cfg.rollout, n=1), async_rl=replace(cfg.async_rl, staleness=staleness))
    return RolloutProducer(cfg, pool, Prompts(), SamplingParams(max_tokens=4), 0, pad_id=0)  # type: ignore[arg-type]


def test_publishing_returns_at_once_and_the_load_follows_the_call_in_flight() -> None:
    """k=2: while batch 2 generates with version 0, the trainer hands version 1 over and goes on (batch 1 is
    ready to train); the producer loads it once batch 2's call ends, and batch 3 is sampled with it."""
    pool = SlowPool(delay_s=0.6)
    producer = producer_with(2, pool)
    loads: list[tuple[str, int]] = []  # (thread, generation calls ended before the load)
    try:
        producer.take(0)
        time.sleep(0.9)  # at ~1.5 s: batch 1 done (1.2 s), batch 2 in flight (until 1.8 s)
        start = time.perf_counter()
        producer.hand_weights(1, lambda: loads.append((threading.current_thread().name, len(pool.calls))))
        second, _ = producer.take(1)
        assert time.perf_counter() - start < 0.2, (
            "neither the hand-over nor batch 1 waited for batch 2's call"
        )
        assert second.version == 0 and second.index == 1
        third, _ = producer.take(2)
        fourth, metrics = producer.take(3)
        assert loads == [("rollout-producer", 3)], "loaded by the producer, after batches 0-2's calls"
        assert third.version == 0 and fourth.version == 1
        assert fourth.batch[keys.ROLLOUT_VERSIONS].unique().tolist() == [1]
        assert metrics["async/weight_load_s"] >= 0.0 and producer.published == 1
    finally:
        producer.stop()


def test_a_newer_hand_over_replaces_weights_not_loaded_yet() -> None:
    """Two versions handed over during one call: only the newer is loaded."""
    pool = SlowPool(delay_s=0.3)
    producer = producer_with(2, pool)
    loaded: list[int] = []
    try:
        producer.take(0)
        time.sleep(0.1)  # batch 1 in flight
        producer.hand_weights(1, lambda: loaded.append(1))
        producer.hand_weights(2, lambda: loaded.append(2))
        producer.settle_weights()
        assert loaded == [2] and producer.published == 2
    finally:
        producer.stop()


def test_a_failing_load_reaches_the_trainer() -> None:
    """A weight load that raises stops the producer; the trainer's next wait raises that error."""
    pool = SlowPool(delay_s=0.05)
    producer = producer_with(1, pool)

    def broken() -> None:
        raise RuntimeError("rollout rank 0 refused the weights")

    try:
        producer.take(0)
        producer.hand_weights(1, broken)
        with pytest.raises(RuntimeError, match="refused the weights"):
            producer.settle_weights()
    finally:
        producer.stop()


def test_the_producer_thread_adds_the_reference_log_probs() -> None:
    """With the reference on workers of its own, each batch reaches the trainer with `ref_log_prob` computed
    on the producer thread right after its generation call (timed as `async/ref_s`)."""
    threads: list[str] = []

    def ref_log_probs(batch: Batch) -> Batch:
        threads.append(threading.current_thread().name)
        time.sleep(0.05)
        return Batch.from_dict({keys.REF_LOG_PROB: -0.25 * batch[keys.RESPONSE_MASK]})

    cfg = RLConfig()
    cfg = replace(cfg, rollout=replace(cfg.rollout, n=1), async_rl=replace(cfg.async_rl, staleness=1))
    pool = SlowPool(delay_s=0.05)
    producer = RolloutProducer(cfg, pool, Prompts(), SamplingParams(max_tokens=4), 0, 0, str, ref_log_probs)  # type: ignore[arg-type]
    try:
        for version in range(2):
            item, metrics = producer.take(version)
            assert torch.equal(item.batch[keys.REF_LOG_PROB], -0.25 * item.batch[keys.RESPONSE_MASK])
            assert metrics["async/ref_s"] >= 0.05 and item.ref_seconds >= 0.05
            producer.hand_weights(version + 1, lambda: None)
    finally:
        producer.stop()
    assert threads and set(threads) == {"rollout-producer"}


class VersionPool:
    """A rollout pool whose rows record the weights version that sampled them."""

    world_size = 1

    def __init__(self, version: int) -> None:
        self.version = version

    def load_weights(self, weights: dict) -> dict:
        self.version = weights["v"]
        return {}

    def sample(self, rows: Batch, sampling: SamplingParams) -> Batch:
        b, r = len(rows), sampling.max_tokens
        tensors = {
            keys.RESPONSES: torch.zeros(b, r, dtype=torch.long),
            keys.RESPONSE_MASK: torch.ones(b, r),
            keys.ROLLOUT_LOG_PROBS: torch.zeros(b, r),
        }
        return Batch.from_dict(tensors, {"sampled_with": [self.version] * b})


class ZeroRewards:
    def score(self, batch: Batch) -> Batch:
        scores = torch.zeros(len(batch), 4)
        return Batch.from_dict({keys.TOKEN_LEVEL_SCORES: scores}, {keys.SCORE: [0.0] * len(batch)})

    def end_step(self) -> dict[str, float]:
        return {}


@pytest.mark.parametrize("resumed_at", [0, 3])
def test_a_resume_between_two_weight_syncs_drops_nothing_that_is_not_stale(resumed_at: int) -> None:
    """k=2, sync_every=2, resumed at step 3: the pool holds the checkpoint's weights (version 3), and the
    producer counts from there; it used to count from version 2 and drop fresh batches as too old."""
    from posttrain.data.dataloader import PromptDataLoader
    from posttrain.data.dataset import collate_prompts
    from posttrain.trainers.async_driver import publish_weights, start_producer, take_batch

    cfg = RLConfig()
    cfg = replace(
        cfg,
        rollout=replace(cfg.rollout, n=2),
        data=replace(cfg.data, train_batch_prompts=2),
        async_rl=replace(cfg.async_rl, staleness=2, sync_every=2),
    )
    items = [
        {"input_ids": [1, 2, 3], "data_source": "x", "ground_truth": "1", "extra_info": {}, "raw_prompt": "p",
         "messages": [], "index": i}
        for i in range(100)
    ]  # fmt: skip
    loader = PromptDataLoader(items, 2, lambda it, uids: collate_prompts(it, 0, uids), shuffle=False)
    loader.load_state_dict({"epoch": 0, "position": resumed_at})
    sampling = SamplingParams(max_tokens=4, temperature=1.0)
    pool = VersionPool(resumed_at)  # the resume's sync_sampler: the checkpoint's weights in the pool
    actor = type("Actor", (), {"rollout_weights": lambda self: {"v": self.version}})()
    actor.version = resumed_at
    producer = start_producer(cfg, pool, pool, loader, sampling, resumed_at, 0, str, [])  # type: ignore[arg-type]
    try:
        for step in range(resumed_at, resumed_at + 6):
            time.sleep(0.05)  # the producer runs ahead as far as its gate lets it
            batch, metrics = take_batch(producer, cfg, pool, sampling, step, ZeroRewards())  # type: ignore[arg-type]
            assert metrics["async/dropped_samples"] == 0.0, step
            true_staleness = step - min(batch["sampled_with"])
            assert true_staleness <= 2 and metrics["async/staleness"] == true_staleness, step
            actor.version = step + 1  # the update
            publish_weights(cfg.async_rl, step + 1, actor, pool, producer, lambda: None)  # type: ignore[arg-type]
    finally:
        producer.stop()


def test_the_runs_last_weights_reach_the_sampler_whatever_sync_every() -> None:
    """sync_every=2 and a run of 3 steps: the final validation samples version 3, not the synced 2."""
    from posttrain.data.dataloader import PromptDataLoader
    from posttrain.data.dataset import collate_prompts
    from posttrain.trainers.async_driver import publish_weights, start_producer

    cfg = RLConfig()
    cfg = replace(
        cfg, rollout=replace(cfg.rollout, n=1), async_rl=replace(cfg.async_rl, staleness=2, sync_every=2)
    )
    items = [
        {"input_ids": [1, 2], "data_source": "x", "ground_truth": "1", "extra_info": {}, "raw_prompt": "p",
         "messages": [], "index": i}
        for i in range(100)
    ]  # fmt: skip
    loader = PromptDataLoader(items, 2, lambda it, uids: collate_prompts(it, 0, uids), shuffle=False)
    pool = VersionPool(2)
    actor = type("Actor", (), {"rollout_weights": lambda self: {"v": 3}})()
    producer = start_producer(cfg, pool, pool, loader, SamplingParams(max_tokens=2), 2, 0, str, [])  # type: ignore[arg-type]
    try:
        publish_weights(cfg.async_rl, 3, actor, pool, producer, lambda: None)  # type: ignore[arg-type]
        producer.settle_weights()
        assert pool.version == 2  # between two syncs: nothing handed over
        publish_weights(cfg.async_rl, 3, actor, pool, producer, lambda: None, last=True)  # type: ignore[arg-type]
        producer.settle_weights()
        assert pool.version == 3
    finally:
        producer.stop()


@pytest.mark.parametrize(("sync_every", "expected"), [(1, [0, 0, 0, 1, 2, 3]), (2, [0, 0, 0, 2, 2, 4])])
def test_the_deterministic_schedule_follows_the_versions_handed_over(
    sync_every: int, expected: list[int]
) -> None:
    """k=2: batch i samples the newest handed version at or below i - k. With weights every 2 updates the
    versions 1, 3 never reach the pool: waiting for batch `version + k - 1` (sampled with version - 1) would
    wait forever."""
    from posttrain.trainers.async_driver import publish_weights

    cfg = RLConfig()
    cfg = replace(
        cfg,
        rollout=replace(cfg.rollout, n=1),
        async_rl=replace(cfg.async_rl, staleness=2, sync_every=sync_every, deterministic=True),
    )
    producer = RolloutProducer(
        cfg, SlowPool(delay_s=0.01), Prompts(), SamplingParams(max_tokens=4), 0, pad_id=0
    )  # type: ignore[arg-type]

    class Actor:
        def rollout_weights(self) -> dict:
            return {}

    class Pool:
        def load_weights(self, weights: dict) -> dict:
            return {}

    versions: list[int] = []
    done = threading.Event()

    def train() -> None:
        for version in range(len(expected)):
            item, _ = producer.take(version)
            versions.append(item.version)
            publish_weights(cfg.async_rl, version + 1, Actor(), Pool(), producer, lambda: None)  # type: ignore[arg-type]
        done.set()

    trainer = threading.Thread(target=train, daemon=True)
    try:
        trainer.start()
        assert done.wait(timeout=30), f"the trainer stopped after the versions {versions}"
        assert versions == expected
    finally:
        producer.stop()


def test_stale_samples_without_a_rollout_correction_are_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from posttrain.trainers.async_rollout import check_async_config

    cfg = RLConfig()
    split = replace(cfg.resources, rollout="gen")
    uncorrected = replace(cfg, resources=split, async_rl=replace(cfg.async_rl, staleness=2))
    with caplog.at_level("WARNING"):
        check_async_config(uncorrected)
    assert "async_rl.staleness=2 without a rollout correction" in caplog.text
    caplog.clear()
    corrected = replace(
        uncorrected,
        algorithm=replace(
            cfg.algorithm, rollout_correction=replace(cfg.algorithm.rollout_correction, rollout_is="token")
        ),
    )
    with caplog.at_level("WARNING"):
        check_async_config(corrected)
    assert "rollout correction" not in caplog.text
    # bypass mode with the REINFORCE loss and no IS weights: nothing corrects the staleness either
    reinforce = replace(
        cfg.algorithm.rollout_correction, bypass_mode=True, loss_type="reinforce", rollout_is=None
    )
    with caplog.at_level("WARNING"):
        check_async_config(
            replace(uncorrected, algorithm=replace(cfg.algorithm, rollout_correction=reinforce))
        )
    assert "async_rl.staleness=2 without a rollout correction" in caplog.text


def test_no_batch_is_generated_past_the_runs_last_step_and_the_final_weights_still_load() -> None:
    cfg = RLConfig()
    cfg = replace(
        cfg,
        rollout=replace(cfg.rollout, n=1),
        async_rl=replace(cfg.async_rl, staleness=2),
        trainer=replace(cfg.trainer, total_steps=3),
    )
    pool = SlowPool(delay_s=0.01)
    producer = RolloutProducer(cfg, pool, Prompts(), SamplingParams(max_tokens=4), 0, pad_id=0)  # type: ignore[arg-type]
    loaded: list[int] = []
    try:
        for version in range(3):
            producer.take(version)
        time.sleep(0.3)  # time enough for more batches, were they made
        assert len(pool.calls) == 3, "batches 0-2 only: the run trains 3 steps"
        producer.hand_weights(3, lambda: loaded.append(3))  # the final weights, for the last validation
        producer.settle_weights()
        assert loaded == [3] and producer.published == 3
    finally:
        producer.stop()
