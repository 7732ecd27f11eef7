"""Conversations as token ids with a loss mask that follows the rendered chat template exactly.

`train_on` picks the tokens that carry loss:

* `last_assistant`: the content and end-of-turn token(s) of the last assistant message;
* `all_assistant`: the same for every assistant message;
* `all_messages`: the content and end-of-turn of every message, whatever its role (role headers excluded);
* `everything`: every token of the rendering (headers, separators, a template's default system prompt).

Where a turn ends. An assistant turn's loss covers what the model must generate: its content and the
template's end-of-turn token (Qwen's `<|im_end|>`, Llama-3's `<|eot_id|>`), which is what stops generation.
What the template writes after it, up to the next turn, is not generated: trailing tokens of the turn that
decode to whitespace only (the newline of Qwen's `<|im_end|>\\n`) carry no loss, nor does the next role header.
This is TRL's choice (its `{% generation %}` blocks for Qwen end after `<|im_end|>`, before the newline) and
tinker-cookbook's (its renderers put the newline in the next observation).

How the mask is found. When the template marks assistant turns with `{% generation %}` ... `{% endgeneration
%}`, the assistant modes take the tokenizer's own assistant mask (`return_assistant_tokens_mask=True`), so the
template author decides where a turn ends. Otherwise the conversation is rendered turn by turn: the rendering
of each prefix of the messages (with the generation prompt, for where an assistant turn's content starts) must
be a token prefix of the whole conversation's rendering, else a DataError says the template cannot be split
there (templates that rewrite earlier turns, e.g. Qwen3 dropping past reasoning, or merge consecutive tool
messages into one turn, need `{% generation %}` markers for the assistant modes). A role header of a message
other than the assistant is found as the common prefix of its rendering and of the same message with empty
content. Must not import engine, rollout, worker, Ray or model code.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from posttrain.errors import DataError

TRAIN_ON = ("last_assistant", "all_assistant", "all_messages", "everything")
ROLES = ("system", "user", "assistant", "tool")
# message keys passed to the template besides role and content (tool calls and their answers)
EXTRA_KEYS = ("tool_calls", "name", "tool_call_id", "reasoning_content")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def check_train_on(train_on: str) -> None:
    if train_on not in TRAIN_ON:
        raise DataError(f"train_on={train_on!r} is not one of {list(TRAIN_ON)}")


def parse_conversation(value: Any, where: str, field_name: str = "messages") -> list[dict[str, Any]]:
    """A non-empty list of messages with a known role and string content (an assistant message with
    `tool_calls` may have none); any other problem is a DataError naming the message and the reason."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: field {field_name!r} must be a non-empty list of chat messages")
    messages = []
    for j, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise DataError(f"{where}: {field_name}[{j}] must be a dict, got {type(msg).__name__}")
        role = msg.get("role")
        if role not in ROLES:
            raise DataError(
                f"{where}: {field_name}[{j}] has unknown role {role!r}; valid: {', '.join(ROLES)}"
            )
        content = msg.get("content")
        if content is None and role == "assistant" and msg.get("tool_calls"):
            content = ""
        if not isinstance(content, str):
            raise DataError(f"{where}: {field_name}[{j}] ({role}) needs a string 'content'")
        out = {"role": role, "content": content}
        out.update({k: _plain(msg[k]) for k in EXTRA_KEYS if msg.get(k) is not None})
        messages.append(out)
    return messages


def _plain(value: Any) -> Any:
    """Parquet gives numpy arrays for lists; templates want lists."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def has_generation_markers(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and bool(_GENERATION.search(template))


def conversation_tokens(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    train_on: str,
    where: str,
    tools: list[dict] | None = None,
) -> tuple[list[int], list[int]]:
    """(token ids of the rendered conversation, 0/1 loss mask of the same length) under `train_on`."""
    check_train_on(train_on)
    if train_on in ("last_assistant", "all_assistant"):
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: train_on={train_on} but the conversation has no assistant message")
        if has_generation_markers(tokenizer):
            return _generation_mask(tokenizer, messages, train_on, where, tools)
    renderer = _Renderer(tokenizer, messages, where, tools)
    ids = renderer.full_ids
    if train_on == "everything":
        return ids, [1] * len(ids)
    mask = [0] * len(ids)
    assistants = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
    chosen = {
        "last_assistant": assistants[-1:],
        "all_assistant": assistants,
        "all_messages": range(len(messages)),
    }[train_on]
    for k in chosen:
        start, end = renderer.content_span(k)
        mask[start:end] = [1] * (end - start)
    return ids, mask


class _Renderer:
    """Prefix renderings of one conversation, each checked to be a token prefix of the whole."""

    def __init__(self, tokenizer: Any, messages: list[dict[str, Any]], where: str, tools: list[dict] | None):
        self.tokenizer, self.messages, self.where, self.tools = tokenizer, messages, where, tools
        self.full_text = self._render(messages, False)
        self.full_ids = self._encode(self.full_text)

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        kwargs = {"tools": self.tools} if self.tools else {}
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=generation_prompt, tokenize=False, **kwargs
            )
        except Exception as e:  # jinja raises its own exception types from templates
            raise DataError(f"{self.where}: the chat template failed on this conversation: {e}") from e
        return str(text)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _prefix_len(self, text: str, what: str) -> int:
        """Tokens of `text`, which must render the start of the conversation token for token."""
        ids = self._encode(text)
        if not self.full_text.startswith(text) or self.full_ids[: len(ids)] != ids:
            raise DataError(
                f"{self.where}: the chat template's rendering of {what} is not a token prefix of the whole "
                "conversation's rendering, so the loss mask cannot be split there; use a template that marks "
                "assistant turns with {% generation %} (assistant modes) or train_on=everything"
            )
        return len(ids)

    def _end(self, k: int) -> int:
        """Where message k's turn ends: after its end-of-turn token, before trailing whitespace tokens."""
        end = self._prefix_len(self._render(self.messages[: k + 1], False), f"messages[:{k + 1}]")
        while end > 0 and not self.tokenizer.decode([self.full_ids[end - 1]]).strip():
            end -= 1
        return end

    def content_span(self, k: int) -> tuple[int, int]:
        """[start, end) of message k's content and end-of-turn tokens (its role header excluded)."""
        message = self.messages[k]
        if message["role"] == "assistant":
            start = self._prefix_len(
                self._render(self.messages[:k], True), f"messages[:{k}] + generation prompt"
            )
        else:
            with_content = self._render(self.messages[: k + 1], False)
            empty = self._render([*self.messages[:k], {**message, "content": ""}], False)
            n = 0
            while n < min(len(with_content), len(empty)) and with_content[n] == empty[n]:
                n += 1
            start = self._prefix_len(with_content[:n], f"messages[{k}]'s role header")
        return start, max(start, self._end(k))


