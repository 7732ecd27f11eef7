"""What one forward over a prompt gives besides each token's log-prob: tinker's `SampleRequest` options
`topk_prompt_logprobs`, `target_prompt_logprobs` and `prompt_alt_tokens_k`, computed from the same logits.

Positions follow tinker: position i of the prompt is predicted from tokens < i, so position 0 has no scores.
- top-k: the k likeliest tokens and their log-probs at every position (log p at temperature 1, as the
  prompt's own log-probs); position 0 holds the sentinel (token 0, TOPK_MASK), as tinker's TopkLogprobs.
- targets: an int64 (T-1, K) table of token ids, row i scored at position i + 1; -1 asks for nothing (0.0).
  Knowledge distillation's teacher scores are this: the teacher's log-probs of chosen ids.
- alternative tokens: k independent draws, with replacement, from the next-token distribution at every
  position after the first, at the request's temperature, with their log-probs under that distribution
  (the one they were drawn from, as sampled tokens' log-probs are); temperature 0 draws the argmax k times
  and reports its temperature-1 log-prob.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.data import keys

TOPK_MASK = -99999.0  # tinker's MASK_LOGPROB: an empty top-k entry


@dataclass(frozen=True)
class PromptScoring:
    """The scores asked for besides the prompt's log-probs (all rows of a call are copies of one prompt)."""

    topk: int = 0
    targets: torch.Tensor | None = None  # (T-1, K) long, -1: nothing asked
    alt_k: int = 0
    alt_temperature: float = 1.0
    alt_seed: int | None = None  # None: the global generator

    def __post_init__(self) -> None:
        if self.topk < 0 or self.alt_k < 0:
            raise ValueError(f"topk and alt_k must be >= 0, got {self.topk} and {self.alt_k}")
        if self.targets is not None and self.targets.dim() != 2:
            raise ValueError(
                f"targets must be a (prompt length - 1, K) table, got {tuple(self.targets.shape)}"
            )


def score_prompt(logits: torch.Tensor, scoring: PromptScoring) -> dict[str, torch.Tensor]:
    """The asked-for scores of (B, T, V) float logits (the model's, untempered), as Batch columns."""
    out: dict[str, torch.Tensor] = {}
    rows, length, _ = logits.shape
    next_token = logits[:, :-1]
    log_p = torch.log_softmax(next_token, dim=-1)  # (B, T-1, V) at temperature 1
    if scoring.topk:
        values, ids = log_p.topk(min(scoring.topk, log_p.shape[-1]), dim=-1)
        first_ids = ids.new_zeros(rows, 1, ids.shape[-1])
        first_values = values.new_full((rows, 1, values.shape[-1]), TOPK_MASK)
        out[keys.API_TOPK_IDS] = torch.cat([first_ids, ids], dim=1)
        out[keys.API_TOPK_LOGPROBS] = torch.cat([first_values, values], dim=1)
    if scoring.targets is not None:
        targets = scoring.targets.to(logits.device)
        if targets.shape[0] != length - 1:
            raise ValueError(
                f"target_prompt_logprobs has {targets.shape[0]} rows; a prompt of {length} tokens takes "
                f"{length - 1} (row i is scored at position i + 1)"
            )
        asked = targets >= 0
        picked = log_p.gather(-1, targets.clamp(min=0).expand(rows, -1, -1))
        out[keys.API_TARGET_LOGPROBS] = torch.where(asked, picked, torch.zeros_like(picked))
    if scoring.alt_k:
        out[keys.API_ALT_TOKENS], out[keys.API_ALT_LOGPROBS] = _draws(next_token, log_p, scoring)
    return out


def _draws(
    next_token: torch.Tensor, log_p: torch.Tensor, scoring: PromptScoring
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, positions, vocab = next_token.shape
    k = scoring.alt_k
    if scoring.alt_temperature <= 0:
        tokens = next_token.argmax(-1, keepdim=True).expand(-1, -1, k)
        return tokens.contiguous(), log_p.gather(-1, tokens)
    tempered = torch.log_softmax(next_token / scoring.alt_temperature, dim=-1)
    generator = None
    if scoring.alt_seed is not None:
        generator = torch.Generator(device=next_token.device).manual_seed(scoring.alt_seed)
    flat = tempered.reshape(-1, vocab).exp()
    if flat.numel() == 0:
        empty = next_token.new_zeros(rows, positions, k)
        return empty.long(), empty
    tokens = torch.multinomial(flat, k, replacement=True, generator=generator).view(rows, positions, k)
    return tokens, tempered.gather(-1, tokens)
