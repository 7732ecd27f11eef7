"""The driver's half of asynchronous RL (`async_rl.staleness` >= 1): the producer it starts, the batch it takes
each step, and the weights it publishes after an update.

The producers themselves run on threads beside the loop: whole batches in trainers/async_rollout.py, groups as
they finish in trainers/streaming.py. What is here is the glue the RL trainer calls once per step, kept out of
trainers/rl.py so that the loop there reads as the steps of ARCHITECTURE.md: a batch older than the staleness
bound is dropped or regenerated here (`async_rl.on_stale`), and weights reach the pool every
`async_rl.sync_every` updates (with partial rollouts, between two chunks of a batch in flight).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

from posttrain.config.schema import AsyncRLConfig, RLConfig
from posttrain.controller.roles import ActorGroup, Rollout, RolloutGroup
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.data.dataloader import PromptDataLoader
from posttrain.rollout.base import SamplingParams
from posttrain.trainers.async_rollout import RolloutProducer, staleness_metrics, versions_column
from posttrain.trainers.rewarding import RewardStage
from posttrain.trainers.streaming import StreamingProducer

log = logging.getLogger(__name__)

Producer = RolloutProducer | StreamingProducer


def start_producer(
    cfg: RLConfig,
    rollout: Rollout,
    pool: RolloutGroup | None,
    loader: PromptDataLoader,
    sampling: SamplingParams,
    version: int,
    pad_id: int,
    decode: Callable[[list[int]], str],
    settled: list[str],
    ref_log_probs: Callable[[Batch], Batch] | None = None,
) -> Producer:
    """The producer of a (re)started run at policy version `version`: streaming on the rollout pool when
    `async_rl.streaming` (skipping the `settled` prompts a restored checkpoint names), else whole batches.
    `ref_log_probs`: the reference's log-probs of a sampled batch, computed on the producer thread before the
    trainer takes it (when the reference has workers of its own, `resources.ref`)."""
    async_rl = cfg.async_rl
    # after a (re)start the pool holds the actor's current weights: step 0's, or the resumed checkpoint's (the
    # resume syncs them), whatever sync_every; counting from the last multiple of sync_every ran the gate that
    # many batches ahead and dropped batches that were not stale
    start = version
    if async_rl.streaming and pool is not None:
        return StreamingProducer(cfg, pool, loader, sampling, start, pad_id, list(settled), ref_log_probs)
    return RolloutProducer(cfg, rollout, loader, sampling, start, pad_id, decode, ref_log_probs)


def take_batch(
    producer: Producer,
    cfg: RLConfig,
    rollout: Rollout,
    sampling: SamplingParams,
    version: int,
    rewards: RewardStage,
) -> tuple[Batch, dict[str, float]]:
    """The next batch the producer sampled ahead, scored here, for the update at policy version `version`."""
    async_rl = cfg.async_rl
    if isinstance(producer, StreamingProducer):  # trainers/streaming.py: scored as groups arrive
        batch, metrics = producer.take_batch(version, rewards.score)
        metrics.update(rewards.end_step())
        return batch, metrics
    metrics = {"async/dropped_samples": 0.0, "async/regenerated_samples": 0.0}
    while True:
        item, taken = producer.take(version)
        if version - item.version <= async_rl.staleness:
            batch = item.batch
            break
        rows = float(len(item.batch))
        if async_rl.on_stale == "regenerate":  # the same prompts, sampled with the newest weights
            producer.settle_weights()
            prompts = item.prompts.repeat(cfg.rollout.n, interleave=True)
            batch = rollout.sample(prompts, sampling).union(prompts.select(tensor_keys=[]))
            batch = batch.union(versions_column(batch, producer.published))
            metrics["async/regenerated_samples"] += rows
            taken["async/staleness"] = float(version - producer.published)
            break
        metrics["async/dropped_samples"] += rows
        log.warning("async: dropped a batch sampled at version %d at version %d", item.version, version)
    metrics.update(taken)
    metrics.update(staleness_metrics(batch, version, async_rl.staleness))
    batch = batch.union(rewards.score(batch))
    metrics["throughput/gen_tokens_total"] = float(batch[keys.RESPONSE_MASK].sum())
    metrics.update(rewards.end_step())
    return batch, metrics


def publish_weights(
    async_rl: AsyncRLConfig,
    version: int,
    actor: ActorGroup,
    pool: RolloutGroup | None,
    producer: Producer | None,
    sync_sampler: Callable[[], None],
    last: bool = False,
) -> dict[str, float]:
    """After the update that made policy version `version` (`last`: the run's final update, whose weights go
    to the sampler whatever `sync_every`, so the final validation samples the weights the run ends with):
    weights to the sampler (asynchronous: every
    `sync_every` updates). The trainer fetches them and hands them to the producer, which loads them into the
    pool between its generation calls (with partial rollouts, between two chunks; streaming, once the groups in
    flight end), so the trainer goes on at once. `sync_sampler` is the synchronous path (colocated, or no
    producer yet)."""
    if not async_rl.staleness:
        sync_sampler()
        return {}
    metrics = {"async/weight_sync_s": 0.0, "async/publish_wait_s": 0.0}
    if version % async_rl.sync_every and not last:
        return metrics
    if pool is None or producer is None:
        start = time.perf_counter()
        sync_sampler()
        metrics["async/weight_sync_s"] = time.perf_counter() - start
        return metrics
    if isinstance(producer, RolloutProducer):  # deterministic mode: the schedule's batches come first
        start = time.perf_counter()
        producer.wait_before_publish(version)
        metrics["async/publish_wait_s"] = time.perf_counter() - start
    start = time.perf_counter()
    weights = actor.rollout_weights()
    metrics["async/weight_sync_s"] = time.perf_counter() - start  # the fetch; the load is the producer's
    if isinstance(producer, StreamingProducer):  # loaded once the groups in flight end
        producer.hand_weights(version, weights)
    else:  # loaded before the producer's next generation call
        producer.hand_weights(version, functools.partial(pool.load_weights, weights))
    return metrics
