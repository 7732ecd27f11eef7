"""Shared-prompt packing: the n samples of a GRPO group run their common prompt through the model once.

Rows of a micro-batch that carry the same prompt (the n samples of one prompt) become one *unit* in a
packed row: [prompt | response 1 | response 2 | ...]. Response tokens attend to the prompt and, causally,
to their own response only; prompt tokens attend causally to the prompt. Each response's position ids
continue from the prompt's length, so every response token sees exactly the context it had when it was
sampled and the outputs equal the unshared computation (up to float reordering), while the prompt's
activations are computed once and receive the gradient of all n responses. With prompts of P tokens and
responses of R, the model processes P + nR tokens per group instead of n(P + R).

The attention pattern is not block-diagonal causal, so it goes to the model as an explicit 4D boolean
mask (rows, 1, W, W) that transformers passes through unchanged (sdpa; eager gets the additive float
form). Kernels that take no mask (flash attention's variable-length path) cannot express it; the engine
uses plain packing there. Pure tensor code, no model call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.data.partition import first_fit_decreasing
from posttrain.errors import ConfigError

# attention implementations that accept an arbitrary 4D mask
MASKED_ATTENTION = ("sdpa", "eager")


def check_share_prompt(share_prompt: bool, remove_padding: bool, attn_implementation: str) -> None:
    """Reject settings under which prompts cannot be shared, naming them."""
    if share_prompt and not remove_padding:
        raise ConfigError(
            "model.share_prompt=true works on packed sequences: it needs model.remove_padding=true"
        )
    if share_prompt and attn_implementation not in MASKED_ATTENTION:
        raise ConfigError(
            "model.share_prompt=true needs an attention that takes a custom mask "
            f"({', '.join(MASKED_ATTENTION)}), not model.attn_implementation={attn_implementation}; "
            "set model.share_prompt=false"
        )


@dataclass(frozen=True)
class SharedPromptLayout:
    input_ids: torch.Tensor  # (rows, width) packed tokens; the tail of each row is filler
    position_ids: torch.Tensor  # (rows, width)
    attention_mask: torch.Tensor  # (rows, 1, width, width) bool, True = may attend
    predict_pos: torch.Tensor  # (B, R) flat packed index of the output predicting each response token; -1 pad


def group_rows_by_prompt(input_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    """Row indices grouped by identical prompt tokens (real tokens only), in order of first appearance."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i in range(input_ids.shape[0]):
        key = tuple(input_ids[i][prompt_mask[i]].tolist())
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def has_shared_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_width: int) -> bool:
    """Whether any two rows carry the same prompt (otherwise sharing saves nothing)."""
    prompt_width = input_ids.shape[1] - response_width
    prompt_mask = attention_mask[:, :prompt_width].bool()
    return len(group_rows_by_prompt(input_ids[:, :prompt_width], prompt_mask)) < input_ids.shape[0]


def _units(
    groups: list[list[int]], prompt_lens: list[int], response_lens: list[int], width: int
) -> list[list[int]]:
    """Split each group into units whose prompt + responses fit in `width` (one prompt copy per unit)."""
    units = []
    for rows in groups:
        prompt = prompt_lens[rows[0]]
        current: list[int] = []
        used = prompt
        for i in rows:
            if current and used + response_lens[i] > width:
                units.append(current)
                current, used = [], prompt
            current.append(i)
            used += response_lens[i]
        units.append(current)
    return units


def pack_shared_prompts(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, response_width: int, row_tokens: int
) -> SharedPromptLayout:
    """Pack [left-padded prompt | right-padded response] rows with one prompt copy per group.

    Rows are grouped by identical real prompt tokens; a group whose prompt + responses exceed the row width
    (max(`row_tokens`, longest prompt + response)) is split into several units, each with the prompt.
    """
    device = input_ids.device
    batch, total = input_ids.shape
    prompt_width = total - response_width
    mask = attention_mask.bool()
    prompt_mask, response_mask = mask[:, :prompt_width], mask[:, prompt_width:]
    prompt_lens = prompt_mask.sum(1).tolist()
    response_lens = response_mask.sum(1).tolist()
    width = max([row_tokens, *(p + r for p, r in zip(prompt_lens, response_lens, strict=True))])
    groups = group_rows_by_prompt(input_ids[:, :prompt_width], prompt_mask)
    units = _units(groups, prompt_lens, response_lens, width)
    unit_lens = [prompt_lens[u[0]] + sum(response_lens[i] for i in u) for u in units]
    bins = first_fit_decreasing(unit_lens, width)

    ids = torch.zeros((len(bins), width), dtype=input_ids.dtype, device=device)
    positions = torch.zeros((len(bins), width), dtype=torch.long, device=device)
    # per packed token: which unit it belongs to and which branch (0 = prompt, k = k-th response)
    unit_of = torch.full((len(bins), width), -1, dtype=torch.long, device=device)
    branch_of = torch.zeros((len(bins), width), dtype=torch.long, device=device)
    predict_pos = torch.full((batch, response_width), -1, dtype=torch.long, device=device)
    for row, members in enumerate(bins):
        offset = 0
        for u in members:
            rows = units[u]
            first = rows[0]
            prompt = input_ids[first, :prompt_width][prompt_mask[first]]
            p = prompt.numel()
            ids[row, offset : offset + p] = prompt
            positions[row, offset : offset + p] = torch.arange(p, device=device)
            unit_of[row, offset : offset + p] = u
            last_prompt = row * width + offset + p - 1
            offset += p
            for k, i in enumerate(rows, start=1):
                r = response_lens[i]
                if r == 0:
                    continue
                ids[row, offset : offset + r] = input_ids[i, prompt_width:][response_mask[i]]
                positions[row, offset : offset + r] = torch.arange(p, p + r, device=device)
                unit_of[row, offset : offset + r] = u
                branch_of[row, offset : offset + r] = k
                # the prompt's last output predicts response token 0; token j's output predicts j + 1
                flat = row * width + offset + torch.arange(r, device=device)
                cells = response_mask[i].nonzero().flatten()
                predict_pos[i, cells] = torch.cat([flat.new_tensor([last_prompt]), flat[:-1]])
                offset += r
        # filler: its own causal run (branch 0 of a unit id no real token has), never attended to by others
        unit_of[row, offset:] = len(units) + row
        positions[row, offset:] = torch.arange(width - offset, device=device)

    causal = torch.ones((width, width), dtype=torch.bool, device=device).tril()
    same_unit = unit_of[:, :, None] == unit_of[:, None, :]
    key_visible = (branch_of[:, None, :] == 0) | (branch_of[:, :, None] == branch_of[:, None, :])
    attend = same_unit & key_visible & causal
    return SharedPromptLayout(ids, positions, attend[:, None], predict_pos)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float form of a boolean attention mask (0 where allowed, the dtype's minimum elsewhere), for eager."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
