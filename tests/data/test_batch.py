"""Batch: construction, row and column operations, their errors, and pickling between processes."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from posttrain.data import Batch
from posttrain.errors import DataError


def make_batch(n: int = 4, width: int = 3) -> Batch:
    return Batch.from_dict(
        tensors={"input_ids": torch.arange(n * width).view(n, width), "score": torch.arange(n).float()},
        non_tensors={"uid": [f"u{i}" for i in range(n)], "extra_info": [{"i": i} for i in range(n)]},
        meta={"temperature": 1.0},
    )


def test_from_dict_and_access():
    b = make_batch()
    assert len(b) == 4
    assert b["input_ids"].shape == (4, 3)
    assert list(b["uid"]) == ["u0", "u1", "u2", "u3"]
    assert b["extra_info"][2] == {"i": 2}
    assert "uid" in b and "input_ids" in b and "nope" not in b
    assert b.keys() == ["input_ids", "score", "uid", "extra_info"]
    assert b.meta == {"temperature": 1.0}
    assert b.non_tensors["uid"].dtype == object


def test_from_dict_keeps_equal_length_lists_one_dimensional():
    b = Batch.from_dict(non_tensors={"pairs": [[1, 2], [3, 4]]})
    assert b["pairs"].shape == (2,)
    assert b["pairs"][1] == [3, 4]


def test_from_dict_length_mismatch_names_keys():
    with pytest.raises(DataError, match=r"'input_ids'.*3.*'uid'.*2"):
        Batch.from_dict({"input_ids": torch.zeros(3, 2)}, {"uid": ["a", "b"]})


def test_from_dict_rejects_scalar_tensor():
    with pytest.raises(DataError, match="'x' is 0-d"):
        Batch.from_dict({"x": torch.tensor(1.0)})


def test_missing_key_is_error():
    with pytest.raises(DataError, match="no column 'nope'"):
        make_batch()["nope"]


def test_chunk_equal_parts_and_error():
    parts = make_batch(6).chunk(3)
    assert [len(p) for p in parts] == [2, 2, 2]
    assert parts[1]["input_ids"].tolist() == [[6, 7, 8], [9, 10, 11]]
    assert list(parts[2]["uid"]) == ["u4", "u5"]
    with pytest.raises(DataError, match="6 rows into 4"):
        make_batch(6).chunk(4)


def test_split_last_smaller():
    parts = make_batch(5).split(2)
    assert [len(p) for p in parts] == [2, 2, 1]
    assert list(parts[2]["uid"]) == ["u4"]


def test_concat_roundtrip_and_meta_from_first():
    b = make_batch(6)
    other = make_batch(2)
    other.meta["temperature"] = 0.5
    joined = Batch.concat([*b.split(4), other])
    assert len(joined) == 8
    assert torch.equal(joined["input_ids"][:6], b["input_ids"])
    assert list(joined["uid"][6:]) == ["u0", "u1"]
    assert joined.meta == {"temperature": 1.0}


def test_concat_width_mismatch_names_key():
    with pytest.raises(DataError, match=r"'input_ids'.*\(3,\).*\(5,\)"):
        Batch.concat([make_batch(2, width=3), make_batch(2, width=5)])


def test_concat_column_mismatch_and_empty():
    with pytest.raises(DataError, match="columns"):
        Batch.concat([make_batch(2), make_batch(2).select(non_tensor_keys=["uid"])])
    with pytest.raises(DataError, match="empty"):
        Batch.concat([])


def test_repeat_interleave_and_tile():
    b = make_batch(2)
    inter = b.repeat(3)
    assert list(inter["uid"]) == ["u0", "u0", "u0", "u1", "u1", "u1"]
    assert inter["score"].tolist() == [0, 0, 0, 1, 1, 1]
    tiled = b.repeat(2, interleave=False)
    assert list(tiled["uid"]) == ["u0", "u1", "u0", "u1"]
    assert tiled["input_ids"][2].tolist() == b["input_ids"][0].tolist()


def test_select_keeps_named_and_none_keeps_all():
    b = make_batch()
    s = b.select(tensor_keys=["score"], non_tensor_keys=[])
    assert s.keys() == ["score"]
    assert len(s) == 4
    assert b.select(non_tensor_keys=["uid"]).keys() == ["input_ids", "score", "uid"]
    with pytest.raises(DataError, match="unknown columns \\['nope'\\]"):
        b.select(tensor_keys=["nope"])


def test_union_merges_columns_and_meta():
    b = make_batch()
    extra = Batch.from_dict({"values": torch.ones(4)}, {"text": list("abcd")}, {"step": 3})
    u = b | extra
    assert set(u.keys()) == {"input_ids", "score", "uid", "extra_info", "values", "text"}
    assert u.meta == {"temperature": 1.0, "step": 3}
    assert "values" not in b  # union does not modify its operands


def test_union_equal_values_ok_conflict_is_error():
    b = make_batch()
    same = b.select(tensor_keys=["input_ids"], non_tensor_keys=["uid"])
    assert len(b.union(same).keys()) == 4
    changed = Batch.from_dict({"score": torch.zeros(4)})
    with pytest.raises(DataError, match="'score'"):
        b.union(changed)
    with pytest.raises(DataError, match="meta 'temperature'"):
        b.union(Batch.from_dict({"score": b["score"]}, meta={"temperature": 0.7}))
    with pytest.raises(DataError, match="4 and 2 rows"):
        b.union(make_batch(2))


def test_index_by_list_tensor_mask_slice():
    b = make_batch(5)
    assert list(b.index([4, 0])["uid"]) == ["u4", "u0"]
    assert b.index(torch.tensor([1, 3]))["score"].tolist() == [1.0, 3.0]
    mask = torch.tensor([True, False, True, False, False])
    assert list(b.index(mask)["uid"]) == ["u0", "u2"]
    assert list(b.index([False, True, False, False, True])["uid"]) == ["u1", "u4"]
    assert list(b.index(np.array([2]))["uid"]) == ["u2"]
    assert list(b[3]["uid"]) == ["u3"]
    assert b.index(slice(3, None))["input_ids"].tolist() == [[9, 10, 11], [12, 13, 14]]
    with pytest.raises(DataError, match="out of range"):
        b.index([7])
    with pytest.raises(DataError, match="bool mask"):
        b.index(torch.tensor([True, False]))


def test_to_device_pop_and_set():
    b = make_batch().to("cpu")
    assert b["input_ids"].device.type == "cpu"
    popped = b.pop("score")
    assert popped.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert "score" not in b
    b.set("reward", torch.ones(4))
    b.set("text", ["a", "b", "c", "d"])
    assert b["reward"].sum().item() == 4.0
    assert list(b["text"]) == ["a", "b", "c", "d"]
    with pytest.raises(DataError, match="'bad' has 3 rows"):
        b.set("bad", torch.ones(3))
    with pytest.raises(DataError, match="no column"):
        b.pop("score")


def test_pickle_roundtrip():
    b = make_batch()
    b2 = pickle.loads(pickle.dumps(b))
    assert torch.equal(b2["input_ids"], b["input_ids"])
    assert list(b2["uid"]) == list(b["uid"])
    assert b2["extra_info"][3] == {"i": 3}
    assert b2.meta == b.meta
    assert isinstance(b2["uid"], np.ndarray)
    assert len(b2.chunk(2)) == 2
