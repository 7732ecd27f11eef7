"""Asynchronous RL: the rollout pool generates the batches of steps t+1..t+k while the trainer updates on t.

`async_rl.staleness` = k. With k = 0 the trainer runs its synchronous loop (this module is not used). With
k >= 1 a producer thread draws prompts and samples them on the rollout pool (split placement: generation
has workers of its own), and the trainer takes the batches in order, scores them, and trains. Weights reach
the pool after each update (or every `async_rl.sync_every` updates) through the same path as synchronous
split placement (`RolloutGroup.load_weights`); the pool's worker runs one call at a time, so new weights
are picked up between generation calls, never within one.

Correct by construction (the one-step-off-policy scheme of verl, generalised to k steps):
- the policy version is the number of updates applied; a batch records the version of the weights that were
  in the pool when its generation was submitted (read before submitting, so a late weight load can only make
  the recorded version older than the true one: staleness is never under-reported);
- the generation of batch i (trained at version i) starts only once version >= i - k is in the pool, so at
  update time staleness = i - version_sampled <= k. A batch older than k versions all the same (possible
  only if weights were not published, e.g. `sync_every` > 1 with the gate of a past version) is dropped and
  counted or regenerated with the current weights (`async_rl.on_stale`);
- the off-policy gap is corrected by the rollout-correction modes (`algorithm.rollout_correction`): the
  behaviour log-probs are the rollout's, the old ones are recomputed by the actor before each update.

Runs with k >= 1 are not bit-reproducible by default: which version a batch is sampled with depends on
timing (a slow producer samples later, with newer weights). `async_rl.deterministic` fixes the schedule:
the trainer publishes version v only after batch v + k - 1 (the last one due to be sampled with version
v - 1) was generated, so batch i is sampled with exactly version max(0, i - k) (the trainer may wait for the producer; validation's sampling,
which shares the pool's random stream, must be greedy or off for a run to repeat exactly).

Checkpoints record the dataloader position after the last trained batch, so prompts drawn for batches not
trained yet are drawn again after a resume.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from posttrain.config.schema import RLConfig
from posttrain.controller.roles import Rollout
from posttrain.data.batch import Batch
from posttrain.data.dataloader import PromptDataLoader
from posttrain.errors import ConfigError
from posttrain.rollout.base import SamplingParams

log = logging.getLogger(__name__)

# settings the asynchronous loop does not take: refused, never silently ignored
_UNSUPPORTED: dict[str, Callable[[RLConfig], bool]] = {
    "algorithm.dynamic_sampling": lambda c: c.algorithm.dynamic_sampling,
    "algorithm.adv_estimator=remax": lambda c: c.algorithm.adv_estimator == "remax",
    "agent.enable": lambda c: c.agent.enable,
    "algorithm.critic_warmup > 0": lambda c: c.algorithm.critic_warmup > 0,
}


def check_async_config(cfg: RLConfig) -> None:
    a = cfg.async_rl
    if a.staleness < 0:
        raise ConfigError(f"async_rl.staleness must be >= 0, got {a.staleness}")
    if a.sync_every < 1:
        raise ConfigError(f"async_rl.sync_every must be >= 1, got {a.sync_every}")
    if a.staleness == 0:
        if a.sync_every != 1:
            raise ConfigError(
                "async_rl.sync_every > 1 needs async_rl.staleness >= 1 (the synchronous loop syncs every step)"
            )
        return
    if a.sync_every > a.staleness:
        raise ConfigError(
            f"async_rl.sync_every={a.sync_every} > staleness={a.staleness}: batches would always be too old"
        )
    if cfg.resources.rollout == "trainer":
        raise ConfigError(
            "async_rl.staleness >= 1 needs the rollout on a pool of its own (the colocated engine shares the "
            "trainer's workers): resources.rollout=gen +resources.pools.gen.n_workers_per_node=1"
        )
    for name, used in _UNSUPPORTED.items():
        if used(cfg):
            raise ConfigError(f"async_rl.staleness >= 1 does not support {name} yet")


@dataclass
class Rollouts:
    """One step's sampled (not yet scored) rows."""

    prompts: Batch  # the step's prompt rows (before repeating n times)
    batch: Batch
    index: int  # the step (0-based) this batch was drawn for
    version: int  # policy version of the weights in the pool when its generation was submitted
    loader_after: dict[str, int]  # the dataloader's state after its prompts were drawn
    seconds: float  # generation time


