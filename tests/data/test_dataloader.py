"""PromptDataLoader: deterministic epochs from (seed, epoch), uids, wrap-around, exact resume."""

from __future__ import annotations

from functools import partial

import pytest

from posttrain.data import keys as K
from posttrain.data.dataloader import PromptDataLoader
from posttrain.data.dataset import PromptDataset, collate_prompts
from posttrain.data.sft_dataset import SFTDataset, collate_sft
from posttrain.errors import DataError

from .conftest import make_row, write_rows


@pytest.fixture
def dataset(tmp_path, tokenizer):
    return PromptDataset(write_rows(tmp_path / "t.parquet", [make_row(i) for i in range(10)]), tokenizer, 64)


def loader(dataset, tokenizer, **kwargs):
    collate = partial(collate_prompts, pad_token_id=tokenizer.pad_token_id)
    return PromptDataLoader(dataset, batch_size=kwargs.pop("batch_size", 3), collate_fn=collate, **kwargs)


def indices(batches):
    return [list(b[K.INDEX]) for b in batches]


def test_epoch_covers_dataset_and_drop_last(dataset, tokenizer):
    dl = loader(dataset, tokenizer)
    assert len(dl) == 3
    epoch0 = list(dl)
    assert [len(b) for b in epoch0] == [3, 3, 3]
    flat = [i for b in indices(epoch0) for i in b]
    assert len(set(flat)) == 9
    assert flat != sorted(flat)  # shuffled
    assert dl.state_dict() == {"epoch": 1, "position": 0}
    assert all(u == f"0-{i}" for b in epoch0 for u, i in zip(b[K.UID], b[K.INDEX], strict=True))
    epoch1 = list(dl)
    assert epoch1[0][K.UID][0].startswith("1-")
    assert indices(epoch1) != indices(epoch0)


def test_no_shuffle_keep_last(dataset, tokenizer):
    dl = loader(dataset, tokenizer, shuffle=False, drop_last=False, batch_size=4)
    assert indices(list(dl)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_same_seed_same_order_other_seed_differs(dataset, tokenizer):
    a = [indices(list(loader(dataset, tokenizer, seed=1))) for _ in range(2)]
    assert a[0] == a[1]
    assert indices(list(loader(dataset, tokenizer, seed=2))) != a[0]


def test_next_batch_wraps_epochs(dataset, tokenizer):
    dl = loader(dataset, tokenizer)
    uids = [dl.next_batch()[K.UID][0] for _ in range(4)]
    assert [u.split("-")[0] for u in uids] == ["0", "0", "0", "1"]
    assert next(dl)[K.UID][0].startswith("1-")
    assert dl.state_dict() == {"epoch": 1, "position": 2}


def test_resume_yields_identical_batches(dataset, tokenizer):
    full = loader(dataset, tokenizer, seed=7)
    reference = [full.next_batch() for _ in range(8)]

    first = loader(dataset, tokenizer, seed=7)
    for _ in range(4):
        first.next_batch()
    state = first.state_dict()
    resumed = loader(dataset, tokenizer, seed=7)
    resumed.load_state_dict(state)
    rest = [resumed.next_batch() for _ in range(4)]
    for want, got in zip(reference[4:], rest, strict=True):
        assert list(got[K.UID]) == list(want[K.UID])
        assert got[K.INPUT_IDS].tolist() == want[K.INPUT_IDS].tolist()


def test_resume_mid_epoch_with_iteration(dataset, tokenizer):
    dl = loader(dataset, tokenizer)
    it = iter(dl)
    next(it)
    resumed = loader(dataset, tokenizer)
    resumed.load_state_dict(dl.state_dict())
    assert indices(list(resumed)) == indices(list(it))


def test_sft_collate_works(tmp_path, tokenizer):
    ds = SFTDataset(write_rows(tmp_path / "s.jsonl", [make_row(i) for i in range(4)]), tokenizer, 64)
    dl = PromptDataLoader(ds, 2, partial(collate_sft, pad_token_id=tokenizer.pad_token_id), seed=3)
    batches = list(dl)
    assert len(batches) == 2
    assert K.LOSS_MASK in batches[0]
    assert all(u.startswith("0-") for u in batches[1][K.UID])


def test_errors(dataset, tokenizer):
    with pytest.raises(DataError, match="batch_size=11 is larger than the dataset \\(10 rows\\)"):
        loader(dataset, tokenizer, batch_size=11)
    with pytest.raises(DataError, match="'position'"):
        loader(dataset, tokenizer).load_state_dict({"epoch": 0})
