"""Shared-prompt packing: the n samples of a GRPO group run their common prompt through the model once.

Rows of a micro-batch that carry the same prompt (the n samples of one prompt) become one *unit* in a
packed row: [prompt | response 1 | response 2 | ...]. Response tokens attend to the prompt and, causally,
to their own response only; prompt tokens attend causally to the prompt. Each response's position ids
continue from the prompt's length, so every response token sees exactly the context it had when it was
sampled and the outputs equal the unshared computation (up to float reordering), while the prompt's
activations are computed once and receive the gradient of all n responses. With prompts of P tokens and
responses of R, the model processes P + nR tokens per group instead of n(P + R).

The attention pattern is not block-diagonal causal. The layout describes it as runs
(`varlen_attention.Segments`: a prefix run, then each suffix seeing the prefix and itself), which the
engine's per-segment attention (`posttrain_varlen`, used for sdpa) takes directly; for eager it becomes an
explicit 4D mask (rows, 1, W, W) that transformers passes through unchanged (`attention_mask`, in the
additive float form). Kernels that take neither (flash attention's variable-length path) cannot express
it; the engine uses plain packing there. Pure tensor code, no model call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from posttrain.data.partition import first_fit_decreasing, trimmed_width
from posttrain.engine.varlen_attention import Run, Segments
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
    segments: Segments  # who attends to whom, as runs (the mask is `attention_mask`)
    predict_pos: torch.Tensor  # (B, R) flat packed index of the output predicting each response token; -1 pad
    real_pos: torch.Tensor  # (N,) flat packed index of every real (not filler) token, ascending
    cell_pos: (
        torch.Tensor
    )  # flat packed index of each real cell of the input, in `attention_mask.bool()` order

    @property
    def attention_mask(self) -> torch.Tensor:
        """(rows, 1, width, width) bool, True = may attend: the runs as a mask (built on each access)."""
        return self.segments.attention_mask(self.input_ids.shape[1], self.input_ids.device)


def real_tokens(input_ids: torch.Tensor, mask: torch.Tensor) -> tuple[list[list[int]], list[list[int]]]:
    """Each row's real (unmasked) token ids and their column indices, as Python lists (one conversion)."""
    columns = [[c for c, m in enumerate(keep) if m] for keep in mask.tolist()]
    tokens = [[row[c] for c in cols] for row, cols in zip(input_ids.tolist(), columns, strict=True)]
    return tokens, columns


def group_rows_by_prompt(prompts: list[list[int]], labels: Sequence[int] | None = None) -> list[list[int]]:
    """Row indices grouped by identical prompt tokens, in order of first appearance. `labels`: rows of
    different labels never group, whatever their tokens (rows whose images differ: the same image tokens
    stand for other pixels)."""
    groups: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for i, prompt in enumerate(prompts):
        label = labels[i] if labels is not None else 0
        groups.setdefault((label, tuple(prompt)), []).append(i)
    return list(groups.values())


def has_shared_prompts(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_width: int,
    labels: Sequence[int] | None = None,
) -> bool:
    """Whether any two rows carry the same prompt (otherwise sharing saves nothing); `labels` as in
    `group_rows_by_prompt`."""
    prompt_width = input_ids.shape[1] - response_width
    prompts, _ = real_tokens(input_ids[:, :prompt_width], attention_mask[:, :prompt_width])
    return len(group_rows_by_prompt(prompts, labels)) < input_ids.shape[0]


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass(frozen=True)
class PrefixGroup:
    """Rows whose first `prefix_len` tokens are identical: that prefix runs once for all of them."""

    rows: list[int]
    prefix_len: int


def detect_shared_prefixes_within(sequences: list[list[int]], labels: Sequence[int]) -> list[PrefixGroup]:
    """`detect_shared_prefixes` among the rows of each label separately: rows of different labels (tokens of
    different LoRA adapters in one pass, or of different images) never share a prefix, whose outputs would
    differ between them."""
    groups: list[PrefixGroup] = []
    for label in sorted(set(labels)):
        rows = [i for i, x in enumerate(labels) if x == label]
        for group in detect_shared_prefixes([sequences[i] for i in rows]):
            groups.append(PrefixGroup([rows[i] for i in group.rows], group.prefix_len))
    return groups


