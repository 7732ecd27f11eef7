"""How a WorkerGroup splits a Batch over ranks, without Ray: over every rank, or over the data-parallel groups
of sequence parallelism (the sp consecutive ranks of a group get the same rows)."""

from __future__ import annotations

import pytest
import torch

from posttrain.controller.worker_group import _split_args
from posttrain.data.batch import Batch
from posttrain.errors import WorkerError


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
