"""Preference pairs in TRL's format, tokenized, and their collate into one Batch of interleaved rows.

A row: `prompt`, `chosen`, `rejected`, either all text (prompt text, then the completion and eos) or all
chat messages (the prompt rendered with the generation prompt, the completion as the assistant turn(s) after
it; posttrain/data/chat_masks.py). Optional `ref_chosen_logps` / `ref_rejected_logps` (TRL's column names):
the reference's summed completion log-probs, precomputed. The collated Batch holds pair i as rows 2i
(chosen) and 2i+1 (rejected), right-padded, with `loss_mask` 1 on completion tokens: the SFT layout, so
packing and micro-batching are the SFT trainer's. Must not import engine, rollout, worker, Ray or model code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from posttrain.data import keys as K
from posttrain.data.batch import Batch
from posttrain.data.chat_masks import completion_tokens, parse_conversation
from posttrain.data.dataset import (
    ChatTokenizer,
    PathLike,
    as_paths,
    check_overlong_mode,
    get_field,
    iter_rows,
    report_filtered,
)
from posttrain.data.sft_dataset import collate_sft
from posttrain.errors import DataError

PAIR_INDEX = "pair_index"  # (B,) long: the pair's position in its dataset (both rows of a pair)
PAIR_CHOSEN = "pair_chosen"  # (B,) long: 1 on a chosen row, 0 on a rejected row
REF_SEQ_LOG_PROB = "ref_seq_log_prob"  # (B,) float: the reference's summed log-prob of the row's completion
PAIR_MARGIN = "pair_margin"  # (B,) float: the pair's margin (both rows of a pair), when the data has one
REF_COLUMNS = ("ref_chosen_logps", "ref_rejected_logps")


class PreferenceDataset:
    """(chosen ids, rejected ids, prompt lengths, reference sums) per pair; pairs with a sequence longer than
    `max_length` are filtered (`n_filtered`) or, with `overlong="error"`, rejected. `with_reference`: read
    the precomputed reference columns (a row without them is an error naming it). `margin_column`: a column of
    per-pair margins, read when the data has it; every row has it or none does (an error names the first row
    that breaks the rule)."""

    def __init__(
        self,
        files: PathLike | Sequence[PathLike],
        tokenizer: ChatTokenizer,
        max_length: int,
        overlong: str = "filter",
        with_reference: bool = False,
        margin_column: str = "",
    ) -> None:
        check_overlong_mode(overlong)
        eos = getattr(tokenizer, "eos_token", None)
        if not eos:
            raise DataError("PreferenceDataset: the tokenizer has no eos_token; completions end with one")
        self.files = as_paths(files)
        self.with_reference = with_reference
        self.n_filtered = 0
        self.has_margin: bool | None = None  # decided by the first row (margin_column set)
        self.formats: set[str] = set()  # "text" and/or "chat": how the rows' pairs are written
        self._items: list[dict[str, Any]] = []
        n_total = 0
        for path, i, row in iter_rows(self.files):
            n_total += 1
            where = f"{path}: row {i}"
            item = _pair(tokenizer, row, eos, where)
            self.formats.add("text" if isinstance(row.get("prompt"), str) else "chat")
            if margin_column:
                self._read_margin(row, margin_column, item, where)
            longest = max(len(item["chosen"]), len(item["rejected"]))
            if longest > max_length:
                if overlong == "error":
                    raise DataError(
                        f"{where}: a completion has {longest} tokens with its prompt, max_length is {max_length}"
                    )
                self.n_filtered += 1
                continue
            if with_reference:
                for name in REF_COLUMNS:
                    value = get_field(row, name, where)
                    if (
                        not isinstance(value, int | float)
                        or isinstance(value, bool)
                        or not np.isfinite(value)
                    ):
                        raise DataError(f"{where}: field {name!r} must be a finite number, got {value!r}")
                    item[name] = float(value)
            self._items.append(item)
        report_filtered(self.files, self.n_filtered, n_total, f"max_length={max_length}")

    def _read_margin(self, row: dict, column: str, item: dict[str, Any], where: str) -> None:
        present = row.get(column) is not None
        if self.has_margin is None:
            self.has_margin = present
        elif present != self.has_margin:
            given = "has" if present else "has no"
            first = "have one" if self.has_margin else "have none"
            raise DataError(
                f"{where}: {given} {column!r} but the rows before it {first}: give every pair a margin or none"
            )
        if present:
            value = row[column]
            if not isinstance(value, int | float) or isinstance(value, bool) or not np.isfinite(value):
                raise DataError(f"{where}: field {column!r} must be a finite number, got {value!r}")
            item["margin"] = float(value)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        """`chosen`/`rejected` (token ids), `chosen_prompt`/`rejected_prompt` (prompt tokens in each), `index`,
        and the reference columns and `margin` when read."""
        return {**self._items[i], "index": range(len(self._items))[i]}


def _pair(tokenizer: ChatTokenizer, row: dict, eos: str, where: str) -> dict[str, Any]:
    values = {name: get_field(row, name, where) for name in ("prompt", "chosen", "rejected")}
    values = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in values.items()}
    if all(isinstance(v, str) for v in values.values()):
        prompt_ids = list(tokenizer.encode(values["prompt"], add_special_tokens=True))
        out: dict[str, Any] = {}
        for side in ("chosen", "rejected"):
            out[side] = prompt_ids + list(tokenizer.encode(values[side] + eos, add_special_tokens=False))
            out[f"{side}_prompt"] = len(prompt_ids)
        return out
    if all(isinstance(v, list) for v in values.values()):
        prompt = parse_conversation(values["prompt"], where, "prompt")
        tools = row.get("tools")
        tools = tools.tolist() if isinstance(tools, np.ndarray) else tools
        out = {}
        for side in ("chosen", "rejected"):
            completion = parse_conversation(values[side], where, side)
            out[side], out[f"{side}_prompt"] = completion_tokens(
                tokenizer, prompt, completion, where, tools or None
            )
        return out
    kinds = ", ".join(f"{k}: {type(v).__name__}" for k, v in values.items())
    raise DataError(
        f"{where}: prompt, chosen and rejected must all be text or all chat message lists ({kinds})"
    )


def collate_pairs(
    items: Sequence[dict[str, Any]], pad_token_id: int, uids: Sequence[str] | None = None
) -> Batch:
    """Rows 2i (chosen) and 2i+1 (rejected) of pair i: collate_sft's tensors (loss_mask on completions) +
    pair_index, pair_chosen, ref_seq_log_prob when the items carry the reference columns, pair_margin when they
    carry a margin."""
    if not items:
        raise DataError("collate_pairs: no items")
    rows = []
    for it in items:
        for side in ("chosen", "rejected"):
            ids, n_prompt = it[side], it[f"{side}_prompt"]
            rows.append(
                {
                    "input_ids": ids,
                    K.LOSS_MASK: [0] * n_prompt + [1] * (len(ids) - n_prompt),
                    "index": it["index"],
                }
            )
    batch = collate_sft(
        rows, pad_token_id, uids=[u for u in uids for _ in (0, 1)] if uids is not None else None
    )
    batch.set(PAIR_INDEX, torch.tensor([it["index"] for it in items for _ in (0, 1)], dtype=torch.long))
    batch.set(PAIR_CHOSEN, torch.tensor([1, 0] * len(items), dtype=torch.long))
    if all(REF_COLUMNS[0] in it for it in items):
        ref = [it[name] for it in items for name in REF_COLUMNS]
        batch.set(REF_SEQ_LOG_PROB, torch.tensor(ref, dtype=torch.float64))
    if all("margin" in it for it in items):
        margins = [it["margin"] for it in items for _ in (0, 1)]
        batch.set(PAIR_MARGIN, torch.tensor(margins, dtype=torch.float64))
    return batch
