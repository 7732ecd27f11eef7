"""Packed attention without an L x L mask: torch SDPA run per segment of a packed row.

A packed row holds several sequences end to end (engine.packing) or shared-prompt units
[prefix | suffix 1 | suffix 2 | ...] (engine.shared_prompt). Under `sdpa` transformers expresses that
layout as a (rows, 1, L, L) mask: at 32k tokens a gigabyte of booleans per row, and a float copy of it
inside SDPA on CPU. Here the row is cut into *runs* instead: each run's queries attend causally to the
run's own keys and, for a shared-prompt suffix, to all of its prefix's keys. Memory then grows with the
runs (the flash kernel's blocks, or one run's (n, prefix + n) mask), not with the row squared, and no
compute is spent across sequences. Runs of the same padded shape (`padded_length`) are gathered into one
batch and attended by one SDPA call, so a step of hundreds of sequences costs a few calls per layer, not one
per sequence (one call per run made RL steps of 8-token responses 40% slower than the masked path) nor one
per distinct length (which cost long responses of scattered lengths about as much).

The function is registered with transformers' attention registry (`AttentionInterface.register`) as
`posttrain_varlen`; a model loaded with `attn_implementation="posttrain_varlen"` calls it from its own
attention modules after the projections and rotary embeddings, so no attention code is copied. The runs
arrive through the model's keyword arguments: `Qwen2ForCausalLM.forward(**kwargs)` hands its extra kwargs
through the decoder layers to the attention function unchanged (transformers 5.x, as `cu_seq_lens_q` for
flash attention). They travel as one host-side `Segments` object (`posttrain_segments=`), computed once
per packed batch, because the loop over runs needs their bounds in Python: a `cu_seq_lens` tensor would
cost a device sync per layer, and cannot express a suffix's view of its prefix. The name is deliberately
not registered as a mask function, so transformers builds no mask for it.

Short rows are the exception (`dense_is_cheaper`): a group costs a fixed ~1 ms on a 2-core CPU (its
gathers, an SDPA call and the scatter, forward and backward) whatever its size, so a micro-batch of 8-token
responses behind shared prompts (rows of 256 columns, a dozen groups per layer) spent 16 ms per layer in
groups against 6 ms for one SDPA call over its rows with their (rows, 1, L, L) boolean mask. On CPU the plan
takes that one call when its L x L cells cost less than the groups' cells plus their fixed price, and never
past `DENSE_MAX_CELLS`; on accelerators, where the price was not measured, it always groups.

A call without segments, with a mask, or with a feature the loop does not implement (sliding windows,
soft-capping) is an error, never a silent fallback to another path.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv

from posttrain.engine.sequence_parallel import SequenceParallel, heads_to_seq, seq_to_heads
from posttrain.errors import ConfigError
from posttrain.models.attention import sliding_window

VARLEN = "posttrain_varlen"
SEGMENTS_KWARG = "posttrain_segments"
SP_KWARG = "posttrain_sequence_parallel"  # a SequenceParallel: Ulysses all-to-all around the runs
# The fixed price of attending one group of runs (gathers, cat, SDPA, scatter; forward and backward), in
# attention cells (query x key pairs) at 128 head-dims: ~1 ms on 2 CPU cores at ~30 ns a cell (measured with
# the tiny preset's 4 heads of 32 on an AMD EPYC; dense and grouped calls timed on short and long layouts).
GROUP_PRICE_CELLS = 32_768
GROUP_PRICE_HEAD_DIMS = 128
DENSE_MAX_CELLS = 1 << 22  # rows x L x L: at most 4 MB of mask (and SDPA's float copy on CPU)


class Run(NamedTuple):
    """Columns [start, end) of a packed row attend causally among themselves and see all of the context
    columns [context_start, context_end) (empty for a plain packed sequence; a shared prefix for a suffix)."""

    start: int
    end: int
    context_start: int = 0
    context_end: int = 0


class Segments:
    """The attention layout of packed rows: per row, the runs that tile it from column 0 to its width.

    A plain class, not a dataclass: FSDP2's mixed precision casts a module's forward kwargs by rebuilding
    every dataclass among them (`dataclasses.replace`, recursively), which at each wrapped layer would make
    a new Segments and drop its plan cache. Immutable by convention; equal when the rows are."""

    __slots__ = ("_plans", "rows")

    def __init__(self, rows: tuple[tuple[Run, ...], ...]) -> None:
        self.rows = rows
        self._plans: dict[tuple[int, str], RunPlan] = {}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Segments) and self.rows == other.rows

    def __hash__(self) -> int:
        return hash(self.rows)

    def __repr__(self) -> str:
        return f"Segments(rows={self.rows!r})"

    def plan(self, width: int, device: torch.device, head_dims: int = GROUP_PRICE_HEAD_DIMS) -> RunPlan:
        """The runs grouped by shape (length, context length), each group as flat column indices into the
        (rows * width) tokens, or the rows' dense mask where one call is cheaper (`dense_is_cheaper`, for
        `head_dims` = query heads x head size); computed once per layout, device and head count and reused by
        every layer."""
        plan_key = (width, str(device), head_dims)
        if plan_key not in self._plans:
            plan = _group_runs(self.rows, width, device)
            if device.type == "cpu" and dense_is_cheaper(plan, len(self.rows), width, head_dims):
                plan = plan._replace(dense_mask=self.attention_mask(width, device))
            self._plans[plan_key] = plan
        return self._plans[plan_key]

    @property
    def lengths(self) -> list[int]:
        return [run.end - run.start for runs in self.rows for run in runs]

    def cu_seqlens(self, width: int) -> torch.Tensor:
        """Flash attention's convention: run boundaries over the flattened (rows * width) tokens (int32)."""
        bounds = [0] + [b * width + run.end for b, runs in enumerate(self.rows) for run in runs]
        return torch.tensor(bounds, dtype=torch.int32)

    def attention_mask(self, width: int, device: torch.device | None = None) -> torch.Tensor:
        """The same layout as a (rows, 1, width, width) boolean mask (True = may attend), for attention
        implementations that take a mask (sdpa, eager): the L x L tensor the runs avoid."""
        mask = torch.empty((len(self.rows), 1, width, width), dtype=torch.bool)
        columns = torch.arange(width)
        for b, runs in enumerate(self.rows):
            lengths = torch.tensor([run.end - run.start for run in runs])
            bounds = torch.tensor([(run.start, run.context_start, run.context_end) for run in runs])
            # each query column's bounds: those of its run (the runs tile the row in order)
            start, context_start, context_end = torch.repeat_interleave(bounds, lengths, dim=0).T[:, :, None]
            key_columns = columns[None, :]
            own = (key_columns >= start) & (key_columns <= columns[:, None])  # its run, causally
            mask[b, 0] = own | ((key_columns >= context_start) & (key_columns < context_end))
        return mask.to(device)


