"""Supervised fine-tuning on images: verl's multimodal prompt rows (an `images` column, `<image>` placeholders in
the prompt) with the response taken from a dotted path into the row, as `SFTDataset`'s prompt rows.

Rows are tokenized when the dataset is built (each image's tokens, one per merged patch, counted from the image
header and the pixel bounds); images are decoded in `__getitem__`. Image tokens never carry loss: the loss is on
the response and eos, or with `train_on=everything` on every text token. Each item carries
`multi_modal_inputs` (pixel_values, image_grid_thw), which `collate_multimodal_sft` keeps as a per-row column of
the Batch so that micro-batching never separates an image from its tokens.
Must not import engine, rollout, worker, Ray or model code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from posttrain.data import keys as K
from posttrain.data.batch import Batch
from posttrain.data.chat_masks import check_train_on
from posttrain.data.dataset import (
    PathLike,
    as_paths,
    as_text,
    check_overlong_mode,
    get_field,
    iter_rows,
    parse_messages,
    report_filtered,
)
from posttrain.data.images import image_size, load_image, parse_image_refs, split_image_placeholders
from posttrain.data.mm_dataset import (
    DEFAULT_MAX_PIXELS,
    DEFAULT_MIN_PIXELS,
    MULTI_MODAL_INPUTS,
    VisionProcessor,
    image_token_count,
    multi_modal_inputs,
    render_multimodal_prompt,
)
from posttrain.data.sft_dataset import collate_sft
from posttrain.errors import DataError

PROMPT_TRAIN_ON = ("last_assistant", "all_assistant", "everything")


class MultimodalSFTDataset:
    """verl multimodal prompt rows as (token ids, loss mask) + images, decoded lazily; see the module docstring.

    Rows longer than `max_length` tokens (image tokens included) are filtered (`n_filtered`) or, with
    `overlong="error"`, rejected. A bad row (missing field, placeholder/image count mismatch, missing or
    unreadable image) is a DataError naming its file and index.
    """

    def __init__(
        self,
        files: PathLike | Sequence[PathLike],
        processor: VisionProcessor,
        max_length: int,
        response_key: str = "extra_info.answer",
        overlong: str = "filter",
        train_on: str = "all_assistant",
        image_key: str = "images",
        min_pixels: int = DEFAULT_MIN_PIXELS,
        max_pixels: int = DEFAULT_MAX_PIXELS,
    ) -> None:
        check_overlong_mode(overlong)
        check_train_on(train_on)
        if train_on not in PROMPT_TRAIN_ON:
            raise DataError(
                f"train_on={train_on} needs 'messages' rows; multimodal prompt rows train on their response "
                "(last_assistant, all_assistant) or on every text token (everything)"
            )
        tokenizer = processor.tokenizer
        eos = getattr(tokenizer, "eos_token", None)
        if not eos:
            raise DataError(
                "MultimodalSFTDataset: the tokenizer has no eos_token; responses must end with one"
            )
        image_token_id = tokenizer.convert_tokens_to_ids(processor.image_token)
        self.processor = processor
        self.files = as_paths(files)
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.n_filtered = 0
        self._items: list[dict[str, Any]] = []
        n_total = 0
        for path, i, row in iter_rows(self.files):
            n_total += 1
            where = f"{path}: row {i}"
            if "prompt" not in row:
                raise DataError(
                    f"{where}: a multimodal SFT row needs 'prompt' (+ {response_key!r}) and images"
                )
            refs = parse_image_refs(row, image_key, path.parent, where)
            messages = split_image_placeholders(parse_messages(row, where), len(refs), where)
            counts = [
                image_token_count(processor, *image_size(ref, min_pixels, max_pixels, f"{where}: image {j}"))
                for j, ref in enumerate(refs)
            ]
            _, prompt_ids = render_multimodal_prompt(processor, messages, counts, where)
            response = as_text(get_field(row, response_key, where), response_key, where)
            response_ids = list(tokenizer.encode(response + eos, add_special_tokens=False))
            if image_token_id in response_ids:  # the model would look for an image there that is not given
                raise DataError(
                    f"{where}: field {response_key!r} holds the image token {processor.image_token!r} as text; "
                    "a response cannot hold an image"
                )
            ids = prompt_ids + response_ids
            if train_on == "everything":
                prompt_mask = [int(t != image_token_id) for t in prompt_ids]
            else:
                prompt_mask = [0] * len(prompt_ids)
            if len(ids) > max_length:
                if overlong == "error":
                    raise DataError(
                        f"{where}: prompt + response has {len(ids)} tokens ({sum(counts)} of them for "
                        f"{len(refs)} images), max_length is {max_length}"
                    )
                self.n_filtered += 1
                continue
            self._items.append(
                {
                    "ids": np.asarray(ids, dtype=np.int64),
                    "mask": np.asarray(prompt_mask + [1] * len(response_ids), dtype=np.int8),
                    "refs": refs,
                    "counts": counts,
                    "where": where,
                }
            )
        report_filtered(self.files, self.n_filtered, n_total, f"max_length={max_length}")

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        """`input_ids`, `loss_mask` (lists of int), `index`, and `multi_modal_inputs` ({} without images)."""
        item = self._items[i]
        images = [
            load_image(ref, self.min_pixels, self.max_pixels, f"{item['where']}: image {j}")
            for j, ref in enumerate(item["refs"])
        ]
        return {
            "input_ids": item["ids"].tolist(),
            K.LOSS_MASK: item["mask"].tolist(),
            "index": range(len(self._items))[i],
            MULTI_MODAL_INPUTS: multi_modal_inputs(self.processor, images, item["counts"], item["where"]),
        }


def collate_multimodal_sft(
    items: Sequence[dict[str, Any]], pad_token_id: int, uids: Sequence[str] | None = None
) -> Batch:
    """`collate_sft` plus the non-tensor column `multi_modal_inputs` (one dict per row)."""
    batch = collate_sft(items, pad_token_id, uids)
    batch.set(MULTI_MODAL_INPUTS, [it.get(MULTI_MODAL_INPUTS) or {} for it in items])
    return batch
