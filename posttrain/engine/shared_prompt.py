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


def real_tokens(input_ids: torch.Tensor, mask: torch.Tensor) -> tuple[list[list[int]], list[list[int]]]:
    """Each row's real (unmasked) token ids and their column indices, as Python lists (one conversion)."""
    columns = [[c for c, m in enumerate(keep) if m] for keep in mask.tolist()]
    tokens = [[row[c] for c in cols] for row, cols in zip(input_ids.tolist(), columns, strict=True)]
    return tokens, columns


def group_rows_by_prompt(prompts: list[list[int]]) -> list[list[int]]:
    """Row indices grouped by identical prompt tokens, in order of first appearance."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(tuple(prompt), []).append(i)
    return list(groups.values())


def has_shared_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_width: int) -> bool:
    """Whether any two rows carry the same prompt (otherwise sharing saves nothing)."""
    prompt_width = input_ids.shape[1] - response_width
    prompts, _ = real_tokens(input_ids[:, :prompt_width], attention_mask[:, :prompt_width])
    return len(group_rows_by_prompt(prompts)) < input_ids.shape[0]


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
    The layout is built in Python lists and turned into tensors once (it runs before every pass).
    """
    device = input_ids.device
    batch, total = input_ids.shape
    prompt_width = total - response_width
    prompts, _ = real_tokens(input_ids[:, :prompt_width], attention_mask[:, :prompt_width])
    responses, response_cells = real_tokens(input_ids[:, prompt_width:], attention_mask[:, prompt_width:])
    prompt_lens, response_lens = [len(p) for p in prompts], [len(r) for r in responses]
    width = max([row_tokens, *(p + r for p, r in zip(prompt_lens, response_lens, strict=True))])
    units = _units(group_rows_by_prompt(prompts), prompt_lens, response_lens, width)
    unit_lens = [prompt_lens[u[0]] + sum(response_lens[i] for i in u) for u in units]
    bins = first_fit_decreasing(unit_lens, width)

    # per packed token: id, position, unit, branch (0 = prompt, k = k-th response of the unit)
    ids: list[int] = []
    positions: list[int] = []
    unit_of: list[int] = []
    branch_of: list[int] = []
    cell_rows: list[int] = []  # predict_pos[cell_rows[j], cell_cols[j]] = cell_pos[j]
    cell_cols: list[int] = []
    cell_pos: list[int] = []
    for row, members in enumerate(bins):
        row_start = len(ids)
        for u in members:
            prompt = prompts[units[u][0]]
            p = len(prompt)
            ids += prompt
            positions += range(p)
            unit_of += [u] * p
            branch_of += [0] * p
            last_prompt = len(ids) - 1
            for k, i in enumerate(units[u], start=1):
                r = response_lens[i]
                start = len(ids)
                ids += responses[i]
                positions += range(p, p + r)
                unit_of += [u] * r
                branch_of += [k] * r
                # the prompt's last output predicts response token 0; token j's output predicts j + 1
                cell_rows += [i] * r
                cell_cols += response_cells[i]
                cell_pos += [last_prompt, *range(start, start + r - 1)][:r]
        # filler: its own causal run (a unit id no real token has), never attended to by others
        filler = width - (len(ids) - row_start)
        ids += [0] * filler
        positions += range(filler)
        unit_of += [len(units) + row] * filler
        branch_of += [0] * filler

    def grid(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device).view(len(bins), width)

    unit, branch = grid(unit_of), grid(branch_of)
    predict_pos = torch.full((batch, response_width), -1, dtype=torch.long, device=device)
    predict_pos[cell_rows, cell_cols] = torch.tensor(cell_pos, dtype=torch.long, device=device)
    causal = torch.ones((width, width), dtype=torch.bool, device=device).tril()
    same_unit = unit[:, :, None] == unit[:, None, :]
    key_visible = (branch[:, None, :] == 0) | (branch[:, :, None] == branch[:, None, :])
    attend = same_unit & key_visible & causal
    return SharedPromptLayout(grid(ids).to(input_ids.dtype), grid(positions), attend[:, None], predict_pos)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float form of a boolean attention mask (0 where allowed, the dtype's minimum elsewhere), for eager."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