class RunGroup(NamedTuple):
    """Runs of one padded length: `columns` (count, n) and `context` (count, c) index the flattened
    rows * width tokens; one SDPA call attends all of them at once. Runs shorter than n are padded at their
    end with copies of their last column: under the causal mask a real query never sees a padded key, and
    `keep` (flat indices into count * n) drops the padded queries' outputs, so neither reaches a result or
    a gradient. Contexts shorter than c are padded the same way and hidden by `mask` (count, 1, n, c + n);
    without padded contexts `mask` is the (n, c + n) causal-with-context mask, or None (plain causal)."""

    columns: torch.Tensor
    context: torch.Tensor | None
    keep: torch.Tensor | None
    mask: torch.Tensor | None


class RunPlan(NamedTuple):
    """The groups, and the permutation that puts their concatenated columns back in row order (the runs
    tile every column, so the gathered columns are a permutation of all of them); or, where one call over
    the whole rows is cheaper, their (rows, 1, L, L) mask (`dense_mask`), which the groups then give way to."""

    groups: list[RunGroup]
    order: torch.Tensor
    dense_mask: torch.Tensor | None = None


def dense_is_cheaper(plan: RunPlan, rows: int, width: int, head_dims: int) -> bool:
    """Whether one SDPA call over `rows` x `width` x `width` cells (mask included) costs less than the
    plan's groups: their padded cells (count x n x (context + n)) plus GROUP_PRICE_CELLS per group, the
    price scaled from 128 head-dims to `head_dims` (a cell's work grows with them, a call's overhead does
    not). Both paths give the same outputs up to rounding: only their cost differs."""
    dense = rows * width * width
    if dense > DENSE_MAX_CELLS:
        return False
    grouped = sum(
        g.columns.numel() * (g.columns.shape[1] + (g.context.shape[1] if g.context is not None else 0))
        for g in plan.groups
    )
    price = GROUP_PRICE_CELLS * GROUP_PRICE_HEAD_DIMS / max(head_dims, 1)
    return dense <= grouped + price * len(plan.groups)


