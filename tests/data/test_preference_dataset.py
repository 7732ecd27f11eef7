"""Preference pairs: text and chat rows tokenized with the completion mask, interleaved collate, bad rows named."""

from __future__ import annotations

import pytest
import torch

from posttrain.data import keys as K
from posttrain.data.preference_dataset import (
    PAIR_CHOSEN,
    PAIR_INDEX,
    PAIR_MARGIN,
    REF_SEQ_LOG_PROB,
    PreferenceDataset,
    collate_pairs,
)
from posttrain.errors import DataError
from posttrain.models.tokenizer import train_tokenizer

from .conftest import write_rows

CHAT_ROW = {
    "prompt": [{"role": "system", "content": "Add."}, {"role": "user", "content": "What is 2+3?"}],
    "chosen": [{"role": "assistant", "content": "5"}],
    "rejected": [{"role": "assistant", "content": "6"}],
}
TEXT_ROW = {"prompt": "What is 2+3? ", "chosen": "5", "rejected": "16"}


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(
        [f"What is {a}+{b}? {a + b}" for a in range(20) for b in range(20)], vocab_size=400
    )


def completion(tok, item: dict, side: str) -> str:
    return tok.decode(item[side][item[f"{side}_prompt"] :])


def test_chat_and_text_rows(tmp_path, tok) -> None:
    ds = PreferenceDataset(write_rows(tmp_path / "p.jsonl", [CHAT_ROW, TEXT_ROW]), tok, 128)
    chat, text = ds[0], ds[1]
    prompt = tok.apply_chat_template(CHAT_ROW["prompt"], add_generation_prompt=True, tokenize=False)
    assert tok.decode(chat["chosen"]) == prompt + "5<|im_end|>"  # the newline after <|im_end|> is cut
    assert completion(tok, chat, "chosen") == "5<|im_end|>"
    assert completion(tok, chat, "rejected") == "6<|im_end|>"
    assert completion(tok, text, "rejected") == "16<|im_end|>"
    assert tok.decode(text["chosen"][: text["chosen_prompt"]]) == "What is 2+3? "


def test_collate_interleaves_pairs_with_completion_masks(tmp_path, tok) -> None:
    rows = [
        dict(TEXT_ROW, ref_chosen_logps=-1.5, ref_rejected_logps=-4.0),
        dict(CHAT_ROW, ref_chosen_logps=-2, ref_rejected_logps=-3),
    ]
    ds = PreferenceDataset(write_rows(tmp_path / "p.jsonl", rows), tok, 128, with_reference=True)
    b = collate_pairs([ds[0], ds[1]], pad_token_id=tok.pad_token_id)
    assert len(b) == 4
    assert b[PAIR_INDEX].tolist() == [0, 0, 1, 1] and b[PAIR_CHOSEN].tolist() == [1, 0, 1, 0]
    assert b[REF_SEQ_LOG_PROB].tolist() == [-1.5, -4.0, -2.0, -3.0]
    for row, (item, side) in enumerate(
        [(ds[0], "chosen"), (ds[0], "rejected"), (ds[1], "chosen"), (ds[1], "rejected")]
    ):
        n = len(item[side])
        assert b[K.INPUT_IDS][row, :n].tolist() == item[side]
        assert b[K.LOSS_MASK][row].sum() == n - item[f"{side}_prompt"]
        assert b[K.LOSS_MASK][row, : item[f"{side}_prompt"]].sum() == 0
    assert b[K.LOSS_MASK].dtype == torch.float32


def test_chat_rows_from_parquet(tmp_path, tok) -> None:
    rows = [dict(CHAT_ROW, ref_chosen_logps=-2.0, ref_rejected_logps=-3.0)] * 2
    ds = PreferenceDataset(write_rows(tmp_path / "p.parquet", rows), tok, 128, with_reference=True)
    assert completion(tok, ds[1], "chosen") == "5<|im_end|>" and ds[1]["ref_rejected_logps"] == -3.0


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ({"prompt": "x", "rejected": "y"}, r"row 1: missing field 'chosen'"),
        (dict(CHAT_ROW, chosen=[]), r"row 1: field 'chosen' must be a non-empty list"),
        (
            dict(CHAT_ROW, rejected=[{"role": "bot", "content": "6"}]),
            r"row 1: rejected\[0\] has unknown role 'bot'",
        ),
        (dict(CHAT_ROW, chosen="5"), r"row 1: prompt, chosen and rejected must all be text or all chat"),
    ],
)
def test_bad_rows_name_the_row(tmp_path, tok, bad: dict, reason: str) -> None:
    with pytest.raises(DataError, match=reason):
        PreferenceDataset(write_rows(tmp_path / "p.jsonl", [TEXT_ROW, bad]), tok, 128)


def test_reference_columns_required_when_asked(tmp_path, tok) -> None:
    with pytest.raises(DataError, match=r"row 0: missing field 'ref_chosen_logps'"):
        PreferenceDataset(write_rows(tmp_path / "p.jsonl", [TEXT_ROW]), tok, 128, with_reference=True)


def test_overlong_pairs_filtered_or_error(tmp_path, tok) -> None:
    path = write_rows(tmp_path / "p.jsonl", [TEXT_ROW, dict(TEXT_ROW, rejected="1" * 300)])
    assert PreferenceDataset(path, tok, 64).n_filtered == 1
    with pytest.raises(DataError, match=r"row 1: a completion has \d+ tokens"):
        PreferenceDataset(path, tok, 64, overlong="error")


def test_margin_column_read_when_present(tmp_path, tok) -> None:
    rows = [dict(TEXT_ROW, margin=1.5), dict(CHAT_ROW, margin=0)]
    ds = PreferenceDataset(write_rows(tmp_path / "p.jsonl", rows), tok, 128, margin_column="margin")
    assert ds.has_margin and [ds[0]["margin"], ds[1]["margin"]] == [1.5, 0.0]
    b = collate_pairs([ds[0], ds[1]], pad_token_id=tok.pad_token_id)
    assert b[PAIR_MARGIN].tolist() == [1.5, 1.5, 0.0, 0.0]
    plain = PreferenceDataset(write_rows(tmp_path / "q.jsonl", [TEXT_ROW]), tok, 128, margin_column="margin")
    assert plain.has_margin is False and PAIR_MARGIN not in collate_pairs([plain[0]], tok.pad_token_id)
    ignored = PreferenceDataset(write_rows(tmp_path / "r.jsonl", rows), tok, 128)  # no margin_column: dpo
    assert "margin" not in ignored[0]


@pytest.mark.parametrize(
    ("rows", "reason"),
    [
        ([dict(TEXT_ROW, margin=1.0), TEXT_ROW], r"row 1: has no 'margin' but the rows before it have one"),
        ([TEXT_ROW, dict(TEXT_ROW, margin=1.0)], r"row 1: has 'margin' but the rows before it have none"),
        ([dict(TEXT_ROW, margin="big")], r"row 0: field 'margin' must be a finite number"),
    ],
)
def test_margin_every_row_or_none(tmp_path, tok, rows: list, reason: str) -> None:
    with pytest.raises(DataError, match=reason):
        PreferenceDataset(write_rows(tmp_path / "p.jsonl", rows), tok, 128, margin_column="margin")
