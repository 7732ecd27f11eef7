"""Tests for posttrain/data/mm_sft_dataset.py: verl multimodal rows as SFT rows (ids, loss mask, images)."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from posttrain.data import keys
from posttrain.data.mm_dataset import MULTI_MODAL_INPUTS
from posttrain.data.mm_sft_dataset import MultimodalSFTDataset, collate_multimodal_sft
from posttrain.data.tasks.shapes import corpus, write_shapes_dataset
from posttrain.errors import DataError
from posttrain.models.tokenizer import VISION_TOKENS, VL_CHAT_TEMPLATE, train_tokenizer
from posttrain.models.vl import VLProcessor, make_image_processor


@pytest.fixture(scope="module")
def processor() -> VLProcessor:
    tok = train_tokenizer(corpus(200), 400, extra_special_tokens=VISION_TOKENS)
    tok.chat_template = VL_CHAT_TEMPLATE
    return VLProcessor(make_image_processor(14, 2, 56 * 56, 112 * 112), tok)


def png(size: tuple[int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, "red").save(buf, format="PNG")
    return buf.getvalue()


def write_rows(path, rows: list[dict]) -> None:
    pq.write_table(pa.Table.from_pylist(rows), path)


def row(text: str, images: list, answer: str = "3") -> dict:
    return {"prompt": [{"role": "user", "content": text}], "images": images, "extra_info": {"answer": answer}}


def test_shapes_rows_mask_the_response_only_and_carry_their_images(tmp_path, processor):
    paths = write_shapes_dataset(tmp_path, n_train=6, n_test=2, seed=0)
    ds = MultimodalSFTDataset(paths["train"], processor, 64, min_pixels=56 * 56, max_pixels=112 * 112)
    assert len(ds) == 6
    item = ds[0]
    ids, mask = item["input_ids"], item[keys.LOSS_MASK]
    assert ids.count(processor.image_token_id) == 4  # a 56x56 image: 4x4 patches merged 2x2
    answer_text = pq.read_table(paths["train"]).to_pylist()[0]["extra_info"]["answer"]
    answer = processor.tokenizer.encode(answer_text + "<|im_end|>", add_special_tokens=False)
    assert (
        ids[-len(answer) :] == answer
        and sum(mask) == len(answer)
        and mask[-len(answer) :] == [1] * len(answer)
    )
    assert item[MULTI_MODAL_INPUTS]["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert item[MULTI_MODAL_INPUTS]["pixel_values"].shape[0] == 16


def test_everything_trains_on_text_never_on_image_tokens(tmp_path, processor):
    write_rows(tmp_path / "d.parquet", [row("<image>How many?", [png((56, 56))])])
    ds = MultimodalSFTDataset(
        tmp_path / "d.parquet", processor, 64, train_on="everything", min_pixels=56 * 56, max_pixels=112 * 112
    )
    ids, mask = ds[0]["input_ids"], ds[0][keys.LOSS_MASK]
    assert all(m == 0 for t, m in zip(ids, mask, strict=True) if t == processor.image_token_id)
    assert all(m == 1 for t, m in zip(ids, mask, strict=True) if t != processor.image_token_id)


def test_collate_keeps_images_per_row_and_rows_without_images(tmp_path, processor):
    write_rows(
        tmp_path / "d.parquet",
        [
            row("<image>one", [png((56, 56))]),
            row("no image here", []),
            row("<image> and <image>", [png((112, 56)), png((56, 56))]),
        ],
    )
    ds = MultimodalSFTDataset(tmp_path / "d.parquet", processor, 64, min_pixels=56 * 56, max_pixels=112 * 112)
    batch = collate_multimodal_sft([ds[i] for i in range(3)], pad_token_id=0)
    mm = batch[MULTI_MODAL_INPUTS]
    assert mm[1] == {} and mm[2]["image_grid_thw"].tolist() == [[1, 4, 8], [1, 4, 4]]
    for r in range(3):  # each row's image tokens match its own grids
        n_tokens = int((batch[keys.INPUT_IDS][r] == processor.image_token_id).sum())
        expected = int(mm[r]["image_grid_thw"].prod(-1).sum()) // 4 if mm[r] else 0
        assert n_tokens == expected
    picked = batch.index([2, 0])  # row operations move a row's images with it
    assert torch.equal(picked[MULTI_MODAL_INPUTS][0]["pixel_values"], mm[2]["pixel_values"])


def test_a_missing_or_unreadable_image_names_the_row(tmp_path, processor):
    images = [{"bytes": png((56, 56)), "path": None}], [{"bytes": None, "path": "nope.png"}]
    write_rows(tmp_path / "d.parquet", [row("<image>ok", images[0]), row("<image>gone", images[1])])
    with pytest.raises(DataError, match=r"d.parquet: row 1: image 0: image file not found"):
        MultimodalSFTDataset(tmp_path / "d.parquet", processor, 64)
    write_rows(tmp_path / "e.parquet", [row("<image>bad", [b"not an image"])])
    with pytest.raises(DataError, match=r"e.parquet: row 0: image 0: cannot read image"):
        MultimodalSFTDataset(tmp_path / "e.parquet", processor, 64)
    write_rows(tmp_path / "f.parquet", [row("two <image><image>", [png((56, 56))])])
    with pytest.raises(
        DataError, match=r"f.parquet: row 0: the prompt has 2 <image> placeholders but 1 images"
    ):
        MultimodalSFTDataset(tmp_path / "f.parquet", processor, 64)


def test_a_response_holding_the_image_token_is_refused_naming_the_row(tmp_path, processor):
    """It would become an image token with no image behind it, found only in the middle of training."""
    rows = [
        row("<image>how many?", [png((56, 56))]),
        row("<image>how many?", [png((56, 56))], "3<|image_pad|>"),
    ]
    write_rows(tmp_path / "r.parquet", rows)
    with pytest.raises(DataError, match=r"r.parquet: row 1: field 'extra_info.answer' holds the image token"):
        MultimodalSFTDataset(tmp_path / "r.parquet", processor, 64)
