"""Asynchronous RL: the rollout pool generates the batches of steps t+1..t+k while the trainer updates on t.

`async_rl.staleness` = k. With k = 0 the trainer runs its synchronous loop (this module is not used). With
k >= 1 a producer thread draws prompts and samples them on the rollout pool (split placement: generation
has workers of its own), and the trainer takes the batches in order, scores them, and trains. Weights reach
the pool after each update (or every `async_rl.sync_every` updates) through the same path as synchronous
split placement (`RolloutGroup.load_weights`); the pool's worker runs one call at a time, so new weights
are picked up between generation calls: between batches, or between the chunks of one batch with
`async_rl.partial_rollout` (trainers/partial_rollout.py: unfinished responses continue under the new weights,
each token tagged with its version). The trainer hands its new weights to the producer and goes on; the
producer thread loads them into the pool before its next generation call (a newer hand-over replaces weights
not loaded yet), so a weight load and a generation call never overlap and the version recorded for a call
is exactly the one that sampled it, and the trainer never waits for a generation call in flight to end
before it can publish (it used to: with k >= 2 it then stood idle beside a batch it could train).

Correct by construction (the one-step-off-policy scheme of verl, generalised to k steps):
- the policy version is the number of updates applied; every response token records the version that
  sampled it (`rollout_versions`), a batch its oldest (the version its generation started with);
- the generation of batch i (trained at version i) starts only once version >= i - k is in the pool, so at
  update time staleness = i - oldest version <= k (later chunks of a partial rollout are only newer). A batch older than k versions all the same (possible
  only if weights were not published, e.g. `sync_every` > 1 with the gate of a past version) is dropped and
  counted or regenerated with the current weights (`async_rl.on_stale`);
- the off-policy gap is corrected by the rollout-correction modes (`algorithm.rollout_correction`): the
  behaviour log-probs are the rollout's; the old ones are the update's own when there is one step per batch
  (`actor.reuse_log_probs_on_policy`), else recomputed by the actor before the update.

Runs with k >= 1 are not bit-reproducible by default: which version a batch is sampled with depends on
timing (a slow producer samples later, with newer weights). `async_rl.deterministic` fixes the schedule:
the trainer hands version v over only after every batch that the previous handed version h may sample
(up to index h + k) was generated with it, so batch i is sampled with exactly version max(0, i - k) (with
`sync_every` = s: the newest multiple of s at or below i - k) (the trainer may wait for the producer; validation's sampling,
which shares the pool's random stream, must be greedy or off for a run to repeat exactly).

With the reference on workers of its own (`resources.ref`, e.g. the rollout's pool), the producer thread also
computes each batch's reference log-probs right after sampling it, so that forward pass runs beside the
trainer's update instead of in it (`async/ref_s`).

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
from typing import Any, Generic, Protocol, TypeVar

import torch

from posttrain.config.schema import RLConfig
from posttrain.controller.roles import Rollout
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.data.dataloader import PromptDataLoader
from posttrain.errors import ConfigError
from posttrain.rollout.base import SamplingParams
from posttrain.trainers.generation import sample_rows
from posttrain.trainers.partial_rollout import sample_in_chunks

log = logging.getLogger(__name__)

# settings the asynchronous loop does not take: refused, never silently ignored
_UNSUPPORTED: dict[str, Callable[[RLConfig], bool]] = {
    # the whole-batch producer cannot filter groups as they arrive: streaming does
    "algorithm.dynamic_sampling (set async_rl.streaming=true)": lambda c: (
        c.algorithm.dynamic_sampling and not c.async_rl.streaming
    ),
    "algorithm.adv_estimator=remax": lambda c: c.algorithm.adv_estimator == "remax",
    "agent.enable": lambda c: c.agent.enable,
    "algorithm.critic_warmup > 0": lambda c: c.algorithm.critic_warmup > 0,
}
# ... and with async_rl.streaming (trainers/streaming.py)
_UNSUPPORTED_STREAMING: dict[str, Callable[[RLConfig], bool]] = {
    # the arrival order of groups depends on timing: no fixed schedule
    "async_rl.deterministic": lambda c: c.async_rl.deterministic,
    # the pool takes weights only between groups; a group is never split into chunks
    "async_rl.partial_rollout": lambda c: c.async_rl.partial_rollout,
    # groups are queued on the engine's asynchronous request API (continuous batching)
    "rollout.name other than native (streaming needs rollout.name=native: the built-in engine's asynchronous requests)": lambda c: (
        c.rollout.name != "native"
    ),
}
# ... and with async_rl.partial_rollout
_UNSUPPORTED_PARTIAL: dict[str, Callable[[RLConfig], bool]] = {
    # the chunk versions depend on when the trainer publishes: no fixed schedule
    "async_rl.deterministic": lambda c: c.async_rl.deterministic,
    # a stop string split across two chunks would be missed
    "rollout.stop (stop strings)": lambda c: bool(c.rollout.stop),
}


def check_async_config(cfg: RLConfig) -> None:
    a = cfg.async_rl
    if a.staleness < 0:
        raise ConfigError(f"async_rl.staleness must be >= 0, got {a.staleness}")
    if a.sync_every < 1:
        raise ConfigError(f"async_rl.sync_every must be >= 1, got {a.sync_every}")
    if a.partial_chunk_tokens < 1:
        raise ConfigError(f"async_rl.partial_chunk_tokens must be >= 1, got {a.partial_chunk_tokens}")
    if a.stream_extra_groups < 0:
        raise ConfigError(f"async_rl.stream_extra_groups must be >= 0, got {a.stream_extra_groups}")
    if a.stream_extra_groups and not a.streaming:
        raise ConfigError("async_rl.stream_extra_groups is used only with async_rl.streaming=true")
    if a.stream_extra_groups and not cfg.algorithm.dynamic_sampling:
        raise ConfigError(
            "async_rl.stream_extra_groups needs algorithm.dynamic_sampling=true: extra groups replace those the "
            "filter drops. Without it every step trains exactly data.train_batch_prompts groups, the groups "
            "in flight already fill the staleness window, and each step that many extra groups go stale "
            "(dropped or regenerated, the slowest ones first: the long responses are the ones never trained)"
        )
    if a.staleness == 0:
        if a.streaming:
            raise ConfigError(
                "async_rl.streaming needs async_rl.staleness >= 1 (the synchronous loop trains each step's own "
                "batch)"
            )
        if a.partial_rollout:
            raise ConfigError(
                "async_rl.partial_rollout needs async_rl.staleness >= 1 (weights change only between steps "
                "in the synchronous loop)"
            )
        if a.sync_every != 1:
            raise ConfigError(
                "async_rl.sync_every > 1 needs async_rl.staleness >= 1 (the synchronous loop syncs every step)"
            )
        return
    if a.sync_every > a.staleness:
        raise ConfigError(
            f"async_rl.sync_every={a.sync_every} > staleness={a.staleness}: batches would always be too old"
        )
    if cfg.trainer.val_every % a.sync_every:
        raise ConfigError(
            f"trainer.val_every={cfg.trainer.val_every} is not a multiple of async_rl.sync_every={a.sync_every}: "
            "a validation between two weight syncs would sample weights older than the step it reports"
        )
    if cfg.resources.rollout == "trainer":
        raise ConfigError(
            "async_rl.staleness >= 1 needs the rollout on a pool of its own (the colocated engine shares the "
            "trainer's workers): resources.rollout=gen +resources.pools.gen.n_workers_per_node=1"
        )
    for name, used in _UNSUPPORTED.items():
        if used(cfg):
            raise ConfigError(f"async_rl.staleness >= 1 does not support {name} yet")
    if a.streaming:
        for name, used in _UNSUPPORTED_STREAMING.items():
            if used(cfg):
                raise ConfigError(f"async_rl.streaming does not support {name}")
    elif a.partial_rollout:
        for name, used in _UNSUPPORTED_PARTIAL.items():
            if used(cfg):
                raise ConfigError(f"async_rl.partial_rollout does not support {name}")
    correction = cfg.algorithm.rollout_correction
    # bypass mode corrects through the PPO ratio pi / pi_rollout; with the REINFORCE loss only IS weights do
    by_ratio = correction.bypass_mode and correction.loss_type == "ppo_clip"
    if a.staleness and not (correction.rollout_is or correction.rollout_rs or by_ratio):
        log.warning(
            "async_rl.staleness=%d without a rollout correction (algorithm.rollout_correction.rollout_is, "
            "rollout_rs, or bypass_mode with loss_type=ppo_clip): samples up to %d versions old are trained as "
            "if on-policy; e.g. algorithm.rollout_correction.rollout_is=token corrects them by truncated "
            "importance weights",
            a.staleness,
            a.staleness,
        )


@dataclass
class Rollouts:
    """One step's sampled (not yet scored) rows."""

    prompts: Batch  # the step's prompt rows (before repeating n times)
    batch: Batch
    index: int  # the step (0-based) this batch was drawn for
    version: int  # the oldest policy version among its tokens (the weights its generation started with)
    loader_after: dict[str, int]  # the dataloader's state after its prompts were drawn
    seconds: float  # generation time
    ref_seconds: float = 0.0  # the reference's forward on the producer thread (0: the trainer computes it)


