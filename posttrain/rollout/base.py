"""The rollout interface every generation engine implements (built-in, HF, vLLM/SGLang adapters).

Log-prob convention: the returned log-prob of a sampled token is log softmax(logits / temperature) at that
token, over the whole vocabulary, i.e. before top-k/top-p/min-p truncation. That is what the training engine
recomputes, so the two can be compared exactly (and what PPO's ratio needs: the policy being trained is the
tempered softmax). With truncation the token was actually drawn from the renormalised truncated distribution,
whose log-prob is higher by -log(kept mass); we do not return that one. Greedy (temperature 0) reports
log softmax(logits).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from posttrain.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # drop tokens with probability < min_p * (top probability); 0 = off
    stop: tuple[str, ...] = ()  # stop strings; the text is cut before them
    stop_token_ids: tuple[int, ...] = ()  # besides the tokenizer's eos
    seed: int | None = None

    def validate(self) -> None:
        """Reject values no sampler can honour, naming the parameter."""
        if self.max_tokens <= 0:
            raise ConfigError(f"max_tokens must be > 0, got {self.max_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 <= self.min_p < 1:
            raise ConfigError(f"min_p must be in [0, 1), got {self.min_p}")


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: list[int]
    sampling: SamplingParams
    # a LoRA adapter registered on the engine (`NativeRolloutEngine.adapters`) to sample under; None = the
    # engine's own weights. Requests of different adapters share the engine's batches.
    adapter: str | None = None
    # a vision-language prompt's images: {"pixel_values": (patches, features), "image_grid_thw": (images, 3)}, the
    # Batch's `multi_modal_inputs` row; the prompt holds one image-pad token per merged patch. None: text only.
    images: dict[str, torch.Tensor] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class GenerationResult:
    """A response. With a stop string, `text` ends before it and `token_ids` end with the token that
    completed it; `stop_reason` is "stop" (eos, stop token or stop string), "length" or "error"."""

    token_ids: list[int]
    log_probs: list[float]
    text: str
    stop_reason: str
    error: str | None = None  # why the request was rejected (then nothing was generated)
    # routing replay (an engine built with record_routing): the top-k experts of every token the model ran, the
    # prompt's then each fed-back sampled token's (prompt + len(token_ids) - 1 positions), (positions, layers, k)
    routed_experts: torch.Tensor | None = field(default=None, compare=False)


class AdapterRouter(Protocol):
    """LoRA adapters by name over an engine's model that several can share a pass token by token (the
    training engine's `MultiLora` is one; a worker composes the two, this layer knows only the interface)."""

    adapters: dict[str, Any]

    def routed(self, names: list[str]) -> AbstractContextManager[None]:
        """Passes inside run adapter `names[k]` on the positions routed to k."""
        ...

    def set_routes(self, slots: torch.Tensor, head_slots: torch.Tensor | None = None) -> None:
        """The adapter index (-1: none) of every position of the next pass, and of the LM head's positions."""
        ...


class RolloutEngine(Protocol):
    """Generation behind one interface; a worker composes it with a training engine."""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[GenerationResult]:
        """Generate one response per prompt (token ids, already chat-templated)."""
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy new weights in, tensor by tensor; returns how many tensors were loaded."""
        ...

    def sleep(self) -> None:
        """Free generation memory (KV cache) while the trainer runs."""
        ...

    def wake(self) -> None:
        """Restore what `sleep` freed."""
        ...


def results_or_raise(results: list[GenerationResult]) -> list[GenerationResult]:
    """`results` of a `generate` call, or the first invalid request's error, naming it: a ConfigError for a
    setting out of range (its message says what it "must be"), else a ValueError."""
    for i, result in enumerate(results):
        if result.error is not None:
            raise (ConfigError if "must be" in result.error else ValueError)(f"request {i}: {result.error}")
    return results


def eos_token_ids(generation_eos: int | Sequence[int] | None, tokenizer_eos: int | None) -> list[int]:
    """The tokens that end a response: the model's generation_config eos (one id or several) and the
    tokenizer's eos, together (a chat model's config may name <|endoftext|> and its tokenizer <|im_end|>)."""
    ids: set[int] = set()
    for source in (generation_eos, tokenizer_eos):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(i) for i in source)
    return sorted(ids)


def context_error(prompt_tokens: int, max_tokens: int, max_context: int) -> str:
    """The error of a request longer than the model's context (`max_position_embeddings` of its config)."""
    return (
        f"prompt of {prompt_tokens} tokens + max_tokens {max_tokens} = {prompt_tokens + max_tokens} exceeds the "
        f"model context of {max_context} positions (max_position_embeddings in the model's config.json): "
        "shorten the prompt, lower max_tokens, or use a model with a longer context (make-model --preset "
        "tiny-32k / small-32k)"
    )


def text_before_stop(text: str, stops: Sequence[str]) -> str | None:
    """`text` cut before the earliest of the stop strings in it, or None when none occurs."""
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    return text[:cut] if cut >= 0 else None


def stopped_text(tokenizer: Any, tokens: list[int], stops: Sequence[str]) -> str:
    """A response's text when a stop string ended it: special tokens skipped (as every other result text,
    and vLLM's output text), cut before the earliest stop string; a stop string that is a special token's
    text (say `<|im_end|>`, matched in the text with special tokens) is skipped with it."""
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    cut = text_before_stop(text, stops)
    return text if cut is None else cut


def stop_string_prefix(decode: Callable[[list[int]], str], tokens: list[int], stops: Sequence[str]) -> int:
    """How many of `tokens` a response keeps under stop strings: the shortest prefix whose text holds one of
    `stops` (the token that completed it is the last kept, as the native engine stops there), or all of
    them when none occurs. A decoded prefix only grows as tokens are added, so the shortest is found by
    bisection: O(log n) decodes for an engine that generated the whole response before looking."""
    if text_before_stop(decode(tokens), stops) is None:
        return len(tokens)
    low, high = 1, len(tokens)  # the answer is in [low, high]
    while low < high:
        mid = (low + high) // 2
        if text_before_stop(decode(tokens[:mid]), stops) is None:
            low = mid + 1
        else:
            high = mid
    return low
