"""Supervised fine-tuning data: token ids with a loss mask, from three kinds of rows.

* `messages` (a chat: system/user/assistant/tool, multi-turn): rendered with the tokenizer's chat template;
  `train_on` picks the tokens with loss (posttrain/data/chat_masks.py: the mask follows the template);
* `text` (continued pre-training): the text and eos, every token with loss;
* otherwise verl's prompt rows: the chat-templated `prompt`, then the response taken from a dotted path
  into the row (`extra_info.answer` by default) and eos; loss on the response and eos (`train_on`
  `last_assistant`/`all_assistant`), or on every token (`everything`).

Must not import engine, rollout, worker, Ray or model code.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from posttrain.data import keys as K
from posttrain.data.batch import Batch
from posttrain.data.chat_masks import (
    check_train_on,
    conversation_tokens,
    end_of_turn_token,
    parse_conversation,
    text_tokens,
)
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
    """Rows as (token ids, loss mask); see the module docstring for the row kinds and `train_on`.

    Rows longer than `max_length` tokens are filtered (count in `n_filtered`) or, with
    `overlong="error"`, rejected. A prompt row's prompt and response are tokenized separately so the mask
    boundary is exact whatever the tokenizer merges. A bad row is a DataError naming its file and index.
    """

    def __init__(
        self,
        files: PathLike | Sequence[PathLike],
        tokenizer: ChatTokenizer,
        max_length: int,
        response_key: str = "extra_info.answer",
        overlong: str = "filter",
        train_on: str = "all_assistant",
    ) -> None:
        check_overlong_mode(overlong)
        check_train_on(train_on)
        eos = getattr(tokenizer, "eos_token", None)
        if not eos:
            raise DataError("SFTDataset: the tokenizer has no eos_token; responses must end with one")
        # a prompt row's response ends as the template ends an assistant turn (Gemma: <end_of_turn>, not <eos>)
        # when generation stops there, else with eos (as verl's SFT)
        self.end_of_turn = end_of_turn_token(tokenizer, stops_only=True)
        self.files = as_paths(files)
        self.max_length = max_length
        self.response_key = response_key
        self.train_on = train_on
        self.n_filtered = 0
        self._items: list[tuple[np.ndarray, np.ndarray]] = []  # (ids, loss mask)
        n_total = 0
        for path, i, row in iter_rows(self.files):
            n_total += 1
            where = f"{path}: row {i}"
            ids, mask = self._tokens(tokenizer, row, eos, where)
            if not any(mask):
                raise DataError(f"{where}: no token carries loss under train_on={train_on}")
            if len(ids) > max_length:
                if overlong == "error":
                    kind = (
                        "conversation"
                        if "messages" in row
                        else "text"
                        if "text" in row
                        else "prompt + response"
                    )
                    raise DataError(f"{where}: {kind} has {len(ids)} tokens, max_length is {max_length}")
                self.n_filtered += 1
                continue
            self._items.append((np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.int8)))
        report_filtered(self.files, self.n_filtered, n_total, f"max_length={max_length}")

    def _tokens(
        self, tokenizer: ChatTokenizer, row: dict, eos: str, where: str
    ) -> tuple[list[int], list[int]]:
        if row.get("messages") is not None:
            messages = parse_conversation(row["messages"], where)
            tools = row.get("tools")
            tools = tools.tolist() if isinstance(tools, np.ndarray) else tools
            if isinstance(tools, str):  # parquet keeps JSON schemas whole as a JSON string
                try:
                    tools = json.loads(tools)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{where}: field 'tools' is not valid JSON: {exc}") from None
            if tools is not None and not (
                isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
            ):
                raise DataError(f"{where}: field 'tools' must be a list of tool schemas (objects)")
            return conversation_tokens(tokenizer, messages, self.train_on, where, tools=tools or None)
        if row.get("text") is not None:
            ids = text_tokens(tokenizer, as_text(row["text"], "text", where), eos)
            return ids, [1] * len(ids)
        if "prompt" not in row:
            raise DataError(f"{where}: a row needs 'messages', 'text' or 'prompt' (+ {self.response_key!r})")
        if self.train_on == "all_messages":
            raise DataError(
                f"{where}: train_on=all_messages needs 'messages' rows; a prompt row trains on its response "
                "(last_assistant, all_assistant) or on every token (everything)"
            )
        messages = parse_messages(row, where)
        response = as_text(get_field(row, self.response_key, where), self.response_key, where)
        _, prompt_ids = render_prompt(tokenizer, messages, where)
        response_ids = list(tokenizer.encode(response + self.end_of_turn, add_special_tokens=False))
        first = 1 if self.train_on == "everything" else 0
        return prompt_ids + response_ids, [first] * len(prompt_ids) + [1] * len(response_ids)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        """`input_ids` (list[int]), `loss_mask` (list[int], 1 on tokens with loss), `index`."""
        ids, mask = self._items[i]
        return {"input_ids": ids.tolist(), K.LOSS_MASK: mask.tolist(), "index": range(len(self._items))[i]}


def collate_sft(
    items: Sequence[dict[str, Any]], pad_token_id: int, uids: Sequence[str] | None = None
) -> Batch:
    """Right-pad to the longest row: tensors input_ids, attention_mask, position_ids, loss_mask (float, 0 on
    each row's first token); non-tensors index, and uid when `uids` is given (the dataloader passes them)."""
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
    # a row's first token has nothing before it to predict it (its log-prob is 0 by the engine's convention):
    # it never counts as a trained token, as in TRL's shifted labels; else a text row, or any row trained on
    # everything, adds a zero-loss token to the count that scales the gradient and val/nll
    loss_mask[:, 0] = 0
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