class RolloutProducer:
    """The producer thread (see the module docstring). `take` hands batches to the trainer in order."""

    def __init__(
        self,
        cfg: RLConfig,
        rollout: Rollout,
        loader: PromptDataLoader,
        sampling: SamplingParams,
        start_version: int,
    ) -> None:
        self.k = cfg.async_rl.staleness
        self.deterministic = cfg.async_rl.deterministic
        self.n = cfg.rollout.n
        self.rollout, self.loader, self.sampling = rollout, loader, sampling
        self.published = start_version  # version of the weights in the pool
        self.first_index = start_version  # batch i is trained at version i
        self.trained_loader_state = loader.state_dict()
        self._ready: collections.deque[Rollouts] = collections.deque()
        self._cond = threading.Condition()
        self._stop = False
        self._produced = start_version  # batches generated so far (the last one's index + 1)
        self._error: BaseException | None = None
        self._idle = 0.0  # producer seconds waiting for the version gate (since the last take)
        self._busy = 0.0
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self._thread.start()

    # ---- producer side -------------------------------------------------------------------------
    def _run(self) -> None:
        index = self.first_index
        try:
            while True:
                waited = time.perf_counter()
                with self._cond:
                    # gate: batch `index` trains at version `index`; its weights must be >= index - k
                    while not self._stop and self.published < index - self.k:
                        self._cond.wait(timeout=1.0)
                    if self._stop:
                        return
                    version = self.published
                    self._idle += time.perf_counter() - waited
                start = time.perf_counter()
                prompts = self.loader.next_batch()
                loader_after = self.loader.state_dict()
                batch = self.rollout.sample(prompts.repeat(self.n, interleave=True), self.sampling)
                batch = batch.union(prompts.repeat(self.n, interleave=True).select(tensor_keys=[]))
                seconds = time.perf_counter() - start
                with self._cond:
                    self._busy += seconds
                    self._ready.append(Rollouts(prompts, batch, index, version, loader_after, seconds))
                    self._produced = index + 1
                    self._cond.notify_all()
                index += 1
        except BaseException as exc:  # handed to the trainer at its next take
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    # ---- trainer side --------------------------------------------------------------------------
    def publish(self, version: int) -> None:
        """The pool now holds the weights of `version` (called after `load_weights` returned)."""
        with self._cond:
            self.published = version
            self._cond.notify_all()

    def wait_before_publish(self, version: int) -> None:
        """Deterministic mode: block until every batch due to be sampled with the previous version (up to
        index version + k - 1) has been generated; a no-op otherwise."""
        if not self.deterministic:
            return
        with self._cond:
            while self._produced < version + self.k and self._error is None and not self._stop:
                self._cond.wait(timeout=1.0)

    def take(self, version: int) -> tuple[Rollouts, dict[str, float]]:
        """The next batch for the trainer at `version`; waits for it. Metrics: staleness, idle shares."""
        start = time.perf_counter()
        with self._cond:
            while not self._ready and self._error is None:
                self._cond.wait(timeout=1.0)
            if self._error is not None and not self._ready:
                raise self._error
            item = self._ready.popleft()
            self._cond.notify_all()
            idle, busy = self._idle, self._busy
            self._idle = self._busy = 0.0
        waited = time.perf_counter() - start
        self.trained_loader_state = item.loader_after
        metrics = {
            "async/trainer_wait_s": waited,
            "async/rollout_idle_share": idle / (idle + busy) if idle + busy > 0 else 0.0,
            "async/gen_seconds": item.seconds,
            "async/staleness": float(version - item.version),
            "async/queued": float(len(self._ready)),
        }
        return item, metrics

    def stop(self) -> None:
        """Stop the thread (its generation call in flight finishes first); the loader goes back to the
        position after the last trained batch, so untrained prompts are drawn again."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()
        self.loader.load_state_dict(self.trained_loader_state)
        self._ready.clear()


class TrainedLoaderState:
    """The dataloader's part of a checkpoint under asynchronous RL: the position after the last trained
    batch (the producer has drawn further ahead)."""

    def __init__(self, loader: PromptDataLoader, producer: RolloutProducer | None) -> None:
        self.loader, self.producer = loader, producer

    def state_dict(self) -> dict[str, Any]:
        if self.producer is None:
            return self.loader.state_dict()
        return dict(self.producer.trained_loader_state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)
