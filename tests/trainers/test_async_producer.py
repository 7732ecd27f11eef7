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
