"""The bookkeeping of streaming (`async_rl.streaming`), without Ray: groups reassembled from rows that come back
in any order, a step's batch formed from the first complete and kept groups, and which drawn prompts are settled.

A group is the n samples of one prompt (one `uid`). The rollout pool returns rows as they finish, from any rank;
`GroupAssembler` holds them until a group's n rows are in. `BatchFormer` takes complete groups oldest version first
(then in arrival order), drops (or sends back for regeneration) a group older than k versions, applies DAPO's
filter (a group whose scores are all equal has zero advantage) and stops at `data.train_batch_prompts` kept groups;
a group at its last chance (exactly k versions old) is always taken, in place of a newer one if the batch is full,
and `StreamingProducer.take_batch` waits for such groups still in flight, so nothing is dropped for being slow.
`DrawLedger` knows, for each batch of prompts drawn from the loader, which of its prompts are settled (trained,
filtered out, or dropped), so a checkpoint can point the loader at the oldest draw still open and list the prompts
after it not to repeat.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.algorithms.reward_shaping import groups_with_reward_variance
from posttrain.controller.roles import STREAM_ID
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.trainers.async_rollout import versions_column
from posttrain.trainers.rewarding import filter_scores
from posttrain.workers.sampling import concat_padded

log = logging.getLogger(__name__)


@dataclass
class Group:
    """One prompt's n sampled rows (sample order), with the prompt's columns and `rollout_versions`."""

    uid: str
    rows: Batch
    version: int  # the policy version that sampled every token (the pool takes no weights while it generates)
    arrived: float  # when its last row came back (time.perf_counter)
    prompt: Batch  # the prompt's row, to sample it again (on_stale=regenerate)
    varied: bool | None = None  # scored: whether its scores differ (None: not scored yet)


@dataclass
class _Open:
    prompt: Batch
    version: int
    pieces: list[Batch] = field(default_factory=list)
    count: int = 0


class GroupAssembler:
    """Groups in flight: rows come back in pieces (any order, any rank) until a group's n rows are in."""

    def __init__(self, n: int, pad_id: int) -> None:
        self.n, self.pad_id = n, pad_id
        self._open: dict[str, _Open] = {}

    def __len__(self) -> int:
        """Groups in flight."""
        return len(self._open)

    def oldest_version(self) -> int | None:
        """The oldest version among the groups in flight (None: nothing in flight)."""
        return min((g.version for g in self._open.values()), default=None)

    def expect(self, uid: str, prompt: Batch, version: int) -> None:
        """Group `uid` was submitted, sampled by `version`; `prompt` is its one prompt row (every column)."""
        if uid in self._open:
            raise ValueError(f"group {uid} is already in flight")
        self._open[uid] = _Open(prompt, version)

    def add(self, pieces: Iterable[Batch], now: float) -> list[Group]:
        """Rows back from the pool (with `uid` and `stream_id` columns); returns the groups they completed."""
        done: list[Group] = []
        for piece in pieces:
            for uid in dict.fromkeys(piece[keys.UID]):
                rows = piece.index([u == uid for u in piece[keys.UID]])
                group = self._open.get(uid)
                if group is None:
                    raise ValueError(f"rows of group {uid}, which is not in flight")
                group.pieces.append(rows)
                group.count += len(rows)
                if group.count > self.n:
                    raise ValueError(f"group {uid}: {group.count} rows back for {self.n} samples")
                if group.count == self.n:
                    done.append(self._complete(uid, now))
        return done

    def _complete(self, uid: str, now: float) -> Group:
        group = self._open.pop(uid)
        rows = concat_padded(group.pieces, self.pad_id)
        rows = rows.index(torch.as_tensor([int(i) for i in rows[STREAM_ID]]).argsort())  # sample order
        rows.pop(STREAM_ID)
        rows.pop(keys.UID)
        rows = rows.union(group.prompt.select(tensor_keys=[]).repeat(self.n))
        rows = rows.union(versions_column(rows, group.version))
        return Group(uid, rows, group.version, now, group.prompt)


@dataclass
class Formed:
    """A step's batch and what forming it did."""

    batch: Batch
    groups: list[Group]  # the groups trained (kept, or filling after max_gen_rounds)
    settled: list[str]  # uids done with: trained, filtered out, dropped as stale
    regenerate: list[Group]  # too old, to be sampled again
    filtered: int = 0
    dropped_samples: int = 0
    filled: int = 0  # zero-variance groups trained because max_gen_rounds ran out


