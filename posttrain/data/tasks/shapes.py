"""The built-in visual task: small images of coloured squares drawn with Pillow, and a question about them.

`count`: "How many squares are in the image?" (1..max_squares, answer an integer); `color`: one square,
"What color is the square?" (answer a colour name). Rows are verl's multimodal format: the prompt holds an
`<image>` placeholder and `images` the PNG bytes as `{"bytes", "path"}` (Hugging Face datasets' struct), so
the parquet files are self-contained. Images are 56x56 by default: 4 image tokens for the tiny-vl preset.

Squares sit on a grid of `square_side`-pixel cells, 28 by default: one cell per image token of a Qwen2-VL
model with 14-pixel patches merged 2x2, so each image token shows one cell, empty or filled with one colour.
Measured (a plain Hugging Face loop, tiny-vl, batch 32, lr 1e-3): with 28-pixel cells the model reads the
colour in ~30 steps and counts 1-6 squares on 84x84 images to ~90% in ~100 steps; with 11-pixel squares
that straddle the tokens it learned only the answers' prior in 300 steps (its image features then carry a
quarter of the colour signal, diluted further over the prompt), which is why the cells follow the tokens.
This module must not import engine, rollout, worker, Ray or model code.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from posttrain.data.images import IMAGE_PLACEHOLDER
from posttrain.data.tasks.arithmetic import write_splits
from posttrain.errors import DataError

DATA_SOURCE = "shapes"
KINDS = ("count", "color")
COLORS = {"red": (220, 30, 30), "green": (30, 170, 30), "blue": (30, 60, 220), "yellow": (230, 200, 20)}
QUESTIONS = {"count": "How many squares are in the image?", "color": "What color is the square?"}


def draw_squares(
    rng: np.random.Generator, n: int, colors: Sequence[str], size: int = 56, side: int = 28
) -> Image.Image:
    """`n` non-overlapping squares of the given colours on white, at random cells of a grid of `side`-pixel
    cells (each square fills its cell but a 1-pixel margin)."""
    if side < 4 or side > size:
        raise DataError(f"shapes: square_side={side} must be between 4 and the image size {size}")
    cells = size // side
    if n > cells * cells:
        raise DataError(f"shapes: {n} squares do not fit a {size}px image with {side}px squares")
    img = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(img)
    for k, cell in enumerate(rng.choice(cells * cells, size=n, replace=False)):
        x, y = int(cell % cells) * side, int(cell // cells) * side
        draw.rectangle((x + 1, y + 1, x + side - 2, y + side - 2), fill=COLORS[colors[k % len(colors)]])
    return img


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def make_problem(
    rng: np.random.Generator, kind: str, max_squares: int = 4, size: int = 56, side: int = 28
) -> tuple[Image.Image, str, str]:
    """(image, question, answer) of one problem of `kind`."""
    names = list(COLORS)
    if kind == "count":
        n = int(rng.integers(1, max_squares + 1))
        img = draw_squares(rng, n, [names[int(rng.integers(len(names)))]], size, side)
        return img, QUESTIONS[kind], str(n)
    if kind == "color":
        color = names[int(rng.integers(len(names)))]
        return draw_squares(rng, 1, [color], size, side), QUESTIONS[kind], color
    raise DataError(f"shapes: unknown kind {kind!r}; valid kinds: {', '.join(KINDS)}")


def prompt_text(question: str) -> str:
    return f"{IMAGE_PLACEHOLDER}{question} Answer with one word or number."


def write_shapes_dataset(
    out_dir: str | Path,
    n_train: int = 2000,
    n_test: int = 256,
    kind: str = "count",
    max_squares: int = 4,
    size: int = 56,
    seed: int = 0,
    square_side: int = 28,
) -> dict[str, Path]:
    """Write `train.parquet` and `test.parquet` (images drawn from one seeded stream) to `out_dir`."""
    if kind not in KINDS:
        raise DataError(f"shapes: unknown kind {kind!r}; valid kinds: {', '.join(KINDS)}")
    rng = np.random.default_rng(seed)
    problems = [make_problem(rng, kind, max_squares, size, square_side) for _ in range(n_train + n_test)]

    def row(problem: tuple[Image.Image, str, str], split: str, index: int) -> dict:
        img, question, answer = problem
        return {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": prompt_text(question)}],
            "images": [{"bytes": png_bytes(img), "path": None}],
            "ability": "vision",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": index, "kind": kind, "answer": answer},
        }

    return write_splits(out_dir, problems, n_train, row)


def corpus(n: int, seed: int = 0) -> list[str]:
    """Prompt + answer texts (image placeholders left out) for training a tokenizer."""
    rng = np.random.default_rng(seed)
    texts = []
    for _ in range(n):
        kind = KINDS[int(rng.integers(len(KINDS)))]
        _, question, answer = make_problem(rng, kind, max_squares=4)
        texts.append(f"{question} Answer with one word or number. {answer}")
    return texts
