"""Observations of a chat, as tokens that extend exactly what the model sampled.

The model samples an assistant turn up to and including its end-of-turn token (`<|im_end|>`). Whatever
the chat template puts after that token (Qwen's newline, the next turn's header, the tool responses, the
next assistant header) is the observation: it is rendered by the template and only that suffix is
tokenised, so the sampled tokens are never re-tokenised from text. Re-rendering the whole conversation
instead is how verl lost the newline after `<|im_end|>` and dropped tool calls: the text of a sampled
turn does not always tokenise back to the tokens sampled.
"""

from __future__ import annotations

from typing import Any

from posttrain.data.chat_masks import end_of_turn_token
from posttrain.errors import PosttrainError

Message = dict[str, Any]


class ChatRenderer:
    """Renders a conversation's first observation and the observation after each assistant turn."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None = None) -> None:
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.end_of_turn: str = end_of_turn_token(tokenizer)  # Gemma's <end_of_turn>, not its <eos>
        self.end_of_turn_id: int = tokenizer.convert_tokens_to_ids(self.end_of_turn)

    def render(self, messages: list[Message], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools, add_generation_prompt=generation_prompt, tokenize=False
        )

    def image_token_id(self, image_token: str = "<|image_pad|>") -> int:
        """The id of the token a vision-language template renders for an image part."""
        token = self.tokenizer.convert_tokens_to_ids(image_token)
        if token is None or token == self.tokenizer.unk_token_id:
            raise PosttrainError(
                f"the tokenizer has no image token {image_token!r}: not a vision-language model"
            )
        return int(token)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def initial(self, messages: list[Message]) -> list[int]:
        """The first observation: the conversation so far and the assistant's header."""
        return self.encode(self.render(messages, generation_prompt=True))

    def after_assistant(self, history: list[Message], new: list[Message]) -> list[int]:
        """The tokens that follow the end-of-turn token of `history`'s last (assistant) message when `new`
        messages (tool responses, a user turn) come next, up to the next assistant header."""
        return self.encode(self.suffix_text(history, new))

    def suffix_text(self, history: list[Message], new: list[Message]) -> str:
        """The text of `after_assistant` (an image part of `new` renders as the template's image token: see
        observations.chat_model_input)."""
        if not history or history[-1].get("role") != "assistant":
            raise PosttrainError("after_assistant: the history must end with the assistant's turn")
        before = self.render(history, generation_prompt=False)
        cut = before.rfind(self.end_of_turn)
        if cut < 0:
            raise PosttrainError(
                f"the chat template does not end an assistant turn with {self.end_of_turn!r} (the tokenizer's "
                "eos token): cannot tell where the sampled tokens end"
            )
        cut += len(self.end_of_turn)
        after = self.render(history + new, generation_prompt=True)
        if not after.startswith(before[:cut]):
            raise PosttrainError(
                "the chat template renders the earlier turns differently once more messages follow; the "
                "observation cannot extend the sampled tokens (a template that rewrites history, e.g. one "
                "that drops earlier reasoning, needs an environment that starts a new sequence)"
            )
        return after[cut:]