class BatchFormer:
    """A step's batch from complete groups, oldest version first (module docstring).

    `offer` the groups as they arrive (scored by the caller's `score`, many at a time) until `full` and no group
    at its last chance is in flight; `formed()` then returns the batch. Groups not needed are handed back by
    `offer` (they carry over): those offered after it is full, and newer ones that a last-chance group replaced.
    """

    def __init__(
        self,
        version: int,
        want: int,
        staleness: int,
        on_stale: str,
        dynamic_sampling: bool,
        max_rounds: int,
        score: Callable[[Batch], Batch],
        pad_id: int,
    ) -> None:
        self.version, self.want, self.k, self.on_stale = version, want, staleness, on_stale
        self.dynamic_sampling, self.cap = dynamic_sampling, max_rounds * want
        self.score, self.pad_id = score, pad_id
        self.kept: list[Group] = []
        self.zero_variance: list[Group] = []
        self.received = 0  # groups scored (kept or filtered)
        self._settled: list[str] = []
        self._regenerate: list[Group] = []
        self._dropped = 0

    @property
    def full(self) -> bool:
        return len(self.kept) >= self.want or self.received >= self.cap

    def last_chance(self, version: int) -> bool:
        """Whether a group sampled by `version` can be trained at this step and at no later one."""
        return self.version - version >= self.k

    def offer(self, groups: list[Group]) -> list[Group]:
        """Take `groups` into the batch, oldest version first (then in the given arrival order); returns those
        not needed, in that order (scored when they could enter the batch: their scores stay with them)."""
        fresh: list[Group] = []
        for group in sorted(groups, key=lambda g: g.version):  # stable: arrival order within a version
            if self.version - group.version <= self.k:
                fresh.append(group)
            elif self.on_stale == "regenerate":
                self._regenerate.append(group)
            else:
                self._dropped += len(group.rows)
                self._settled.append(group.uid)
                log.warning("async: dropped group %s sampled at version %d at version %d", group.uid,
                            group.version, self.version)  # fmt: skip
        unscored = [g for g in fresh if g.varied is None]
        if unscored and (not self.full or any(self.last_chance(g.version) for g in unscored)):
            # scored together: one call to the reward stage
            rows = concat_padded([g.rows for g in unscored], self.pad_id)
            scored = self.score(rows)
            varied = groups_with_reward_variance(rows[keys.UID], filter_scores(scored))
            start = 0
            for group in unscored:
                size = len(group.rows)
                group.rows = group.rows.union(_scores_of(scored, start, size, group.rows))
                group.varied = bool(varied[start])
                start += size
        left: list[Group] = []
        for group in fresh:
            if self.full and not self.last_chance(group.version):
                left.append(group)
                continue
            self.received += 1
            if self.dynamic_sampling and not group.varied:
                self.zero_variance.append(group)
            else:
                self.kept.append(group)
        if len(self.kept) > self.want:  # last-chance groups came in over a full batch: the newest step back
            self.kept.sort(key=lambda g: g.version)  # stable
            surplus = self.kept[self.want :]
            del self.kept[self.want :]
            self.received -= len(surplus)
            left = surplus + left
        return left

    def formed(self) -> Formed:
        groups = list(self.kept)
        filled = 0
        if (
            len(groups) < self.want
        ):  # max_gen_rounds * want groups received: fill, as synchronous sampling does
            filled = self.want - len(groups)
            log.warning(
                "dynamic sampling: only %d of %d prompt groups had varied rewards among %d received "
                "(algorithm.max_gen_rounds); filling the step with zero-advantage groups",
                len(groups),
                self.want,
                self.received,
            )
            groups += self.zero_variance[:filled]
        used = {g.uid for g in groups}
        filtered = [g for g in self.zero_variance if g.uid not in used]
        return Formed(
            batch=concat_padded([g.rows for g in groups], self.pad_id),
            groups=groups,
            settled=[*self._settled, *used, *(g.uid for g in filtered)],
            regenerate=self._regenerate,
            filtered=len(self.zero_variance) - filled,
            dropped_samples=self._dropped,
            filled=filled,
        )


def _scores_of(scored: Batch, start: int, size: int, rows: Batch) -> Batch:
    """The scoring columns of rows start..start+size of `scored` (the reward stage's output for `rows`)."""
    part = scored.index(slice(start, start + size))
    names = [k for k in part.keys() if k not in rows]
    tensors = [k for k in names if k in part.tensors.keys()]
    return part.select(tensors, [k for k in names if k not in tensors])


@dataclass
class _Draw:
    state: dict[str, int]  # the loader's state before this draw
    uids: list[str]
    settled: set[str] = field(default_factory=set)


class DrawLedger:
    """Which drawn prompts are settled (trained, filtered, dropped), draw by draw (module docstring)."""

    def __init__(self) -> None:
        self._draws: deque[_Draw] = deque()
        self._position: dict[str, int] | None = None  # the loader's state after the last draw

    def drawn(self, before: dict[str, int], after: dict[str, int], uids: list[str]) -> None:
        self._draws.append(_Draw(dict(before), list(uids)))
        self._position = dict(after)

    def settle(self, uids: Iterable[str]) -> None:
        todo = set(uids)
        for draw in self._draws:
            draw.settled |= todo & set(draw.uids)
        while self._draws and len(self._draws[0].settled) == len(self._draws[0].uids):
            self._draws.popleft()

    @property
    def position(self) -> dict[str, int] | None:
        """The loader's state after the last draw (None: nothing drawn)."""
        return self._position

    def open_uids(self) -> list[str]:
        """Drawn prompts not settled yet."""
        return [u for d in self._draws for u in d.uids if u not in d.settled]

    def resume_state(self, loader_state: dict[str, int]) -> dict[str, Any]:
        """The dataloader's part of a checkpoint: the position before the oldest draw still open (else the
        loader's `loader_state` now), and `settled`: the prompts of that draw and later ones already done with,
        which a resumed producer skips."""
        if not self._draws:
            return {**(self._position or loader_state), "settled": []}
        settled = [u for d in self._draws for u in d.uids if u in d.settled]
        return {**self._draws[0].state, "settled": settled}
