"""Tests for posttrain/data/images.py and posttrain/data/mm_dataset.py: verl's multimodal rows, lazy images,
pixel bounds, image tokens against max_prompt_length, errors naming the row."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw

from posttrain.data.images import (
    ImageRef,
    fit_pixels,
    load_image,
    open_image,
    parse_image_refs,
    split_image_placeholders,
)
from posttrain.data.mm_dataset import (
    MULTI_MODAL_INPUTS,
    MultimodalPromptDataset,
    collate_multimodal_prompts,
)
from posttrain.errors import DataError
from posttrain.models.tokenizer import VISION_TOKENS, VL_CHAT_TEMPLATE, train_tokenizer
from posttrain.models.vl import VLProcessor, make_image_processor

from .conftest import make_row, write_rows

# 56x56 .. 112x112 after the processor: 4 .. 16 image tokens per image
MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112


@pytest.fixture(scope="module")
def processor() -> VLProcessor:
    texts = ["How many squares are there? 3", "What color is the square? red blue green"] * 20
    tok = train_tokenizer(texts, 400, extra_special_tokens=VISION_TOKENS)
    tok.chat_template = VL_CHAT_TEMPLATE
    return VLProcessor(make_image_processor(14, 2, MIN_PIXELS, MAX_PIXELS), tok)


def png(size: tuple[int, int], color: str = "red") -> bytes:
    img = Image.new("RGB", size, "white")
    ImageDraw.Draw(img).rectangle((4, 4, size[0] // 2, size[1] // 2), fill=color)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def image_row(i: int, images: list, content: str = "<image>What color is the square?") -> dict:
    return {**make_row(i, content), "images": images}


def test_fit_pixels_keeps_aspect_within_bounds():
    assert fit_pixels(100, 100, 10, 100_000) == (100, 100)
    w, h = fit_pixels(400, 200, 10, 20_000)
    assert w * h <= 20_000 and abs(w / h - 2) < 0.02
    w, h = fit_pixels(10, 20, 5_000, 100_000)
    assert w * h >= 5_000 and abs(h / w - 2) < 0.05
    with pytest.raises(DataError, match="min_pixels"):
        fit_pixels(10, 10, 100, 10)


def test_refs_from_paths_bytes_and_dicts(tmp_path):
    row = {
        "images": ["a.png", str(tmp_path / "b.png"), b"xx", {"bytes": b"yy", "path": None}, {"path": "c.png"}]
    }
    refs = parse_image_refs(row, "images", tmp_path, "f: row 0")
    assert refs == [
        ImageRef(path=tmp_path / "a.png"),  # relative to the dataset file's folder
        ImageRef(path=tmp_path / "b.png"),
        ImageRef(data=b"xx"),
        ImageRef(data=b"yy"),
        ImageRef(path=tmp_path / "c.png"),
    ]
    assert parse_image_refs({}, "images", tmp_path, "w") == []
    with pytest.raises(DataError, match="row 3: image 0"):
        parse_image_refs({"images": [{"size": 3}]}, "images", tmp_path, "f: row 3")


def test_load_image_decodes_rgb_and_resizes(tmp_path):
    img = load_image(ImageRef(data=png((400, 300))), 0, 200 * 150, "w")
    assert img.mode == "RGB" and img.size == (200, 150)


def test_placeholders_become_image_parts_and_must_match_the_images():
    msgs = [{"role": "user", "content": "Left <image> right <image>?"}]
    out = split_image_placeholders(msgs, 2, "w")
    assert out[0]["content"] == [
        {"type": "text", "text": "Left "},
        {"type": "image"},
        {"type": "text", "text": " right "},
        {"type": "image"},
        {"type": "text", "text": "?"},
    ]
    with pytest.raises(DataError, match="row 7: the prompt has 2 <image> placeholders but 1 images"):
        split_image_placeholders(msgs, 1, "f: row 7")


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_dataset_rows_with_one_or_several_images(tmp_path, processor, suffix):
    (tmp_path / "sq.png").write_bytes(png((56, 56), "blue"))
    if suffix == ".parquet":  # Hugging Face datasets' image struct: {"bytes", "path"}, one of them set
        one = [{"bytes": png((56, 56)), "path": None}]
        two = [{"bytes": None, "path": "sq.png"}] * 2
    else:
        one, two = ["sq.png"], ["sq.png", "sq.png"]
    rows = [
        image_row(0, one),
        image_row(1, two, "<image> and <image>: same color?"),
        make_row(2),  # a text-only row in the same file
    ]
    ds = MultimodalPromptDataset(
        write_rows(tmp_path / f"d{suffix}", rows),
        processor,
        200,
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
    )
    assert len(ds) == 3
    pad = processor.image_token_id
    first, second, text_only = ds[0], ds[1], ds[2]
    assert first["input_ids"].count(pad) == 4  # 56x56: a 4x4 patch grid, 2x2 merged
    assert second["input_ids"].count(pad) == 8
    assert first[MULTI_MODAL_INPUTS]["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert second[MULTI_MODAL_INPUTS]["pixel_values"].shape == (32, 3 * 2 * 14 * 14)
    assert text_only[MULTI_MODAL_INPUTS] == {} and pad not in text_only["input_ids"]
    assert first["raw_prompt"].startswith("<|im_start|>user\n<|vision_start|><|image_pad|>")

    batch = collate_multimodal_prompts([first, second, text_only], 0, ["a", "b", "c"])
    assert batch.tensors["input_ids"].shape[0] == 3
    repeated = batch.repeat(2)  # a row's pixels travel with it (GRPO groups)
    grids = [mm["image_grid_thw"].tolist() if mm else None for mm in repeated.non_tensors[MULTI_MODAL_INPUTS]]
    assert grids == [[[1, 4, 4]]] * 2 + [[[1, 4, 4], [1, 4, 4]]] * 2 + [None] * 2


def test_image_tokens_count_against_max_prompt_length(tmp_path, processor):
    small, large = png((56, 56)), png((400, 400))  # 4 and 16 image tokens
    path = write_rows(tmp_path / "d.jsonl", [image_row(0, ["s.png"]), image_row(1, ["l.png"])])
    (tmp_path / "s.png").write_bytes(small)
    (tmp_path / "l.png").write_bytes(large)
    n_small = len(
        MultimodalPromptDataset(path, processor, 10_000, max_pixels=MAX_PIXELS, min_pixels=MIN_PIXELS)[0][
            "input_ids"
        ]
    )
    ds = MultimodalPromptDataset(path, processor, n_small + 5, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    assert len(ds) == 1 and ds.n_filtered == 1  # the text is the same length; only the image tokens differ
    with pytest.raises(DataError, match=r"row 1: prompt has \d+ tokens \(16 of them for 1 images\)"):
        MultimodalPromptDataset(
            path, processor, n_small + 5, overlong="error", min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS
        )
    # tighter pixel bounds: the large image shrinks to 4 tokens and fits
    ds = MultimodalPromptDataset(path, processor, n_small + 5, min_pixels=MIN_PIXELS, max_pixels=MIN_PIXELS)
    assert len(ds) == 2 and ds[1][MULTI_MODAL_INPUTS]["image_grid_thw"].tolist() == [[1, 4, 4]]


def test_missing_image_names_the_row(tmp_path, processor):
    (tmp_path / "ok.png").write_bytes(png((56, 56)))
    path = write_rows(tmp_path / "d.jsonl", [image_row(0, ["ok.png"]), image_row(1, ["gone.png"])])
    with pytest.raises(DataError, match=r"d.jsonl: row 1: image 0: image file not found: .*gone.png"):
        MultimodalPromptDataset(path, processor, 200)


def test_unreadable_image_names_the_row(tmp_path, processor):
    path = write_rows(
        tmp_path / "d.parquet",
        [image_row(0, [{"bytes": png((56, 56))}]), image_row(1, [{"bytes": b"not a png"}])],
    )
    with pytest.raises(DataError, match=r"d.parquet: row 1: image 0: cannot read image <9 bytes>"):
        MultimodalPromptDataset(path, processor, 200)


def test_images_are_decoded_lazily(tmp_path, processor):
    good = png((56, 56))
    (tmp_path / "a.png").write_bytes(good)
    path = write_rows(tmp_path / "d.jsonl", [image_row(0, ["a.png"])])
    ds = MultimodalPromptDataset(path, processor, 200, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    (tmp_path / "a.png").write_bytes(good[:60])  # the header survives, the pixels do not
    with pytest.raises(DataError, match=r"row 0: image 0: cannot (decode|read) image"):
        ds[0]
    (tmp_path / "a.png").write_bytes(good)
    assert torch.is_tensor(ds[0][MULTI_MODAL_INPUTS]["pixel_values"])


def test_data_layer_imports_no_model_code():
    import ast

    for name in ("images.py", "mm_dataset.py"):
        tree = ast.parse((Path(__file__).parents[2] / "posttrain" / "data" / name).read_text())
        imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        assert not [
            m
            for m in imported
            if m.split(".")[:2] != ["posttrain", "data"]
            and m.startswith("posttrain.")
            and m != "posttrain.errors"
        ]


def test_an_image_declaring_too_many_pixels_is_refused_before_decoding() -> None:
    """A small file can declare a huge canvas (a decompression bomb): refused from its header."""
    buf = io.BytesIO()
    Image.new("1", (8000, 7000)).save(buf, format="PNG")  # 56M pixels, a few KB of PNG
    assert len(buf.getvalue()) < 100_000
    with pytest.raises(
        DataError, match=r"row 3: image <\d+ bytes> is 8000x7000 pixels, more than the 50,000,000"
    ):
        open_image(ImageRef(data=buf.getvalue()), "row 3")


def test_transparent_pixels_are_white_as_the_image_processors_make_them():
    img = Image.new("RGBA", (20, 20), (0, 0, 0, 0))  # transparent, hiding black
    ImageDraw.Draw(img).rectangle((5, 5, 14, 14), fill=(255, 0, 0, 255))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    rgb = load_image(ImageRef(data=buf.getvalue()), None, None, "x")
    assert (
        rgb.mode == "RGB"
        and rgb.getpixel((0, 0)) == (255, 255, 255)
        and rgb.getpixel((10, 10)) == (255, 0, 0)
    )
    palette = img.convert("P")  # a palette image with a transparent index
    buf = io.BytesIO()
    palette.save(buf, format="PNG", transparency=palette.getpixel((0, 0)))
    assert load_image(ImageRef(data=buf.getvalue()), None, None, "x").getpixel((0, 0)) == (255, 255, 255)


def test_thin_images_keep_their_aspect_and_too_thin_ones_name_themselves():
    w, h = fit_pixels(3000, 15, 56 * 56, 112 * 112)  # the processor takes up to 200: truncation made it 226
    buf = io.BytesIO()
    Image.new("RGB", (300, 1), "red").save(buf, format="PNG")
    thin = buf.getvalue()
    assert max(w, h) / min(w, h) <= 200
    with pytest.raises(
        DataError, match=r"row 3: image 0: image .* is 300x1 pixels, an aspect ratio over the 200"
    ):
        load_image(ImageRef(data=thin), 56 * 56, 112 * 112, "row 3: image 0")