def padded_length(n: int) -> int:
    """The length a run of `n` columns is attended at: exact up to 8, then rounded up to a multiple of a
    quarter of the largest power of two <= n (9-15 -> even, 16-31 -> multiples of 4, ...; under 25% extra
    attention work). Sequences of many different lengths (long RL responses) then share a few SDPA calls
    per layer instead of one per distinct length, which cost ~30 calls per layer on 64 responses of 40-110
    tokens."""
    if n <= 8:
        return n
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


def _padded_index(starts: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """(count, width) column indices starts[i] + j, with j clamped to the run's last column."""
    j = torch.minimum(torch.arange(width)[None, :], (lengths - 1)[:, None])
    return starts[:, None] + j


def _group_runs(rows: tuple[tuple[Run, ...], ...], width: int, device: torch.device) -> RunPlan:
    # grouped by padded length and by the context's length within a factor of two (bit length; 0 = none);
    # a group's contexts are padded to its longest, so suffixes of different prompts share calls while a
    # long prompt never makes the suffixes of short ones attend to its length
    shapes: dict[tuple[int, int], list[tuple[int, Run]]] = defaultdict(list)
    for b, runs in enumerate(rows):
        for run in runs:
            context = run.context_end - run.context_start
            shapes[(padded_length(run.end - run.start), context.bit_length())].append((b * width, run))
    groups, real_columns = [], []
    for (n, _), members in shapes.items():
        c = max(r.context_end - r.context_start for _, r in members)
        offsets = torch.tensor([o for o, _ in members], dtype=torch.long)
        lengths = torch.tensor([r.end - r.start for _, r in members], dtype=torch.long)
        columns = _padded_index(offsets + torch.tensor([r.start for _, r in members]), lengths, n)
        real = torch.arange(n)[None, :] < lengths[:, None]  # (count, n)
        keep = None if bool(real.all()) else real.reshape(-1).nonzero().squeeze(1).to(device)
        real_columns.append(columns[real])
        context, mask = None, None
        if c:
            context_lengths = torch.tensor([r.context_end - r.context_start for _, r in members])
            context_starts = offsets + torch.tensor([r.context_start for _, r in members])
            context = _padded_index(context_starts, context_lengths, c).to(device)
            causal = _causal_with_context(n, c, torch.device("cpu"))
            if bool((context_lengths < c).any()):  # hide each run's padded context keys
                seen = torch.arange(c)[None, :] < context_lengths[:, None]  # (count, c)
                own = torch.ones((len(members), n), dtype=torch.bool)
                mask = (causal[None] & torch.cat([seen, own], dim=1)[:, None, :])[:, None].to(device)
            else:
                mask = causal.to(device)
        groups.append(RunGroup(columns.to(device), context, keep, mask))
    order = torch.argsort(torch.cat(real_columns)).to(device)
    return RunPlan(groups, order)


def segments_from_position_ids(position_ids: torch.Tensor) -> Segments:
    """The runs of packed rows whose position ids restart at each sequence (engine.packing's layout): a run
    starts wherever a position is not its predecessor + 1, the rule transformers uses to detect packing."""
    rows = []
    for positions in position_ids.tolist():
        starts = [0] + [c for c in range(1, len(positions)) if positions[c] != positions[c - 1] + 1]
        ends = [*starts[1:], len(positions)]
        rows.append(tuple(Run(s, e) for s, e in zip(starts, ends, strict=True)))
    return Segments(tuple(rows))


def _causal_with_context(n: int, context: int, device: torch.device) -> torch.Tensor:
    """(n, context + n) bool: every query sees the context, and its own run causally."""
    own = torch.ones((n, n), dtype=torch.bool, device=device).tril()
    return torch.cat([torch.ones((n, context), dtype=torch.bool, device=device), own], dim=1)


def varlen_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Causal SDPA per run of each packed row. query (B, H, L, D), key/value (B, KV, L, D) after rotary
    embeddings; returns (B, L, H, D) as transformers' attention functions do. With a sequence-parallel
    group (`posttrain_sequence_parallel=`), L is this rank's slice of the columns and the segments describe
    the full rows (engine.sequence_parallel)."""
    segments = kwargs.get(SEGMENTS_KWARG)
    if not isinstance(segments, Segments):
        raise RuntimeError(
            f"attn_implementation={VARLEN} attends per packed segment and needs the segments of the packed "
            f"rows ({SEGMENTS_KWARG}=..., passed by posttrain.engine.packing); this call gave none. Call the "
            "model through engine.packing, or load it with attn_implementation='sdpa' for padded inputs"
        )
    if attention_mask is not None:
        raise RuntimeError(
            f"attn_implementation={VARLEN} takes its layout from {SEGMENTS_KWARG}, not from a mask; "
            f"got a mask of shape {tuple(attention_mask.shape)}"
        )
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise RuntimeError(
            f"attn_implementation={VARLEN} implements full causal attention only, not sliding windows or "
            "soft-capping; use attn_implementation=sdpa or eager for this model"
        )
    sp = kwargs.get(SP_KWARG)
    if isinstance(sp, SequenceParallel) and sp.size > 1:
        # Ulysses: this rank's columns of all heads -> all columns of its heads, and back after attending
        heads, kv_heads = query.shape[1], key.shape[1]
        if kv_heads % sp.size:  # too few key/value heads to split: give every query head its own copy
            key, value = repeat_kv(key, heads // kv_heads), repeat_kv(value, heads // kv_heads)
        query, key, value = (seq_to_heads(t, sp) for t in (query, key, value))
        out = _attend_runs(query, key, value, segments, dropout, scaling)
        return heads_to_seq(out, sp).transpose(1, 2).contiguous(), None
    return _attend_runs(query, key, value, segments, dropout, scaling).transpose(1, 2).contiguous(), None


def _attend_runs(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: Segments,
    dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    """(B, H, L, D) attention outputs over rows of width L, one SDPA call per run shape: runs of equal
    length (and equal prefix length) are gathered into a batch, attended together and scattered back, so
    a step of many short sequences costs a few calls per layer rather than one per sequence, and memory
    stays that of the runs (a group's largest tensor is count x n x (c + n) for its mask)."""
    batch, heads, width, dim = query.shape
    if len(segments.rows) != batch:
        raise RuntimeError(f"{SEGMENTS_KWARG} describes {len(segments.rows)} rows, the input has {batch}")
    for b, runs in enumerate(segments.rows):
        if not runs or runs[0].start != 0 or runs[-1].end != width:
            raise RuntimeError(f"{SEGMENTS_KWARG}: the runs of row {b} do not tile its {width} columns")
    groups = heads // key.shape[1]

    def flat(t: torch.Tensor) -> torch.Tensor:  # (B, h, L, D) -> (B * L, h, D)
        return t.transpose(1, 2).reshape(batch * width, t.shape[1], dim)

    def gather(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # (count, len) -> (count, h, len, D)
        return t[index.reshape(-1)].view(*index.shape, t.shape[1], dim).transpose(1, 2)

    plan = segments.plan(width, query.device, heads * dim)
    if plan.dense_mask is not None:  # short rows: one call, cheaper than the groups' fixed costs
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=plan.dense_mask, dropout_p=dropout, scale=scaling,
            **({"enable_gqa": True} if groups > 1 else {}),
        )  # fmt: skip
    q_flat, k_flat, v_flat = flat(query), flat(key), flat(value)
    outputs = []
    for group in plan.groups:
        count, n = group.columns.shape

        q, k, v = gather(q_flat, group.columns), gather(k_flat, group.columns), gather(v_flat, group.columns)
        mask = group.mask
        if group.context is not None:
            k = torch.cat([gather(k_flat, group.context), k], dim=2)
            v = torch.cat([gather(v_flat, group.context), v], dim=2)
        gqa = {}
        if groups > 1:
            # CPU kernels take grouped heads with or without a mask; CUDA's fast kernels only without one
            if mask is None or q.device.type == "cpu":
                gqa = {"enable_gqa": True}
            else:
                k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None, scale=scaling, **gqa
        )
        out = out.transpose(1, 2).reshape(count * n, heads, dim)
        outputs.append(out if group.keep is None else out[group.keep])
    return torch.cat(outputs)[plan.order].view(batch, width, heads, dim).transpose(1, 2)


AttentionInterface.register(VARLEN, varlen_attention_forward)


def uses_varlen(model: nn.Module) -> bool:
    """Whether `model` (plain, peft- or FSDP-wrapped) attends with `posttrain_varlen`."""
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) == VARLEN


