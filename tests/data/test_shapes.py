"""Tests for posttrain/data/tasks/shapes.py: the built-in visual task loads as multimodal prompts and its
images show what the answer says."""

from __future__ import annotations

import io

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from posttrain.data.mm_dataset import MULTI_MODAL_INPUTS, MultimodalPromptDataset
from posttrain.data.tasks.shapes import COLORS, corpus, write_shapes_dataset
from posttrain.errors import DataError
from posttrain.models.tokenizer import VISION_TOKENS, VL_CHAT_TEMPLATE, train_tokenizer
from posttrain.models.vl import VLProcessor, make_image_processor


def squares_in(img: Image.Image, side: int = 28) -> list[tuple[int, int, int]]:
    """Colours at the centres of the grid cells that are not white."""
    a = np.asarray(img.convert("RGB"))
    cells = a.shape[0] // side
    centres = [
        tuple(a[r * side + side // 2, c * side + side // 2]) for r in range(cells) for c in range(cells)
    ]
    return [tuple(int(v) for v in px) for px in centres if px != (255, 255, 255)]


@pytest.mark.parametrize("kind", ["count", "color"])
def test_images_match_the_answers_and_load_as_prompts(tmp_path, kind):
    paths = write_shapes_dataset(tmp_path, n_train=30, n_test=5, kind=kind, seed=1)
    rows = pq.read_table(paths["train"]).to_pylist()
    assert len(rows) == 30 and len(pq.read_table(paths["test"]).to_pylist()) == 5
    for row in rows:
        img = Image.open(io.BytesIO(row["images"][0]["bytes"]))
        assert img.size == (56, 56)
        found = squares_in(img)
        answer = row["reward_model"]["ground_truth"]
        if kind == "count":
            assert len(found) == int(answer) and 1 <= int(answer) <= 4
        else:
            assert found == [COLORS[answer]]
    answers = {r["reward_model"]["ground_truth"] for r in rows}
    assert len(answers) >= 3  # the answers vary

    tok = train_tokenizer(corpus(200), 400, extra_special_tokens=VISION_TOKENS)
    tok.chat_template = VL_CHAT_TEMPLATE
    processor = VLProcessor(make_image_processor(14, 2, 56 * 56, 112 * 112), tok)
    ds = MultimodalPromptDataset(paths["train"], processor, 64)
    assert len(ds) == 30
    assert ds[0][MULTI_MODAL_INPUTS]["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert ds[0]["input_ids"].count(processor.image_token_id) == 4


def test_cells_follow_square_side_and_a_bad_side_is_refused(tmp_path):
    """84-pixel images with 28-pixel cells: 9 cells (one per tiny-vl image token), up to 6 squares; 14-pixel
    cells on 56 pixels: 16 cells. A side that fits no cell, or more squares than cells, is a DataError."""
    for size, side, max_squares in ((84, 28, 6), (56, 14, 9)):
        paths = write_shapes_dataset(
            tmp_path / f"{size}-{side}", n_train=40, n_test=2, size=size, square_side=side,
            max_squares=max_squares, seed=2,
        )  # fmt: skip
        counts = []
        for row in pq.read_table(paths["train"]).to_pylist():
            img = Image.open(io.BytesIO(row["images"][0]["bytes"]))
            assert img.size == (size, size)
            counts.append(len(squares_in(img, side)))
            assert counts[-1] == int(row["reward_model"]["ground_truth"])
        assert max(counts) > 4  # more squares than a 2x2 grid could hold
    with pytest.raises(DataError, match="square_side=2"):
        write_shapes_dataset(tmp_path / "bad", n_train=2, n_test=1, square_side=2)
    with pytest.raises(DataError, match="do not fit"):
        write_shapes_dataset(tmp_path / "full", n_train=20, n_test=1, max_squares=5)


def test_same_seed_same_data_and_unknown_kind(tmp_path):
    a = write_shapes_dataset(tmp_path / "a", n_train=5, n_test=2, seed=3)
    b = write_shapes_dataset(tmp_path / "b", n_train=5, n_test=2, seed=3)
    assert pq.read_table(a["train"]).to_pylist() == pq.read_table(b["train"]).to_pylist()
    with pytest.raises(DataError, match="valid kinds: count, color"):
        write_shapes_dataset(tmp_path / "c", kind="triangles")


def test_data_command_writes_the_task(tmp_path):
    from posttrain.cli import main

    assert (
        main(["data", "shapes", "--out", str(tmp_path), "--n-train", "8", "--n-test", "2", "--kind", "color"])
        == 0
    )
    rows = pq.read_table(tmp_path / "train.parquet").to_pylist()
    assert len(rows) == 8 and rows[0]["extra_info"]["kind"] == "color"