def detect_shared_prefixes(sequences: list[list[int]]) -> list[PrefixGroup]:
    """Rows grouped so that the prefix tokens computed once are as many as possible (detected, not declared).

    Sorted lexicographically, rows with a common prefix are neighbours, and a group's common prefix is the
    minimum of its neighbours' common prefixes. The best split of the sorted rows into runs maximises the
    tokens saved, sum over runs of (rows - 1) * common prefix; a dynamic programme over the split points
    finds it exactly (O(rows^2), rows of one micro-batch). A row that shares nothing is a group of one whose
    prefix is the whole row, so every row is in exactly one group.
    """
    order = sorted(range(len(sequences)), key=lambda i: sequences[i])
    n = len(order)
    neighbour = [common_prefix_length(sequences[order[i]], sequences[order[i + 1]]) for i in range(n - 1)]
    best = [0] * (n + 1)  # best[j]: tokens saved by the best split of the first j sorted rows
    cut = [0] * (n + 1)  # where the last run of that split starts
    for j in range(1, n + 1):
        best[j], cut[j] = best[j - 1], j - 1  # row j - 1 alone
        shared = 1 << 62
        for i in range(j - 2, -1, -1):  # the run order[i:j]
            shared = min(shared, neighbour[i])
            if shared == 0:
                break
            saved = best[i] + (j - i - 1) * shared
            if saved > best[j]:
                best[j], cut[j] = saved, i
    groups: list[PrefixGroup] = []
    j = n
    while j > 0:
        i = cut[j]
        rows = order[i:j]
        prefix = len(sequences[rows[0]]) if len(rows) == 1 else min(neighbour[i : j - 1])
        groups.append(PrefixGroup(rows, prefix))
        j = i
    return groups[::-1]


@dataclass(frozen=True)
class SharedPrefixLayout:
    input_ids: torch.Tensor  # (rows, width) packed tokens; the tail of each row is filler
    position_ids: torch.Tensor  # (rows, width)
    segments: Segments  # who attends to whom, as runs (the mask is `attention_mask`)
    token_pos: list[list[int]]  # per input row: the flat packed index of each of its tokens, in order

    @property
    def attention_mask(self) -> torch.Tensor:
        """(rows, 1, width, width) bool, True = may attend: the runs as a mask (built on each access)."""
        return self.segments.attention_mask(self.input_ids.shape[1], self.input_ids.device)


def _units(groups: list[PrefixGroup], lengths: list[int], width: int) -> list[PrefixGroup]:
    """Split each group into units whose prefix + suffixes fit in `width` (one prefix copy per unit)."""
    units = []
    for group in groups:
        current: list[int] = []
        used = group.prefix_len
        for i in group.rows:
            suffix = lengths[i] - group.prefix_len
            if current and used + suffix > width:
                units.append(PrefixGroup(current, group.prefix_len))
                current, used = [], group.prefix_len
            current.append(i)
            used += suffix
        units.append(PrefixGroup(current, group.prefix_len))
    return units


