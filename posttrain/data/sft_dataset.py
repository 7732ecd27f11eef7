"""Supervised fine-tuning data: chat-templated prompt + response + eos, with a loss mask on the response.

Reads the same verl-format files as `PromptDataset`; the response text is taken from a dotted path
into the row (`extra_info.answer` by default). Must not import engine, rollout, worker, Ray or model code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from posttrain.data import keys as K
from posttrain.data.batch import Batch
from posttrain.data.dataset import (
    ChatTokenizer,
    PathLike,
    as_paths,
    as_text,
    check_overlong_mode,
    get_field,
    iter_rows,
    parse_messages,
    position_ids_from_mask,
    render_prompt,
    report_filtered,
)
from posttrain.errors import DataError


class SFTDataset:
    """Tokens = prompt ids + ids of (response + eos); `loss_mask` is 1 on the response part.

    Rows longer than `max_length` tokens are filtered (count in `n_filtered`) or, with
    `overlong="error"`, rejected. The prompt and the response are tokenized separately so the mask
    boundary is exact whatever the tokenizer merges.
    """

    def __init__(
        self,
        files: PathLike | Sequence[PathLike],
        tokenizer: ChatTokenizer,
        max_length: int,
        response_key: str = "extra_info.answer",
        overlong: str = "filter",
    ) -> None:
        check_overlong_mode(overlong)
        eos = getattr(tokenizer, "eos_token", None)
        if not eos:
            raise DataError("SFTDataset: the tokenizer has no eos_token; responses must end with one")
        self.files = as_paths(files)
        self.max_length = max_length
        self.response_key = response_key
        self.n_filtered = 0
        self._items: list[tuple[np.ndarray, int]] = []  # (ids, number of prompt tokens)
        n_total = 0
        for path, i, row in iter_rows(self.files):
            n_total += 1
            where = f"{path}: row {i}"
            messages = parse_messages(row, where)
            response = as_text(get_field(row, response_key, where), response_key, where)
            _, prompt_ids = render_prompt(tokenizer, messages)
            response_ids = list(tokenizer.encode(response + eos, add_special_tokens=False))
            n = len(prompt_ids) + len(response_ids)
            if n > max_length:
                if overlong == "error":
                    raise DataError(f"{where}: prompt + response has {n} tokens, max_length is {max_length}")
                self.n_filtered += 1
                continue
            self._items.append((np.asarray(prompt_ids + response_ids, dtype=np.int64), len(prompt_ids)))
        report_filtered(self.files, self.n_filtered, n_total, f"max_length={max_length}")

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        """`input_ids` (list[int]), `loss_mask` (list[int], 1 on response + eos), `index`."""
        ids, n_prompt = self._items[i]
        loss_mask = [0] * n_prompt + [1] * (len(ids) - n_prompt)
        return {"input_ids": ids.tolist(), K.LOSS_MASK: loss_mask, "index": range(len(self._items))[i]}


def collate_sft(
    items: Sequence[dict[str, Any]], pad_token_id: int, uids: Sequence[str] | None = None
) -> Batch:
    """Right-pad to the longest row: tensors input_ids, attention_mask, position_ids, loss_mask (float);
    non-tensors index, and uid when `uids` is given (the dataloader passes them)."""
    if not items:
        raise DataError("collate_sft: no items")
    if uids is not None and len(uids) != len(items):
        raise DataError(f"collate_sft: {len(items)} items but {len(uids)} uids")
    width = max(len(it["input_ids"]) for it in items)
    input_ids = torch.full((len(items), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(items), width), dtype=torch.long)
    loss_mask = torch.zeros((len(items), width), dtype=torch.float32)
    for r, it in enumerate(items):
        n = len(it["input_ids"])
        input_ids[r, :n] = torch.as_tensor(it["input_ids"], dtype=torch.long)
        attention_mask[r, :n] = 1
        loss_mask[r, :n] = torch.as_tensor(it[K.LOSS_MASK], dtype=torch.float32)
    non_tensors: dict[str, list] = {K.INDEX: [it["index"] for it in items]}
    if uids is not None:
        non_tensors[K.UID] = list(uids)
    return Batch.from_dict(
        tensors={
            K.INPUT_IDS: input_ids,
            K.ATTENTION_MASK: attention_mask,
            K.POSITION_IDS: position_ids_from_mask(attention_mask),
            K.LOSS_MASK: loss_mask,
        },
        non_tensors=non_tensors,
    )
