"""Streaming asynchronous RL without Ray: groups reassembled as rows finish, batches formed from the first complete
(and kept) groups, the staleness bound, the dynamic-sampling filter, the loader ledger, in-place pool restarts."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

from posttrain.config.load import load_config
from posttrain.config.schema import RLConfig
from posttrain.controller.roles import STREAM_ID, RolloutGroup
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.data.dataloader import PromptDataLoader
from posttrain.data.dataset import collate_prompts
from posttrain.errors import WorkerError
from posttrain.rollout.base import GenerationResult, SamplingParams
from posttrain.trainers.stream_groups import BatchFormer, DrawLedger, Group, GroupAssembler
from posttrain.trainers.streaming import StreamingProducer
from posttrain.workers.sampling import batch_prompts, pad_prompts_left, results_batch

PAD = 0
N = 4


class Prompts:
    """Prompts of 1..5 tokens (so submissions pad to different widths)."""

    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": list(range(1, 2 + i % 5)), "data_source": "t", "ground_truth": "", "extra_info": {},
                "raw_prompt": "", "messages": [], "index": i}  # fmt: skip


def length(uid: str, sample: int) -> int:
    """Response length 1..12: varies by prompt and sample (a few long ones)."""
    return 1 + zlib.crc32(f"{uid}/{sample}".encode()) % 12


class FakePool:
    """A continuous-batching pool on a clock: a row finishes `length` collect calls after its submission; the
    weights may change only when nothing is in flight (as RolloutWorker.load_weights insists)."""

    world_size = 1

    def __init__(self) -> None:
        self.tick = 0
        self.pending: list[tuple[int, Batch, SamplingParams]] = []  # (finish tick, one row, sampling)
        self.loads: list[int] = []
        self.submitted: list[str] = []

    def stream_submit(self, batch: Batch, sampling: SamplingParams) -> None:
        self.submitted += list(dict.fromkeys(batch[keys.UID]))
        for i in range(len(batch)):
            row = batch.index([i])
            sample = int(row[STREAM_ID][0]) % N
            self.pending.append((self.tick + length(str(row[keys.UID][0]), sample), row, sampling))

    def stream_collect(self, wait_s: float) -> list[Batch]:
        self.tick += 1
        done = [p for p in self.pending if p[0] <= self.tick]
        self.pending = [p for p in self.pending if p[0] > self.tick]
        out = []
        for _, row, sampling in done:
            n = length(str(row[keys.UID][0]), int(row[STREAM_ID][0]) % N)
            result = GenerationResult([7] * n, [-0.5] * n, "x" * n, "stop")
            out.append(results_batch(row, [result], PAD, sampling.max_tokens, 0.0, 1.0).union(
                row.select(tensor_keys=[])))  # fmt: skip
        return out

    def load_weights(self, tensors: Any) -> dict[str, float]:
        assert not self.pending, "weights loaded while groups were generating"
        self.loads.append(int(tensors))
        return {}


def flat(uid: str) -> bool:
    """The prompts whose n samples all get the same score (every third)."""
    return int(uid.split("-")[1]) % 3 == 0


def all_equal(uid: str) -> bool:
    """The groups the filter must drop: the flat prompts, and those whose samples are all short or all long."""
    return flat(uid) or len({length(uid, s) >= 6 for s in range(N)}) == 1


def score(batch: Batch) -> Batch:
    uids = list(batch[keys.UID])
    lengths = batch[keys.RESPONSE_MASK].sum(-1)
    values = [0.5 if flat(u) else float(n >= 6) for u, n in zip(uids, lengths.tolist(), strict=True)]
    token = torch.zeros_like(batch[keys.RESPONSE_MASK])
    return Batch.from_dict({keys.TOKEN_LEVEL_SCORES: token}, {keys.SCORE: values})


def config(*extra: str) -> RLConfig:
    return load_config(RLConfig, "rl", ["model.path=x", "data.train_batch_prompts=4", f"rollout.n={N}",
                                        "data.max_response_length=12", *extra])  # fmt: skip


def loader() -> PromptDataLoader:
    return PromptDataLoader(
        Prompts(), 4, lambda items, uids: collate_prompts(items, PAD, uids), shuffle=False
    )


def run(
    cfg: RLConfig, steps: int, ref_log_probs: Callable[[Batch], Batch] | None = None
) -> tuple[list[Batch], list[dict[str, float]], StreamingProducer, FakePool]:
    pool, data = FakePool(), loader()
    producer = StreamingProducer(cfg, pool, data, SamplingParams(max_tokens=12), 0, PAD, None, ref_log_probs)
    batches, metrics = [], []
    try:
        for version in range(steps):
            batch, m = producer.take_batch(version, score)
            batches.append(batch)
            metrics.append(m)
            producer.hand_weights(version + 1, version + 1)  # the update's new weights
    finally:
        producer.stop()
    return batches, metrics, producer, pool


def varied(batch: Batch, uid: str) -> bool:
    scores = [s for u, s in zip(batch[keys.UID], batch[keys.SCORE], strict=True) if u == uid]
    return len(set(scores)) > 1


@pytest.mark.parametrize("k", [1, 2])
def test_every_trained_sample_is_within_the_bound_and_no_group_is_trained_twice_or_lost(k: int) -> None:
    cfg = config(f"async_rl.staleness={k}", "async_rl.streaming=true", "async_rl.stream_extra_groups=2",
                 "algorithm.dynamic_sampling=true", "algorithm.max_gen_rounds=20")  # fmt: skip
    batches, metrics, producer, pool = run(cfg, 8)
    trained: list[str] = []
    for version, (batch, m) in enumerate(zip(batches, metrics, strict=True)):
        assert len(batch) == 4 * N
        versions = batch[keys.ROLLOUT_VERSIONS]
        for row in range(len(batch)):  # every token of a row: one version, within k of the update
            tagged = versions[row][versions[row] >= 0]
            assert tagged.numel() == int(batch[keys.RESPONSE_MASK][row].sum())
            assert int(tagged.min()) == int(tagged.max()) and 0 <= version - int(tagged.min()) <= k
        assert m["async/staleness_max"] <= k
        uids = list(dict.fromkeys(batch[keys.UID]))
        assert len(uids) == 4 and all(list(batch[keys.UID]).count(u) == N for u in uids)
        assert not any(flat(u) for u in uids) and all(varied(batch, u) for u in uids)  # the filter's work
        trained += uids
    assert len(trained) == len(set(trained)), "a group was trained twice"
    # every drawn prompt is trained, filtered (exactly the all-equal ones), dropped, or still open
    filtered = sum(m["async/groups_filtered"] for m in metrics)
    dropped = sum(m["async/dropped_samples"] for m in metrics) / N
    open_uids = producer.ledger.open_uids()
    last = producer.ledger.position
    assert last is not None and last["epoch"] == 0
    drawn = [f"0-{i}" for i in range(4 * last["position"])]
    assert not set(open_uids) & set(trained) and not any(all_equal(u) for u in trained)
    done_with = [u for u in drawn if u not in open_uids and u not in trained]  # filtered or dropped
    assert filtered + dropped == len(done_with)
    assert sum(map(all_equal, done_with)) - dropped <= filtered <= sum(map(all_equal, done_with))
    assert filtered > 0 and sum(m["async/groups_carried_over"] for m in metrics) > 0
    # weights reached the pool only between groups, in order
    assert pool.loads == sorted(pool.loads) and pool.loads


def test_without_the_filter_batches_are_the_first_complete_groups() -> None:
    cfg = config("async_rl.staleness=2", "async_rl.streaming=true")
    batches, metrics, _, _ = run(cfg, 3)
    for m in metrics:
        assert m["async/groups_filtered"] == 0 and m["async/time_to_batch_s"] >= 0
    first = list(dict.fromkeys(batches[0][keys.UID]))
    # 12 groups in flight from the start (batches 0..k): the 4 whose slowest sample is shortest come first
    slowest = {f"0-{i}": max(length(f"0-{i}", s) for s in range(N)) for i in range(12)}
    assert sorted(slowest[u] for u in first) == sorted(slowest.values())[:4]


def test_stale_groups_are_regenerated_with_newer_weights() -> None:
    cfg = config("async_rl.staleness=1", "async_rl.streaming=true", "async_rl.stream_extra_groups=6",
                 "async_rl.on_stale=regenerate", "algorithm.dynamic_sampling=true",
                 "algorithm.max_gen_rounds=20")  # fmt: skip
    batches, metrics, _, _ = run(cfg, 6)
    assert sum(m["async/regenerated_samples"] for m in metrics) > 0
    trained = [u for b in batches for u in dict.fromkeys(b[keys.UID])]
    assert len(trained) == len(set(trained))
    for version, batch in enumerate(batches):
        tagged = batch[keys.ROLLOUT_VERSIONS]
        assert version - int(tagged[tagged >= 0].min()) <= 1


class LongTailPool(FakePool):
    """Every fifth prompt's samples take 15x as many collect calls (a long tail that later, shorter groups
    overtake)."""

    def stream_submit(self, batch: Batch, sampling: SamplingParams) -> None:
        start = len(self.pending)
        super().stream_submit(batch, sampling)
        for i in range(start, len(self.pending)):
            finish, row, params = self.pending[i]
            if slow(str(row[keys.UID][0])):
                self.pending[i] = (self.tick + 15 * (finish - self.tick), row, params)


def slow(uid: str) -> bool:
    return int(uid.split("-")[1]) % 5 == 0


@pytest.mark.parametrize("k", [1, 2, 3])
def test_slow_groups_are_trained_late_not_dropped(k: int) -> None:
    """Later, shorter groups overtake the long tail, but a group at its last chance (k versions old) always
    enters the batch, and the trainer waits for one still in flight: nothing is dropped, the slow groups are
    trained, and no sample is older than k."""
    cfg = config(f"async_rl.staleness={k}", "async_rl.streaming=true")
    pool, data = LongTailPool(), loader()
    producer = StreamingProducer(cfg, pool, data, SamplingParams(max_tokens=12), 0, PAD)
    trained: list[str] = []
    try:
        for version in range(10):
            batch, m = producer.take_batch(version, score)
            assert m["async/dropped_samples"] == 0 and m["async/staleness_max"] <= k
            uids = list(dict.fromkeys(batch[keys.UID]))
            assert len(uids) == 4
            trained += uids
            producer.hand_weights(version + 1, version + 1)
    finally:
        producer.stop()
    assert len(trained) == len(set(trained))
    assert sum(map(slow, trained)) >= 5  # the long tail is trained, not only the short groups
    if k > 1:  # short groups overtook slow ones: streaming's point
        assert trained[:8] != sorted(trained[:8], key=lambda u: int(u.split("-")[1]))


def test_a_last_chance_group_replaces_the_newest_in_a_full_batch() -> None:
    former = BatchFormer(5, 2, 2, "drop", False, 1, score, PAD)  # version 5, 2 groups a batch, k = 2

    def group(uid: str, version: int) -> Group:  # scored already: the former does not score it again
        prompt = collate_prompts([Prompts()[0]], PAD, [uid])
        return Group(uid, prompt.repeat(N), version, 0.0, prompt, varied=True)

    assert not former.offer([group("a", 5), group("b", 4)]) and former.full
    left = former.offer([group("c", 5), group("d", 3)])  # d is 2 versions old: its last chance
    assert [g.uid for g in left] == ["a", "c"]  # the newest stepped back, "a" out of the batch
    assert [g.uid for g in former.kept] == ["d", "b"] and former.received == 2
    assert former.offer([group("e", 2)]) == [] and former._dropped == N  # too old: dropped


def test_groups_reassemble_from_pieces_of_different_widths() -> None:
    assembler = GroupAssembler(2, PAD)
    prompts = {u: collate_prompts([Prompts()[i]], PAD, [u]) for u, i in (("a", 0), ("b", 3))}
    for uid, prompt in prompts.items():
        assembler.expect(uid, prompt, version=3)

    def piece(uid: str, ids: list[int], prompt_width: int) -> Batch:
        rows = prompts[uid].select([keys.INPUT_IDS, keys.ATTENTION_MASK], []).repeat(len(ids))
        rows = pad_prompts_left(rows, prompt_width, PAD)  # as padded in a submission with longer prompts
        rows.set(STREAM_ID, ids)
        rows.set(keys.UID, [uid] * len(ids))
        results = [GenerationResult([9] * (i + 1), [0.0] * (i + 1), "", "stop") for i in ids]
        return results_batch(rows, results, PAD, 5, 0.0, 1.0).union(rows.select(tensor_keys=[]))

    assert assembler.add([piece("a", [1], 6), piece("b", [2], 4)], 1.0) == []
    done = assembler.add([piece("b", [3], 4), piece("a", [0], 1)], 2.0)
    assert [g.uid for g in done] == ["b", "a"] and len(assembler) == 0
    a = done[1].rows
    assert a[keys.RESPONSE_MASK].sum(-1).tolist() == [1.0, 2.0], "sample order restored"
    assert a[keys.PROMPTS].shape[1] == 6 and a[keys.INPUT_IDS].shape[1] == 11
    assert batch_prompts(a) == [[1, 9], [1, 9, 9]] and list(a[keys.UID]) == ["a", "a"]
    mask = a[keys.ATTENTION_MASK]
    assert torch.equal(a[keys.POSITION_IDS], (mask.cumsum(-1) - 1).clamp(min=0)) and int(mask[0].sum()) == 2
    assert STREAM_ID not in a


def test_the_ledger_points_a_resume_at_the_oldest_open_draw() -> None:
    ledger = DrawLedger()
    ledger.drawn({"epoch": 0, "position": 0}, {"epoch": 0, "position": 1}, ["0-0", "0-1"])
    ledger.drawn({"epoch": 0, "position": 1}, {"epoch": 0, "position": 2}, ["0-2", "0-3"])
    ledger.settle(["0-0", "0-2"])
    assert ledger.resume_state({}) == {"epoch": 0, "position": 0, "settled": ["0-0", "0-2"]}
    ledger.settle(["0-1"])
    assert ledger.resume_state({}) == {"epoch": 0, "position": 1, "settled": ["0-2"]}
    ledger.settle(["0-3"])
    assert ledger.resume_state({}) == {"epoch": 0, "position": 2, "settled": []}


def test_a_resumed_producer_skips_settled_prompts() -> None:
    cfg = config("async_rl.staleness=1", "async_rl.streaming=true")
    pool = FakePool()
    producer = StreamingProducer(cfg, pool, loader(), SamplingParams(max_tokens=12), 0, PAD, ["0-1", "0-2"])
    try:
        batch, _ = producer.take_batch(0, score)
    finally:
        producer.stop()
    assert pool.submitted[:4] == ["0-0", "0-3", "0-4", "0-5"] and not {"0-1", "0-2"} & set(pool.submitted)
    assert not {"0-1", "0-2"} & set(batch[keys.UID])


def test_a_second_resume_still_skips_the_first_resumes_settled_prompts() -> None:
    """Settled prompts of draws the resumed producer has not reached yet belong in its own checkpoint too,
    or a second resume trains them again."""
    cfg = config("async_rl.staleness=1", "async_rl.streaming=true")
    first = StreamingProducer(cfg, FakePool(), loader(), SamplingParams(max_tokens=12), 0, PAD, ["0-21"])
    try:
        first.take_batch(0, score)
    finally:
        first.stop()
    state = first.trained_loader_state
    assert "0-21" in state["settled"]  # its draw (prompts 0-20..0-23) was never reached
    pool, data = FakePool(), loader()
    data.load_state_dict({"epoch": state["epoch"], "position": state["position"]})
    second = StreamingProducer(cfg, pool, data, SamplingParams(max_tokens=12), 0, PAD, state["settled"])
    try:
        for version in range(5):
            second.take_batch(version, score)
            second.hand_weights(version + 1, version + 1)
    finally:
        second.stop()
    assert "0-21" not in pool.submitted and {"0-20", "0-22"} <= set(pool.submitted)


class DyingDispatcher:
    """Two ranks; the first stream_collect finds rank 1 dead."""

    role, world_size, data_parallel_size = "rollout", 2, 2

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.dead = False

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((method, args[0] if args else None))
        if method == "stream_collect" and not self.dead:
            self.dead = True
            raise WorkerError(
                "rollout rank 1 died during stream_collect: process 42 was killed",
                role="rollout",
                rank=1,
                died=True,
            )
        return [[], []] if method == "stream_collect" else {}

    def restart(self) -> None:
        self.calls.append(("restart", None))


def test_a_dead_rollout_rank_restarts_with_the_weights_and_its_lost_requests() -> None:
    dispatcher = DyingDispatcher()
    group = RolloutGroup(dispatcher)  # type: ignore[arg-type]
    group.enable_restarts(1)
    group.load_weights({"w": torch.ones(1)})
    rows = collate_prompts([Prompts()[i] for i in range(4)], PAD, ["a", "b", "c", "d"])
    rows = rows.select([keys.INPUT_IDS, keys.ATTENTION_MASK], [keys.UID])
    rows.set(STREAM_ID, [0, 1, 2, 3])
    group.stream_submit(rows, SamplingParams())
    group._streamed[0].outstanding -= {0}  # row 0 was collected before the death
    assert group.stream_collect(0.1) == []
    methods = [m for m, _ in dispatcher.calls]
    assert methods == ["load_weights", "stream_submit", "stream_collect", "restart", "load_weights",
                       "stream_submit", "stream_collect"]  # fmt: skip
    reissued = dispatcher.calls[5][1]
    assert list(reissued[STREAM_ID]) == [1, 2, 3, -1], "the lost rows, plus a filler for the even split"
    assert group.restarts == 1
    with pytest.raises(WorkerError, match="rollout rank 1 died .*after 1 in-place restart"):
        dispatcher.dead = False
        group.stream_collect(0.1)


def test_without_restarts_the_dead_rank_is_named() -> None:
    group = RolloutGroup(DyingDispatcher())  # type: ignore[arg-type]
    with pytest.raises(WorkerError, match="rollout rank 1 died during stream_collect: process 42"):
        group.stream_collect(0.1)


def row_marks(batch: Batch) -> Batch:
    """A stand-in for the reference's log-probs, different for every row and computed from the row alone: its
    token count (prompt + response, whatever the padding) on each response token."""
    marks = batch[keys.ATTENTION_MASK].sum(-1, keepdim=True).float() * batch[keys.RESPONSE_MASK]
    return Batch.from_dict({keys.REF_LOG_PROB: -marks})


def test_the_reference_log_probs_computed_as_groups_complete_stay_with_their_rows() -> None:
    """The producer computes them for the groups each collect completes (one call per collect), and every
    trained row carries its own, after regrouping and padding into the trainer's batch."""
    calls: list[int] = []

    def ref_log_probs(batch: Batch) -> Batch:
        calls.append(len(batch))
        return row_marks(batch)

    batches, metrics, _, _ = run(config("async_rl.staleness=2"), 4, ref_log_probs)
    for batch in batches:
        assert torch.equal(batch[keys.REF_LOG_PROB], row_marks(batch)[keys.REF_LOG_PROB])
    assert all(c % N == 0 for c in calls), "whole groups per call"
    assert sum(calls) >= sum(len(b) for b in batches)
    assert all("async/ref_s" in m for m in metrics)


class DiesOnLoads(DyingDispatcher):
    """The first `deaths` weight loads find rank 1 dead (the restart's own reload included)."""

    def __init__(self, deaths: int) -> None:
        super().__init__()
        self.deaths = deaths

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((method, None))
        if method == "load_weights" and self.deaths:
            self.deaths -= 1
            raise WorkerError("rollout rank 1 died during load_weights", role="rollout", rank=1, died=True)
        return {"rollout/load_s": 0.5}


@pytest.mark.parametrize("deaths", [1, 2])
def test_a_rank_dying_in_a_weight_load_is_restarted_and_the_load_succeeds(deaths: int) -> None:
    # the restart reloads the same weights: the load's metrics are the reload's (not a failed call), and a
    # death during the restart itself is restarted again within the budget
    dispatcher = DiesOnLoads(deaths)
    group = RolloutGroup(dispatcher)  # type: ignore[arg-type]
    group.enable_restarts(2)
    assert group.load_weights({"w": torch.ones(1)}) == {"rollout/load_s": 0.5}
    assert group.restarts == deaths
    assert [m for m, _ in dispatcher.calls].count("restart") == deaths