def check_varlen_support(model: nn.Module) -> None:
    """Reject a model whose attention does not go through transformers' attention registry: it would never
    call `posttrain_varlen`, and packed rows would attend across sequences. Also sliding-window configs."""
    get_base = getattr(model, "get_base_model", None)  # peft
    base = get_base() if callable(get_base) else model
    if not getattr(type(base), "_supports_attention_backend", False):
        raise ConfigError(
            f"{type(base).__name__} computes attention in its own code, not through transformers' "
            f"AttentionInterface, so posttrain cannot attend per packed segment ({VARLEN}); set "
            "model.attn_implementation=eager (packed rows with an explicit mask) or model.remove_padding=false"
        )
    window = sliding_window(base.config)
    if window is not None:
        raise ConfigError(
            f"{type(base).__name__} attends within a sliding window of {window} tokens, which {VARLEN} (packed "
            "rows under sdpa) does not implement; set model.remove_padding=false (padded rows), or "
            "model.attn_implementation=eager with model.share_prompt=false"
        )


def check_packed_window(model: nn.Module, config: Any, attention: str) -> None:
    """Refuse packed rows that would attend past a sliding window. Shared-prompt layouts hand the model an
    explicit 4-D mask, which transformers passes unchanged to every layer, sliding ones included: a Gemma or
    Mistral-v0.1 model then attended to the whole row, and its log-probs were off by nats once a sequence
    outgrew the window, with no error. Plain packing under eager is right (transformers builds the window
    from the position ids); padded rows are right."""
    window = sliding_window(model.config)
    if window is None or not config.remove_padding or attention == VARLEN:  # VARLEN: check_varlen_support
        return
    if config.share_prompt:
        raise ConfigError(
            f"{type(model).__name__} attends within a sliding window of {window} tokens, which shared-prompt "
            "packing (one explicit mask for every layer) does not keep; set model.share_prompt=false, or "
            "model.remove_padding=false"
        )
