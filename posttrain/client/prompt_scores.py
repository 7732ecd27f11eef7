"""tinker's prompt-side `sample` options, checked and turned into `SampleResponse` fields.

- `include_prompt_logprobs` (`SampleResponse.prompt_logprobs`): log p of every prompt token (None at 0);
- `topk_prompt_logprobs=k` (`topk_prompt_logprobs`): the k likeliest tokens and log-probs at every position;
- `prompt_logprobs_last_n=n`: both of the above for the last n positions only (earlier entries None); it
  needs one of them, and 1 <= n <= len(prompt) - 1, as tinker checks;
- `target_prompt_logprobs` (int64 `[len(prompt) - 1, K]`, dense or sparse CSR, -1 or unlisted: nothing):
  the log-probs of those ids, row i at position i + 1, in the same shape and layout, 0.0 where nothing was
  asked;
- `prompt_alt_tokens_k=k` (`prompt_alt_tokens`): k draws at every position after the first, at the
  request's temperature (workers/prompt_scoring.py).

All come from one forward over the prompt under the sampler's weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from tinker import types
from tinker.types.topk_logprobs import TopkLogprobs

from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.workers.prompt_scoring import TOPK_MASK, PromptScoring

MAX_PROMPT_K = 1024  # top-k and alternative tokens per position: bounds the response to ~8 KB per token


@dataclass(frozen=True)
class PromptOptions:
    """The prompt-side options of one `sample` call, checked against its prompt."""

    logprobs: bool = False
    topk: int = 0
    targets: types.TensorData | None = None
    alt_k: int = 0
    last_n: int | None = None

    @property
    def wanted(self) -> bool:
        return self.logprobs or self.topk > 0 or self.targets is not None or self.alt_k > 0

    def scoring(self, temperature: float, seed: int | None) -> PromptScoring | None:
        """What the worker computes besides the log-probs (None: nothing else)."""
        if not (self.topk or self.targets is not None or self.alt_k):
            return None
        targets = None if self.targets is None else self.targets.to_torch(pad_value=-1).long()
        return PromptScoring(self.topk, targets, self.alt_k, temperature, seed)


def prompt_options(
    prompt_length: int,
    include_prompt_logprobs: bool,
    topk_prompt_logprobs: int,
    target_prompt_logprobs: types.TensorData | None,
    prompt_alt_tokens_k: int,
    prompt_logprobs_last_n: int | None,
    vocab_size: int | None = None,
) -> PromptOptions:
    """The options of a `sample` call, or a ValueError naming the one that is wrong."""
    for name, k in (
        ("topk_prompt_logprobs", topk_prompt_logprobs),
        ("prompt_alt_tokens_k", prompt_alt_tokens_k),
    ):
        if not 0 <= k <= MAX_PROMPT_K:
            raise ValueError(f"{name} must be in 0..{MAX_PROMPT_K}, got {k}")
    if prompt_logprobs_last_n is not None:
        if not (include_prompt_logprobs or topk_prompt_logprobs):
            raise ValueError("prompt_logprobs_last_n needs prompt_logprobs (or topk_prompt_logprobs)")
        if not 1 <= prompt_logprobs_last_n <= prompt_length - 1:
            raise ValueError(
                f"prompt_logprobs_last_n must be in 1..{prompt_length - 1} (the prompt's length - 1), "
                f"got {prompt_logprobs_last_n}"
            )
    if target_prompt_logprobs is not None:
        _check_targets(target_prompt_logprobs, prompt_length, vocab_size)
    return PromptOptions(
        include_prompt_logprobs, topk_prompt_logprobs, target_prompt_logprobs, prompt_alt_tokens_k,
        prompt_logprobs_last_n,
    )  # fmt: skip


def _check_targets(targets: types.TensorData, prompt_length: int, vocab_size: int | None) -> None:
    if targets.dtype != "int64":
        raise ValueError(f"target_prompt_logprobs must hold int64 token ids, got {targets.dtype}")
    try:
        table = targets.to_torch(pad_value=-1)
    except Exception as exc:  # noqa: BLE001 - a malformed CSR layout or shape, named
        raise ValueError(f"target_prompt_logprobs is malformed: {exc}") from None
    if table.dim() != 2 or table.shape[0] != prompt_length - 1:
        raise ValueError(
            f"target_prompt_logprobs must be [len(prompt) - 1, K] = [{prompt_length - 1}, K], "
            f"got {list(table.shape)}"
        )
    if table.shape[1] > MAX_PROMPT_K:
        raise ValueError(
            f"target_prompt_logprobs asks for {table.shape[1]} ids per position (at most {MAX_PROMPT_K})"
        )
    low = int(table.min()) if table.numel() else 0
    high = int(table.max()) if table.numel() else 0
    if low < -1 or (vocab_size is not None and high >= vocab_size):
        raise ValueError(
            f"target_prompt_logprobs holds ids {low}..{high}; token ids are 0..{(vocab_size or 0) - 1}, "
            "-1 for none"
        )


def response_fields(scored: Batch, options: PromptOptions) -> dict[str, object]:
    """`SampleResponse` keyword arguments from the first row of a scored prompt batch."""
    fields: dict[str, object] = {}
    length = scored[keys.API_LOGPROBS].shape[1]
    start = 1 if options.last_n is None else length - options.last_n  # first position reported
    if options.logprobs:
        logprobs = scored[keys.API_LOGPROBS][0].numpy().astype(np.float32)
        logprobs[:start] = np.nan
        fields["prompt_logprobs_np"] = logprobs
    if options.topk:
        ids = scored[keys.API_TOPK_IDS][0].numpy().astype(np.int32)
        values = scored[keys.API_TOPK_LOGPROBS][0].numpy().astype(np.float32)
        ids[:start], values[:start] = 0, TOPK_MASK
        fields["topk_prompt_logprobs_np"] = TopkLogprobs(token_ids=ids, logprobs=values)
    if options.targets is not None:
        fields["target_prompt_logprobs"] = _like(options.targets, scored[keys.API_TARGET_LOGPROBS][0])
    if options.alt_k:
        fields["prompt_alt_tokens"] = types.PromptAltTokens(
            tokens=types.TensorData.from_torch(scored[keys.API_ALT_TOKENS][0].long()),
            logprobs=types.TensorData.from_torch(scored[keys.API_ALT_LOGPROBS][0].float()),
        )
    return fields


def _like(asked: types.TensorData, values: torch.Tensor) -> types.TensorData:
    """`values` (dense, the asked table's shape) in the layout of `asked`: dense, or the same CSR cells."""
    values = values.float()
    if asked.sparse_crow_indices is None:
        return types.TensorData.from_torch(values)
    crow = np.asarray(asked.sparse_crow_indices, dtype=np.int64)
    cols = np.asarray(asked.sparse_col_indices, dtype=np.int64)
    row_of = np.repeat(np.arange(len(crow) - 1), np.diff(crow))
    picked = values.numpy()[row_of, cols].astype(np.float32)
    return types.TensorData(
        data=picked, dtype="float32", shape=list(values.shape),
        sparse_crow_indices=crow.tolist(), sparse_col_indices=cols.tolist(),
    )  # fmt: skip
