"""Streaming asynchronous RL (`async_rl.streaming`): the trainer takes a batch as soon as enough groups are complete.

With `async_rl.staleness` = k >= 1 and streaming on, a producer thread keeps groups (the n samples of one prompt)
in flight on the rollout pool's continuous batching (`RolloutGroup.stream_submit`) and collects rows as they
finish (`stream_collect`), so a short response never waits for a long one. The trainer's batch is the first
`data.train_batch_prompts` complete groups (with `algorithm.dynamic_sampling`, the first that are kept: the filter
is applied as groups arrive); groups still in flight, or complete but not needed, carry over to the next batch
(stream_groups.py holds the bookkeeping).

Correct by construction, as the whole-batch producer of async_rollout.py:
- the pool takes new weights only when no group is in flight (the trainer hands them over after its update, the
  producer stops submitting, the groups in flight finish, then the weights are loaded), so every token of a
  group is sampled by the version recorded at its submission, and nothing mixes versions within a sequence;
- the producer submits a group only while groups in flight or waiting number fewer than the batches up to
  version published + k need, so every group fits in a batch within k versions. A batch takes complete groups
  oldest version first, and a group k versions old (its last chance) always enters, replacing a newer one if
  the batch is full; the trainer waits for such groups still in flight. So a slow group is trained late, never
  dropped for being slow: short responses don't wait for long ones, up to k - 1 steps (with k = 1 the batch
  waits for the slowest group, as the whole-batch producer does). A group older than k at update time all the
  same (more last-chance groups than a batch holds) is dropped and counted or sampled again
  (`async_rl.on_stale`): no trained sample is ever older than k. `async_rl.stream_extra_groups` adds groups
  beyond that window to replace the ones the dynamic-sampling filter drops, and is refused without the filter:
  the window already holds every group the coming steps train, so a surplus would go stale each step.
- Checkpoints record the loader position before the oldest draw of prompts with a group not yet settled, and
  the prompts after it already trained or filtered; a resumed run samples the others again (DrawLedger).

With the reference on workers of its own (`resources.ref`), the producer thread computes the reference's
log-probs of the groups each collect completes, beside the trainer's update (`async/ref_s`).

Not bit-reproducible (arrival order depends on timing): `async_rl.deterministic` is refused with streaming.
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from posttrain.config.schema import RLConfig
from posttrain.controller.roles import STREAM_ID
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.data.dataloader import PromptDataLoader
from posttrain.rollout.base import SamplingParams
from posttrain.trainers.async_rollout import WeightHandOver, staleness_metrics
from posttrain.trainers.stream_groups import BatchFormer, DrawLedger, Group, GroupAssembler
from posttrain.workers.sampling import concat_padded

COLLECT_WAIT_S = (
    0.2  # a collect call waits this long for a first finished row (the pool's actor is busy meanwhile)
)


class StreamPool(Protocol):
    """What the producer needs from the rollout pool (`RolloutGroup`)."""

    @property
    def world_size(self) -> int: ...

    def stream_submit(self, batch: Batch, sampling: SamplingParams) -> None: ...

    def stream_collect(self, wait_s: float) -> list[Batch]: ...

    def load_weights(self, tensors: Any) -> dict[str, float]: ...


class StreamingProducer(WeightHandOver[Any]):
    """The producer thread (module docstring); `take_batch` forms the trainer's batches. Weights are handed
    over as the tensors themselves, loaded by the producer thread once the groups in flight finish (nothing new
    is submitted while weights wait)."""

    def __init__(
        self,
        cfg: RLConfig,
        pool: StreamPool,
        loader: PromptDataLoader,
        sampling: SamplingParams,
        start_version: int,
        pad_id: int,
        skip: list[str] | None = None,
        ref_log_probs: Callable[[Batch], Batch] | None = None,
    ) -> None:
        a = cfg.async_rl
        self.k, self.on_stale, self.extra = a.staleness, a.on_stale, a.stream_extra_groups
        self.n, self.want = cfg.rollout.n, cfg.data.train_batch_prompts
        self.dynamic_sampling, self.max_rounds = cfg.algorithm.dynamic_sampling, cfg.algorithm.max_gen_rounds
        self.pool, self.loader, self.sampling, self.pad_id = pool, loader, sampling, pad_id
        self.ref_log_probs = ref_log_probs
        # groups per submission, so that its rows split evenly over the pool's ranks
        self.unit = pool.world_size // math.gcd(self.n, pool.world_size)
        self.published = start_version  # the version of the weights in the pool
        self._handed = start_version  # the newest version the trainer handed over
        self.next_version = start_version  # the version of the trainer's next take
        self.ledger = DrawLedger()
        self._skip = set(skip or ())
        self._assembler = GroupAssembler(self.n, pad_id)
        self._prompts: collections.deque[Batch] = collections.deque()  # one-row prompts not submitted yet
        self._ready: collections.deque[Group] = collections.deque()  # complete groups, in arrival order
        self._weights = None
        self._cond = threading.Condition()
        self._stop = False
        self._error: BaseException | None = None
        self._next_id = 0
        # the oldest version among the groups in flight (None: none), kept by the producer thread, which alone
        # changes the assembler, for the trainer's side to read under the lock
        self._oldest_in_flight: int | None = None
        # complete groups the trainer's side holds while it forms a batch (out of `_ready`, not settled yet)
        self._in_hand = 0
        self._idle = self._busy = self._load_s = self._ref_s = 0.0
        self._last_batch = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="rollout-stream", daemon=True)
        self._thread.start()

    # ---- producer side -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    if self._stop:
                        return
                    load = self._weights if self._weights is not None and not len(self._assembler) else None
                    if load is not None:
                        self._weights = None
                    room = 0 if self._weights is not None or load is not None else self._room()
                if load is not None:
                    start = time.perf_counter()
                    self.pool.load_weights(load[1])
                    with self._cond:
                        self.published = load[0]
                        self._load_s += time.perf_counter() - start
                        self._idle += time.perf_counter() - start
                        self._cond.notify_all()
                    continue
                if room:
                    self._submit(room)
                if len(self._assembler):
                    start = time.perf_counter()
                    pieces = self.pool.stream_collect(COLLECT_WAIT_S)
                    done = self._assembler.add(pieces, time.perf_counter())
                    ref_s = self._add_ref_log_probs(done)
                    with self._cond:
                        self._ref_s += ref_s
                        self._busy += time.perf_counter() - start
                        self._ready.extend(done)
                        self._oldest_in_flight = self._assembler.oldest_version()
                        self._cond.notify_all()
                else:  # nothing in flight: the gate is closed (or the trainer's weights are due)
                    start = time.perf_counter()
                    with self._cond:
                        if not self._stop and self._weights is None and not self._room():
                            self._cond.wait(timeout=1.0)
                        self._idle += time.perf_counter() - start
        except BaseException as exc:  # handed to the trainer at its next take
            with self._cond:
                self._error = exc
                self._cond.notify_all()

    def _add_ref_log_probs(self, groups: list[Group]) -> float:
        """The reference's log-probs of `groups`' rows in one forward call (when the producer computes them);
        returns its seconds."""
        if self.ref_log_probs is None or not groups:
            return 0.0
        start = time.perf_counter()
        ref = self.ref_log_probs(concat_padded([g.rows for g in groups], self.pad_id))
        first = 0
        for group in groups:  # rows in group order; response-aligned columns do not depend on prompt padding
            group.rows = group.rows.union(ref.index(slice(first, first + len(group.rows))))
            first += len(group.rows)
        return time.perf_counter() - start

    def _room(self) -> int:
        """Groups the producer may submit now (called with the lock held), a multiple of `unit`: the batches
        up to version published + k, less the groups in flight, waiting or in the trainer's hands, plus the extra
        ones."""
        budget = (self.published + self.k + 1 - self.next_version) * self.want + self.extra
        room = budget - len(self._assembler) - len(self._ready) - self._in_hand
        return max(0, room - room % self.unit)

    def _submit(self, groups: int) -> None:
        """`groups` prompts (regenerations first, then new draws) as `n` rows each, on the pool."""
        prompts: list[Batch] = []
        while len(prompts) < groups:
            if not self._prompts:
                self._draw()
                continue
            prompts.append(self._prompts.popleft())
        rows: list[Batch] = []
        with self._cond:
            version = self.published
        for prompt in prompts:
            uid = str(prompt[keys.UID][0])
            self._assembler.expect(uid, prompt, version)
            repeated = prompt.select([keys.INPUT_IDS, keys.ATTENTION_MASK], []).repeat(self.n)
            ids = list(range(self._next_id, self._next_id + self.n))
            self._next_id += self.n
            repeated.set(STREAM_ID, ids)
            repeated.set(keys.UID, [uid] * self.n)
            rows.append(repeated)
        with self._cond:  # before the pool has them: the trainer's side sees them in flight from now
            self._oldest_in_flight = self._assembler.oldest_version()
        self.pool.stream_submit(concat_padded(rows, self.pad_id), self.sampling)

    def _draw(self) -> None:
        """The loader's next batch of prompts, one queued row each (prompts a checkpoint settled skipped)."""
        before = self.loader.state_dict()
        batch = self.loader.next_batch()
        uids = [str(u) for u in batch[keys.UID]]
        with self._cond:
            self.ledger.drawn(before, self.loader.state_dict(), uids)
            skipped = [u for u in uids if u in self._skip]
            self.ledger.settle(skipped)
            self._skip.difference_update(skipped)
        for i, uid in enumerate(uids):
            if uid not in skipped:
                self._prompts.append(batch.index([i]))

    # ---- trainer side --------------------------------------------------------------------------
    def take_batch(self, version: int, score: Callable[[Batch], Batch]) -> tuple[Batch, dict[str, float]]:
        """The trainer's batch at `version`, scored by `score`: the first `data.train_batch_prompts` complete
        and kept groups, oldest version first (module docstring); waits for them, and for the groups in flight
        that this step is the last to be able to train. Returns metrics too."""
        former = BatchFormer(
            version,
            self.want,
            self.k,
            self.on_stale,
            self.dynamic_sampling,
            self.max_rounds,
            score,
            self.pad_id,
        )
        waited = 0.0
        held: list[Group] = []  # complete groups not needed (yet): back to the queue once the batch is formed
        while True:
            start = time.perf_counter()
            with self._cond:
                oldest = self._oldest_in_flight
                if former.full and (oldest is None or not former.last_chance(oldest)):
                    break
                while not self._ready and self._error is None and not self._stop:
                    self._cond.wait(timeout=1.0)
                if self._error is not None and not self._ready:
                    raise self._error
                arrived = list(self._ready)
                self._ready.clear()
                self._in_hand += len(arrived)  # until offered: then only what the batch keeps and hands back
            waited += time.perf_counter() - start
            # a group handed back stays out: the batch stays full, and its version cannot reach the last chance
            held += former.offer(arrived)
            with self._cond:
                # the batch's groups and those handed back count against the room until the batch is formed and
                # next_version moves on (a submission in between would see the window emptied and overfill it);
                # groups filtered or dropped are settled and free their place, or the producer could never
                # replace them
                self._in_hand = len(former.kept) + len(held)
                self._cond.notify_all()
        formed = former.formed()
        now = time.perf_counter()
        with self._cond:
            self.ledger.settle(formed.settled)
            for group in formed.regenerate:
                self._prompts.appendleft(group.prompt)
            self._ready.extendleft(reversed(held))
            self._in_hand = 0
            self.next_version = version + 1
            idle, busy, load_s, ref_s = self._idle, self._busy, self._load_s, self._ref_s
            self._idle = self._busy = self._load_s = self._ref_s = 0.0
            carried = len(self._ready) + len(self._assembler)
            self._cond.notify_all()
        last = max(g.arrived for g in formed.groups)
        metrics = {
            "async/trainer_wait_s": waited,
            "async/rollout_idle_share": idle / (idle + busy) if idle + busy > 0 else 0.0,
            "async/staleness": float(version - min(g.version for g in formed.groups)),
            "async/queued": float(len(self._ready)),
            "async/groups_filtered": float(formed.filtered),
            "async/groups_carried_over": float(carried),
            "async/time_to_batch_s": max(0.0, last - self._last_batch),
            "async/dropped_samples": float(formed.dropped_samples),
            "async/regenerated_samples": float(len(formed.regenerate) * self.n),
            "async/weight_load_s": load_s,
            "async/ref_s": ref_s,
            "dynamic_sampling/kept_groups": float(len(formed.groups) - formed.filled),
            "fault/rollout_restarts": float(getattr(self.pool, "restarts", 0)),
        }
        self._last_batch = now
        metrics.update(staleness_metrics(formed.batch, version, self.k))
        metrics["throughput/gen_tokens_total"] = float(formed.batch[keys.RESPONSE_MASK].sum())
        return formed.batch, metrics

    @property
    def trained_loader_state(self) -> dict[str, Any]:
        """The dataloader's part of a checkpoint (`DrawLedger.resume_state`), with the prompts a resume settled
        whose draws this producer has not reached yet (they come after its position: skipped there too)."""
        with self._cond:
            state = self.ledger.resume_state(self.loader.state_dict())
            return {**state, "settled": [*state["settled"], *sorted(self._skip)]}

    def stop(self) -> None:
        """Stop the thread (a collect in flight ends within COLLECT_WAIT_S); the loader goes back to the oldest
        draw with an open prompt."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()
        state = self.trained_loader_state
        self.loader.load_state_dict({"epoch": state["epoch"], "position": state["position"]})
        self._ready.clear()