def pack_prefix_groups(
    sequences: list[list[int]],
    groups: list[PrefixGroup],
    row_tokens: int,
    device: torch.device,
    labels: Sequence[int] | None = None,
) -> SharedPrefixLayout:
    """Pack sequences with one copy of each group's prefix: [prefix | suffix 1 | suffix 2 | ...] per unit.

    Suffix tokens attend to the prefix and, causally, to their own suffix; prefix tokens attend causally to
    the prefix. Each suffix's position ids continue from the prefix length, so every token sees exactly its
    own sequence's context. Units go into rows of at most max(`row_tokens`, longest sequence) tokens
    (first-fit decreasing; trimmed to the fullest row, `partition.trimmed_width`); a group that does not fit one row is split into several units, each with the prefix.
    `labels` (per sequence; a group's rows share one): units of different labels never share a packed row.
    Built in Python lists and turned into tensors once (it runs before every pass).
    """
    lengths = [len(s) for s in sequences]
    width = max([row_tokens, *lengths])
    units = _units(groups, lengths, width)
    unit_lens = [u.prefix_len + sum(lengths[i] - u.prefix_len for i in u.rows) for u in units]
    unit_labels = None if labels is None else [labels[u.rows[0]] for u in units]
    bins = first_fit_decreasing(unit_lens, width, unit_labels)
    width = trimmed_width(bins, unit_lens, width)  # no row wider than the fullest one needs

    ids: list[int] = []
    positions: list[int] = []
    rows: list[tuple[Run, ...]] = []  # per packed row, the runs that tile it
    token_pos: list[list[int]] = [[] for _ in sequences]
    for members in bins:
        row_start = len(ids)
        runs: list[Run] = []
        for u in members:
            unit = units[u]
            p = unit.prefix_len
            prefix_start = len(ids)
            ids += sequences[unit.rows[0]][:p]
            positions += range(p)
            if p:  # the prefix attends causally to itself
                runs.append(Run(prefix_start - row_start, prefix_start - row_start + p))
            for i in unit.rows:
                suffix = sequences[i][p:]
                token_pos[i] = [
                    *range(prefix_start, prefix_start + p),
                    *range(len(ids), len(ids) + len(suffix)),
                ]
                if suffix:  # a suffix sees the whole prefix and, causally, itself
                    start = len(ids) - row_start
                    prefix = prefix_start - row_start
                    runs.append(Run(start, start + len(suffix), prefix, prefix + p))
                ids += suffix
                positions += range(p, p + len(suffix))
        # filler: its own causal run, never attended to by others
        filler = width - (len(ids) - row_start)
        if filler:
            runs.append(Run(width - filler, width))
        ids += [0] * filler
        positions += range(filler)
        rows.append(tuple(runs))

    def grid(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device).view(len(bins), width)

    return SharedPrefixLayout(grid(ids), grid(positions), Segments(tuple(rows)), token_pos)


def pack_shared_prompts(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_width: int,
    row_tokens: int,
    labels: Sequence[int] | None = None,
) -> SharedPromptLayout:
    """Pack [left-padded prompt | right-padded response] rows with one prompt copy per group of rows with
    identical real prompt tokens and equal `labels` (`pack_prefix_groups` with the prompt as the prefix)."""
    batch, total = input_ids.shape
    prompt_width = total - response_width
    prompts, _ = real_tokens(input_ids[:, :prompt_width], attention_mask[:, :prompt_width])
    responses, response_cells = real_tokens(input_ids[:, prompt_width:], attention_mask[:, prompt_width:])
    groups = [PrefixGroup(rows, len(prompts[rows[0]])) for rows in group_rows_by_prompt(prompts, labels)]
    sequences = [p + r for p, r in zip(prompts, responses, strict=True)]
    layout = pack_prefix_groups(sequences, groups, row_tokens, input_ids.device)
    # the output before each response token predicts it (the prompt's last output predicts token 0)
    cell_rows, cell_cols, cell_pos = [], [], []
    for i, cells in enumerate(response_cells):
        start = len(prompts[i])
        cell_rows += [i] * len(cells)
        cell_cols += cells
        cell_pos += layout.token_pos[i][start - 1 : start - 1 + len(cells)]
    predict_pos = torch.full((batch, response_width), -1, dtype=torch.long, device=input_ids.device)
    predict_pos[cell_rows, cell_cols] = torch.tensor(cell_pos, dtype=torch.long, device=input_ids.device)
    real_pos = torch.tensor(sorted({p for row in layout.token_pos for p in row}), dtype=torch.long)
    return SharedPromptLayout(
        layout.input_ids.to(input_ids.dtype),
        layout.position_ids,
        layout.segments,
        predict_pos,
        real_pos.to(input_ids.device),
        torch.tensor([p for row in layout.token_pos for p in row], dtype=torch.long, device=input_ids.device),
    )


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float form of a boolean attention mask (0 where allowed, the dtype's minimum elsewhere), for eager."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