def _generation_mask(
    tokenizer: Any, messages: list[dict[str, Any]], train_on: str, where: str, tools: list[dict] | None
) -> tuple[list[int], list[int]]:
    """The tokenizer's assistant mask (its template's `{% generation %}` blocks); `last_assistant` keeps the
    last contiguous block only."""
    kwargs = {"tools": tools} if tools else {}
    try:
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **kwargs
        )
    except Exception as e:  # jinja raises its own exception types from templates
        raise DataError(f"{where}: the chat template failed on this conversation: {e}") from e
    ids, mask = list(out["input_ids"]), [int(m) for m in out["assistant_masks"]]
    if not any(mask):
        raise DataError(
            f"{where}: the template's {{% generation %}} blocks mark no token of this conversation"
        )
    if train_on == "last_assistant":
        end = len(mask) - mask[::-1].index(1)
        start = end
        while start > 0 and mask[start - 1]:
            start -= 1
        mask = [0] * start + [1] * (end - start) + [0] * (len(mask) - end)
    return ids, mask


END_MARKER = "\u2063posttrain-end-of-turn\u2063"  # a text no template alters, to find what follows it


def model_stop_ids(tokenizer: Any) -> set[int]:
    """The ids generation stops at: the tokenizer's eos and its model directory's generation_config.json eos
    list (the rollout engines' rule, rollout.base.eos_token_ids)."""
    ids = {int(tokenizer.eos_token_id)} if getattr(tokenizer, "eos_token_id", None) is not None else set()
    path = Path(str(getattr(tokenizer, "name_or_path", "") or "")) / "generation_config.json"
    if path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
        ids |= {int(i) for i in (eos if isinstance(eos, list) else [eos]) if i is not None}
    return ids


def end_of_turn_token(tokenizer: Any, stops_only: bool = False) -> str:
    """The token that ends an assistant turn in the model's chat template: the first special token the template
    renders after an assistant message (Qwen's <|im_end|>, Llama 3's <|eot_id|>, Gemma's <end_of_turn>, where
    the tokenizer's eos is <eos>); the tokenizer's eos when the template has none or cannot render a turn.
    `stops_only`: that token only if generation stops at it (`model_stop_ids`), else the eos: a base model's
    template (Qwen2.5 base: <|im_end|>, its eos <|endoftext|>) would teach SFT an end the rollout runs past."""
    eos = str(getattr(tokenizer, "eos_token", "") or "")
    found = _template_end_of_turn(tokenizer, eos)
    if (
        stops_only
        and found != eos
        and tokenizer.convert_tokens_to_ids(found) not in model_stop_ids(tokenizer)
    ):
        return eos
    return found


def _template_end_of_turn(tokenizer: Any, eos: str) -> str:
    messages = [{"role": "user", "content": "ping"}, {"role": "assistant", "content": END_MARKER}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # noqa: BLE001 - no template, or one that renders no such turn: the eos it is
        return eos
    if not isinstance(text, str) or END_MARKER not in text:
        return eos
    special = set(getattr(tokenizer, "all_special_tokens", None) or [])
    special |= {str(t) for t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values()}
    suffix_ids = tokenizer.encode(text.split(END_MARKER, 1)[1], add_special_tokens=False)
    for token in tokenizer.convert_ids_to_tokens(suffix_ids):
        if token in special:
            return str(token)
    return eos


def text_tokens(tokenizer: Any, text: str, eos: str) -> list[int]:
    """Plain text for continued pre-training: the tokenizer's own special tokens (a BOS where it has one),
    the text, then eos (added unless the text already ends with it)."""
    if not text.endswith(eos):
        text = text + eos
    return list(tokenizer.encode(text, add_special_tokens=True))


def completion_tokens(
    tokenizer: Any,
    prompt: list[dict[str, Any]],
    completion: list[dict[str, Any]],
    where: str,
    tools: list[dict] | None = None,
) -> tuple[list[int], int]:
    """(ids of prompt + completion rendered together, number of prompt tokens): the completion starts after
    the prompt's generation prompt and ends after its last end-of-turn token (trailing whitespace cut), as
    an assistant turn's loss span does in `conversation_tokens`."""
    renderer = _Renderer(tokenizer, [*prompt, *completion], where, tools)
    start = renderer._prefix_len(renderer._render(prompt, True), "the prompt + generation prompt")
    end = max(start, renderer._end(len(prompt) + len(completion) - 1))
    return renderer.full_ids[:end], start
