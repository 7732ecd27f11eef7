"""How a WorkerGroup splits a Batch over ranks, without Ray: over every rank, or over the data-parallel groups
of sequence parallelism (the sp consecutive ranks of a group get the same rows)."""

from __future__ import annotations

import logging

import pytest
import torch

from posttrain.controller.worker_group import LocalWorkerGroup, _split_args, gather
from posttrain.data.batch import Batch
from posttrain.errors import ConfigError, WorkerError


def rows(n: int) -> Batch:
    return Batch.from_dict({"x": torch.arange(n)})


def test_a_batch_is_split_over_every_rank_by_default() -> None:
    per_rank = _split_args([rows(8), "same"], {"b": rows(8)}, world_size=4)
    assert [a[0]["x"].tolist() for a, _ in per_rank] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [k["b"]["x"].tolist() for _, k in per_rank] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert all(a[1] == "same" for a, _ in per_rank)


def test_the_ranks_of_a_sequence_parallel_group_get_the_same_rows() -> None:
    # world 4 = dp 2 x sp 2: ranks 0, 1 form group 0 and ranks 2, 3 group 1 (the engine's (dp, sp) mesh)
    per_rank = _split_args([rows(6)], {"b": rows(6)}, world_size=4, replicas=2)
    assert [a[0]["x"].tolist() for a, _ in per_rank] == [[0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5]]
    assert [k["b"]["x"].tolist() for _, k in per_rank] == [[0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5]]


def test_a_batch_must_split_evenly_over_the_groups() -> None:
    _split_args([rows(3)], {}, world_size=2, replicas=2)  # one group of 2: any size
    with pytest.raises(WorkerError, match="3 rows cannot be split evenly across 2 data-parallel groups"):
        _split_args([rows(3)], {}, world_size=4, replicas=2)


def test_an_uneven_batch_is_a_deterministic_error_of_the_role() -> None:
    # the same batch fails the same way after any restart: not worth one (trainers/fault.py)
    with pytest.raises(WorkerError, match="actor_rollout_ref: a batch of 3 rows") as caught:
        _split_args([rows(3)], {}, world_size=2, role="actor_rollout_ref")
    assert caught.value.deterministic and caught.value.role == "actor_rollout_ref"


class _Raising:
    def __init__(self, spec: object, info: object) -> None:
        self.spec = spec

    def bad_input(self) -> None:
        raise ConfigError("unknown loss option 'foo'")

    def crash(self) -> None:
        raise RuntimeError(
            "CUDA error: an illegal memory access was encountered\nCompile with TORCH_USE_CUDA_DSA"
        )


def test_the_local_group_classifies_errors_as_the_ray_group_does(caplog: pytest.LogCaptureFixture) -> None:
    group = LocalWorkerGroup(_Raising, None, role="critic")
    with pytest.raises(
        WorkerError, match="critic rank 0 raised in bad_input: ConfigError: unknown loss"
    ) as bad:
        group.call("bad_input")
    assert bad.value.deterministic and (bad.value.role, bad.value.rank) == ("critic", 0)
    with caplog.at_level(logging.WARNING), pytest.raises(WorkerError) as crash:
        group.call("crash")
    # the first line states the cause; the rest (and the traceback) goes to the log
    assert str(crash.value) == (
        "critic rank 0 raised in crash: RuntimeError: CUDA error: an illegal memory access was encountered [...]"
    )
    assert not crash.value.deterministic
    assert "Traceback" in caplog.text and "TORCH_USE_CUDA_DSA" in caplog.text


def test_metrics_reported_by_some_ranks_only_are_kept() -> None:
    merged = gather([{"loss": 1.0}, {"loss": 3.0, "actor/replayed": 4.0}, {"loss": 2.0, "x_max": 5.0}])
    assert merged == {"loss": 2.0, "actor/replayed": 4.0, "x_max": 5.0}
