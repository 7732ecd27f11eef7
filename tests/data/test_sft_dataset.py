"""SFTDataset: prompt + response + eos tokens, the response loss mask, filtering, right-padded collate."""

from __future__ import annotations

import pytest
import torch

from posttrain.data import keys as K
from posttrain.data.sft_dataset import SFTDataset, collate_sft
from posttrain.errors import DataError

from .conftest import make_row, write_rows


def test_tokens_and_loss_mask(tmp_path, tokenizer):
    path = write_rows(tmp_path / "train.parquet", [make_row(432)])
    ds = SFTDataset(path, tokenizer, max_length=64)
    item = ds[0]
    prompt = tokenizer.apply_chat_template(
        make_row(432)["prompt"], add_generation_prompt=True, tokenize=False
    )
    n_prompt = len(tokenizer.encode(prompt, add_special_tokens=False))
    assert tokenizer.decode(item["input_ids"]) == prompt + "432<|im_end|>"
    assert item["loss_mask"] == [0] * n_prompt + [1] * (len(item["input_ids"]) - n_prompt)
    # the masked part is exactly the response and the eos
    response = [t for t, m in zip(item["input_ids"], item["loss_mask"], strict=True) if m]
    assert tokenizer.decode(response) == "432<|im_end|>"
    assert response[-1] == tokenizer.eos_token_id


def test_response_key_is_a_dotted_path(tmp_path, tokenizer):
    row = make_row(1)
    row["extra_info"]["solution"] = {"text": "one"}
    ds = SFTDataset(
        write_rows(tmp_path / "t.jsonl", [row]), tokenizer, 64, response_key="extra_info.solution.text"
    )
    response = [t for t, m in zip(ds[0]["input_ids"], ds[0]["loss_mask"], strict=True) if m]
    assert tokenizer.decode(response) == "one<|im_end|>"


def test_missing_response_names_row_and_field(tmp_path, tokenizer):
    rows = [make_row(0), make_row(1)]
    del rows[1]["extra_info"]["answer"]
    with pytest.raises(DataError, match=r"t\.jsonl: row 1: missing field 'extra_info.answer'"):
        SFTDataset(write_rows(tmp_path / "t.jsonl", rows), tokenizer, max_length=64)


def test_overlong_filtered_or_error(tmp_path, tokenizer):
    rows = [make_row(0), make_row(1), make_row(2)]
    rows[1]["extra_info"]["answer"] = "z" * 200
    path = write_rows(tmp_path / "t.jsonl", rows)
    ds = SFTDataset(path, tokenizer, max_length=64)
    assert ds.n_filtered == 1
    assert len(ds) == 2
    with pytest.raises(DataError, match=r"row 1: prompt \+ response has \d+ tokens, max_length is 64"):
        SFTDataset(path, tokenizer, max_length=64, overlong="error")


def test_collate_right_pads(tmp_path, tokenizer):
    rows = [make_row(1), make_row(2)]
    rows[1]["extra_info"]["answer"] = "a much longer answer"
    ds = SFTDataset(write_rows(tmp_path / "t.jsonl", rows), tokenizer, max_length=64)
    short, long = ds[0], ds[1]
    b = collate_sft([short, long], pad_token_id=tokenizer.pad_token_id, uids=["0-0", "0-1"])
    n, width = len(short["input_ids"]), len(long["input_ids"])
    assert b[K.INPUT_IDS].shape == (2, width)
    assert b[K.INPUT_IDS][0, :n].tolist() == short["input_ids"]
    assert b[K.INPUT_IDS][0, n:].tolist() == [tokenizer.pad_token_id] * (width - n)
    assert b[K.ATTENTION_MASK][0].tolist() == [1] * n + [0] * (width - n)
    assert b[K.POSITION_IDS][0, :n].tolist() == list(range(n))
    assert b[K.LOSS_MASK].dtype == torch.float32
    assert b[K.LOSS_MASK][0].tolist() == [float(m) for m in short["loss_mask"]] + [0.0] * (width - n)
    assert b[K.LOSS_MASK][1].tolist() == [float(m) for m in long["loss_mask"]]
    assert list(b[K.UID]) == ["0-0", "0-1"]
    assert K.UID not in collate_sft([short], pad_token_id=0)


def test_a_rows_first_token_is_never_a_trained_token(tmp_path, tokenizer):
    """Nothing precedes it to predict it: a text row (or one trained on everything) counts one token fewer,
    as TRL's shifted labels do; otherwise the gradient and val/nll are scaled by n / (n + 1)."""
    ids = tokenizer.encode("one two three", add_special_tokens=False)
    b = collate_sft([{"input_ids": ids, K.LOSS_MASK: [1] * len(ids), "index": 0}], pad_token_id=0)
    assert b[K.LOSS_MASK][0].tolist() == [0.0] + [1.0] * (len(ids) - 1)


def test_a_prompt_rows_response_ends_as_the_template_ends_an_assistant_turn(tmp_path, tokenizer):
    """Gemma's template ends a turn with <end_of_turn> while its eos is <eos>: the response must end with the
    former, or SFT teaches a terminator the chat format never uses (and agents could not render a turn)."""
    import copy
    import json

    from posttrain.agents.chat_render import ChatRenderer
    from posttrain.data.chat_masks import end_of_turn_token
    from posttrain.models import load_tokenizer

    assert end_of_turn_token(tokenizer) == tokenizer.eos_token  # Qwen's <|im_end|> is both
    gemma = copy.deepcopy(tokenizer)
    gemma.add_special_tokens({"additional_special_tokens": ["<end_of_turn>", "<start_of_turn>"]})
    gemma.chat_template = (
        "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    )
    assert end_of_turn_token(gemma) == "<end_of_turn>" != gemma.eos_token
    assert ChatRenderer(gemma).end_of_turn == "<end_of_turn>"  # the agents stop on it themselves
    path = write_rows(tmp_path / "rows.jsonl", [make_row(0)])
    end_of_turn = gemma.convert_tokens_to_ids("<end_of_turn>")
    for stops, last in (
        ([gemma.eos_token_id, end_of_turn], end_of_turn),
        ([gemma.eos_token_id], gemma.eos_token_id),
    ):
        # SFT ends a response with the turn's end only where generation stops at it (Gemma-it's eos list);
        # a base model's template (Qwen2.5 base) would teach an end the rollout runs past: eos then
        model_dir = tmp_path / f"model-{len(stops)}"
        gemma.save_pretrained(model_dir)
        (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
        saved = load_tokenizer(model_dir)
        assert SFTDataset(path, saved, max_length=64)[0]["input_ids"][-1] == last
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    assert end_of_turn_token(bare) == tokenizer.eos_token  # no template: the eos