WeightsT = TypeVar("WeightsT")


class WeightHandOver(Generic[WeightsT]):
    """The trainer's side of a producer's weight hand-over, shared by both producers: the trainer hands its new
    weights over and goes on; the producer thread loads them when its own rule allows (between generation
    calls; streaming: once no group is in flight) and then publishes their version. A newer hand-over replaces
    weights not loaded yet. The producer owns the lock and the fields."""

    _cond: threading.Condition
    _stop: bool
    _error: BaseException | None
    published: int  # the version of the weights in the pool
    _handed: int  # the newest version handed over
    _weights: tuple[int, WeightsT] | None  # handed over, not loaded yet

    def hand_weights(self, version: int, weights: WeightsT) -> None:
        """The trainer's weights of `version` (what the producer loads them with: its class docstring).
        Returns at once."""
        with self._cond:
            self._weights, self._handed = (version, weights), version
            self._cond.notify_all()

    def settle_weights(self) -> None:
        """Block until the newest weights handed over are in the pool (before validation, or a regeneration,
        samples on it); a producer failure raises here."""
        with self._cond:
            while self.published < self._handed and self._error is None and not self._stop:
                self._cond.wait(timeout=1.0)
            if self._error is not None:
                raise self._error


class RolloutProducer(WeightHandOver[Callable[[], object]]):
    """The producer thread (see the module docstring). `take` hands batches to the trainer in order. Weights
    are handed over as a callable that loads them into the pool, called by the producer thread before its
    next generation call."""

    def __init__(
        self,
        cfg: RLConfig,
        rollout: Rollout,
        loader: PromptDataLoader,
        sampling: SamplingParams,
        start_version: int,
        pad_id: int = 0,
        decode: Callable[[list[int]], str] = str,
        ref_log_probs: Callable[[Batch], Batch] | None = None,
    ) -> None:
        self.k = cfg.async_rl.staleness
        self.deterministic = cfg.async_rl.deterministic
        self.chunk_tokens = cfg.async_rl.partial_chunk_tokens if cfg.async_rl.partial_rollout else 0
        self.pad_id, self.decode = pad_id, decode
        self.n = cfg.rollout.n
        self.rollout, self.loader, self.sampling = rollout, loader, sampling
        self.ref_log_probs = ref_log_probs
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
        self._chunk_idle = 0.0  # producer seconds loading weights within the current batch
        self._load_s = 0.0  # producer seconds loading weights (since the last take)
        self._weights = None
        self._handed = start_version
        # batches 0 .. total_steps - 1: none is generated past the run
        self.total_steps = cfg.trainer.total_steps
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        self._thread.start()

    # ---- producer side -------------------------------------------------------------------------
    def _run(self) -> None:
        index = self.first_index
        try:
            while True:
                waited = time.perf_counter()
                while True:  # gate: batch `index` trains at version `index`; its weights must be >= index - k
                    with self._cond:
                        # past the run's last batch it only loads weights (the final validation's) until stopped
                        while (
                            not self._stop
                            and self._weights is None
                            and (index >= self.total_steps or self.published < index - self.k)
                        ):
                            self._cond.wait(timeout=1.0)
                        if self._stop:
                            return
                    self._load_handed_weights()
                    if index < self.total_steps and self.published >= index - self.k:
                        break
                with self._cond:
                    self._idle += time.perf_counter() - waited
                start = time.perf_counter()
                prompts = self.loader.next_batch()
                loader_after = self.loader.state_dict()
                rows = prompts.repeat(self.n, interleave=True)
                if self.chunk_tokens:
                    batch = sample_in_chunks(
                        rows, self.sampling, self.chunk_tokens, self._run_chunk, self.pad_id, self.decode
                    )
                else:
                    batch, sampled_with = self._run_chunk(rows, self.sampling)
                    batch = batch.union(versions_column(batch, sampled_with))
                version = oldest_version(batch)
                batch = batch.union(rows.select(tensor_keys=[]))
                seconds = time.perf_counter() - start - self._chunk_idle
                ref_seconds = 0.0
                if self.ref_log_probs is not None:
                    ref_start = time.perf_counter()
                    batch = batch.union(self.ref_log_probs(batch))
                    ref_seconds = time.perf_counter() - ref_start
                with self._cond:
                    self._idle += self._chunk_idle  # waiting for weight loads between calls
                    self._chunk_idle = 0.0
                    self._busy += seconds + ref_seconds
                    self._ready.append(
                        Rollouts(prompts, batch, index, version, loader_after, seconds, ref_seconds)
                    )
                    self._produced = index + 1
                    self._cond.notify_all()
                index += 1
        except _Stopped:
            return
        except BaseException as exc:  # handed to the trainer at its next take
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _run_chunk(self, rows: Batch, sampling: SamplingParams) -> tuple[Batch, int]:
        """One generation call, after loading the weights handed over since the last one (so between two
        chunks of a partial rollout too); returns the version that sampled it."""
        with self._cond:
            if self._stop:
                raise _Stopped
        self._chunk_idle += self._load_handed_weights()
        return sample_rows(self.rollout, rows, sampling), self.published  # a continuation: any row count

    def _load_handed_weights(self) -> float:
        """Producer thread: load the newest weights the trainer handed over, if any, and publish their version.
        Returns the seconds the load took."""
        with self._cond:
            handed, self._weights = self._weights, None
        if handed is None:
            return 0.0
        start = time.perf_counter()
        handed[1]()
        seconds = time.perf_counter() - start
        with self._cond:
            self.published = handed[0]
            self._load_s += seconds
            self._cond.notify_all()
        return seconds

    # ---- trainer side --------------------------------------------------------------------------
    def wait_before_publish(self, version: int) -> None:
        """Deterministic mode: before `version` is handed over, block until every batch that the previous
        handed version h may sample (indices up to h + k) has been generated with it; a no-op otherwise.
        With weights every update (h = version - 1) batch i samples version max(0, i - k); every `sync_every`
        = s updates, the newest multiple of s at or below i - k (e.g. k = 2, s = 2: 0, 0, 0, 2, 2, 4, 4)."""
        if not self.deterministic:
            return
        due = min(self._handed + self.k, self.total_steps - 1)  # the last batch the run has
        with self._cond:
            while self._produced <= due and self._error is None and not self._stop:
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
            idle, busy, load_s = self._idle, self._busy, self._load_s
            self._idle = self._busy = self._load_s = 0.0
        waited = time.perf_counter() - start
        self.trained_loader_state = item.loader_after
        metrics = {
            "async/trainer_wait_s": waited,
            "async/rollout_idle_share": idle / (idle + busy) if idle + busy > 0 else 0.0,
            "async/gen_seconds": item.seconds,
            "async/ref_s": item.ref_seconds,
            "async/staleness": float(version - item.version),
            "async/queued": float(len(self._ready)),
            "async/weight_load_s": load_s,
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


class _Stopped(Exception):
    """The producer was stopped between two chunks of a batch."""


def versions_column(batch: Batch, version: int) -> Batch:
    """`rollout_versions` of a batch sampled by one version: `version` on response tokens, -1 on padding."""
    mask = batch[keys.RESPONSE_MASK]
    tagged = torch.where(mask > 0, torch.full_like(mask, version), torch.full_like(mask, -1)).long()
    return Batch.from_dict({keys.ROLLOUT_VERSIONS: tagged})


def oldest_version(batch: Batch) -> int:
    """The oldest version among the response tokens of `batch` (the weights its generation started with)."""
    versions = batch[keys.ROLLOUT_VERSIONS]
    tagged = versions[versions >= 0]
    return int(tagged.min()) if tagged.numel() else 0


def staleness_metrics(batch: Batch, version: int, k: int) -> dict[str, float]:
    """Per-sample staleness at update `version` (trainer version - the oldest version among the sample's
    tokens): max, mean, the number of samples of each age 0..k, and mixed-version samples (partial rollouts)."""
    versions = batch[keys.ROLLOUT_VERSIONS]
    tagged = versions >= 0
    big = torch.iinfo(versions.dtype).max
    oldest = torch.where(tagged, versions, torch.full_like(versions, big)).min(dim=1).values
    newest = torch.where(tagged, versions, torch.full_like(versions, -1)).max(dim=1).values
    has = tagged.any(dim=1)
    if not bool(has.any()):
        return {"async/staleness_max": 0.0, "async/staleness_mean": 0.0}
    age = (version - oldest[has]).float()
    metrics = {
        "async/staleness_max": float(age.max()),
        "async/staleness_mean": float(age.mean()),
        "async/token_staleness_mean": float((version - versions[tagged]).float().mean()),
        "async/mixed_version_samples": float((newest[has] > oldest[has]).sum()),
    }
    for a in range(k + 1):
        metrics[f"async/staleness_count_{a}"] = float((age == a).sum())
    return metrics


class LoaderPosition(Protocol):
    """A producer that drew ahead of training: where the loader stands for a checkpoint."""

    @property
    def trained_loader_state(self) -> dict[str, Any]: ...


class TrainedLoaderState:
    """The dataloader's part of a checkpoint under asynchronous RL: the position after the last trained
    batch (the producer has drawn further ahead). With streaming, also `settled`: prompts after that position
    already trained or filtered (trainers/streaming.py); a restore puts them into `settled` for the next
    producer to skip."""

    def __init__(
        self, loader: PromptDataLoader, producer: LoaderPosition | None, settled: list[str] | None = None
    ) -> None:
        self.loader, self.producer, self.settled = loader, producer, settled

    def state_dict(self) -> dict[str, Any]:
        if self.producer is None:
            return self.loader.state_dict()
        return dict(self.producer.trained_loader_state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)
        if self.settled is not None:
            self.settled[:] = list(state.get("settled", []))
