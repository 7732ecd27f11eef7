"""Ulysses sequence parallelism: each packed row split across the `sp` ranks of a sequence-parallel group.

World = dp x sp on a 2-D device mesh ("dp", "sp"). The sp ranks of a group receive the same micro-batch;
each packs it identically and keeps one contiguous slice of every packed row's columns. Embeddings, MLPs,
norms and the LM head run on the local slice; attention (`varlen_attention`, `posttrain_varlen`) swaps
the sequence split for a head split with one all-to-all on q, k and v, attends per segment over the full
row for its H/sp heads, and swaps back with another (DeepSpeed-Ulysses). Activation memory per rank is
then ~1/sp of the row's, while every token sees exactly its own sequence's context.

Layout rules:
- a packed row of width W is padded to W' = sp * ceil(W / sp) with filler tokens (id 0) that form their
  own causal run (positions 0, 1, ...), so they attend to and are attended by nothing real; rank r holds
  columns [r W'/sp, (r+1) W'/sp) of every row;
- position ids are sliced with the columns (rotary embeddings stay exact), segments describe the full row;
- the LM head runs on each rank's kept positions only; their logits are gathered to every rank of the
  group in the caller's order, so log-probs, entropy and the loss are computed identically on all sp ranks.
  The gather's backward keeps each rank's own part of the (identical) gradient; the engine scales the loss
  by sp before backward, so FSDP's mean over all dp x sp ranks is a sum over the sp ranks of a group and
  a mean over dp groups: the unsliced gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from posttrain.errors import ConfigError


@dataclass(frozen=True)
class SequenceParallel:
    """This rank's sequence-parallel group: its size and this rank's index in it."""

    group: Any  # torch.distributed.ProcessGroup
    size: int
    rank: int


def check_sequence_parallel(
    sp: int, world_size: int, heads: int, attn_implementation: str, remove_padding: bool
) -> None:
    """Reject, naming the setting, what Ulysses sequence parallelism cannot do."""
    if sp < 1:
        raise ConfigError(f"model.sequence_parallel_size must be >= 1, got {sp}")
    if sp == 1:
        return
    if world_size % sp:
        raise ConfigError(
            f"model.sequence_parallel_size={sp} must divide the ranks of the role ({world_size}): world = dp x sp"
        )
    if heads % sp:
        raise ConfigError(
            f"model.sequence_parallel_size={sp} must divide the model's {heads} attention heads: each rank "
            "attends with heads / sp of them"
        )
    if not remove_padding or attn_implementation != "sdpa":
        raise ConfigError(
            "model.sequence_parallel_size > 1 splits packed rows and wraps the per-segment sdpa attention "
            "(posttrain_varlen): it needs model.remove_padding=true and model.attn_implementation=sdpa, not "
            f"remove_padding={str(remove_padding).lower()}, attn_implementation={attn_implementation}"
        )


def _all_to_all(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """Chunk i of dim 0 goes to rank i; chunk i of the result came from rank i."""
    x = x.contiguous()
    out = torch.empty_like(x)  # contiguous too (empty_like keeps a permuted input's strides)
    dist.all_to_all_single(out, x, group=sp.group)
    return out


def _seq_to_heads(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """(B, H, S/sp, D) local columns, all heads -> (B, H/sp, S, D) all columns, this rank's heads."""
    b, h, s, d = x.shape
    n = sp.size
    chunks = x.reshape(b, n, h // n, s, d).transpose(0, 1)  # chunk j: heads of rank j
    out = _all_to_all(chunks, sp)  # out[i]: my heads over rank i's columns
    return out.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _heads_to_seq(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """(B, H/sp, S, D) this rank's heads -> (B, H, S/sp, D) this rank's columns, all heads."""
    b, hn, s, d = x.shape
    n = sp.size
    chunks = x.reshape(b, hn, n, s // n, d).permute(2, 0, 1, 3, 4)  # chunk j: columns of rank j
    out = _all_to_all(chunks, sp)  # out[i]: rank i's heads over my columns
    return out.transpose(0, 1).reshape(b, n * hn, s // n, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
        ctx.sp = sp
        return _seq_to_heads(x, sp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _heads_to_seq(grad, ctx.sp), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
        ctx.sp = sp
        return _heads_to_seq(x, sp)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _seq_to_heads(grad, ctx.sp), None


def seq_to_heads(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    return _SeqToHeads.apply(x, sp)


def heads_to_seq(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    return _HeadsToSeq.apply(x, sp)


class _GatherRows(torch.autograd.Function):
    """Every rank's (n_r, ...) rows, concatenated in rank order, on every rank. What follows is computed
    identically on all ranks of the group, so the backward keeps this rank's own rows of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sp: SequenceParallel, counts: list[int]) -> torch.Tensor:
        ctx.sp, ctx.counts = sp, counts
        longest = max(counts)
        padded = x.new_zeros((longest, *x.shape[1:]))
        padded[: x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(sp.size)]
        dist.all_gather(parts, padded.contiguous(), group=sp.group)
        return torch.cat([part[:n] for part, n in zip(parts, counts, strict=True)])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        start = sum(ctx.counts[: ctx.sp.rank])
        return grad[start : start + ctx.counts[ctx.sp.rank]], None, None


def gather_rows(x: torch.Tensor, sp: SequenceParallel, counts: list[int]) -> torch.Tensor:
    return _GatherRows.apply(x, sp, counts)


class _SumOverGroup(torch.autograd.Function):
    """The sum of every rank's `x` on every rank. As with `_GatherRows`, what follows is computed identically
    on all ranks, so the backward passes the gradient through unchanged: each rank's own term of the sum
    gets it once, and the engine's sum over the sp ranks adds the terms up (a summing backward, as
    torch.distributed.nn's all_reduce has, would count the gradient sp times)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
        out = x.detach().clone().contiguous()
        dist.all_reduce(out, group=sp.group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def sum_over_group(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """`x` summed over the ranks of `sp`'s group (all-reduce), the same value on each rank. The backward is the
    identity: every rank computes the same loss from the sum, so each rank's own `x` receives the gradient of
    that loss once; summing the gradients over the group as well would count it sp times."""
    return _SumOverGroup.apply(x, sp)


@dataclass(frozen=True)
class SlicedRows:
    """Packed rows padded to a multiple of sp and cut to this rank's columns."""

    input_ids: torch.Tensor  # (rows, W'/sp) this rank's columns
    position_ids: torch.Tensor  # (rows, W'/sp)
    full_position_ids: torch.Tensor  # (rows, W') the padded rows' position ids (for their segments)
    width: int  # W, before padding
    padded_width: int  # W'
    start: int  # this rank's first column


def slice_rows(input_ids: torch.Tensor, position_ids: torch.Tensor, sp: SequenceParallel) -> SlicedRows:
    """Pad rows to a multiple of sp with a filler run (id 0, positions from 0) and keep this rank's columns."""
    rows, width = input_ids.shape
    padded = -(-width // sp.size) * sp.size
    pad = padded - width
    if pad:
        input_ids = torch.cat([input_ids, input_ids.new_zeros((rows, pad))], 1)
        filler = torch.arange(pad, device=position_ids.device, dtype=position_ids.dtype)
        position_ids = torch.cat([position_ids, filler.expand(rows, pad)], 1)
    local = padded // sp.size
    start = sp.rank * local
    columns = slice(start, start + local)
    return SlicedRows(input_ids[:, columns], position_ids[:, columns], position_ids, width, padded, start)


def kept_on_ranks(
    keep: torch.Tensor, sliced: SlicedRows, sp: SequenceParallel
) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """For flat positions `keep` of the unpadded rows: (this rank's local flat indices of the ones it holds,
    how many each rank holds, the index that puts the rank-ordered gather back into `keep`'s order)."""
    local = sliced.padded_width // sp.size
    local_flat = local_positions(keep, sliced.width, local, sp)  # this rank's columns start at rank x local
    owner = keep % sliced.width // local
    counts = torch.bincount(owner, minlength=sp.size).tolist()
    order = torch.argsort(owner, stable=True)  # rank order, `keep` order within a rank
    return local_flat, counts, torch.argsort(order)


def local_positions(
    positions: torch.Tensor, width: int, local_width: int, sp: SequenceParallel
) -> torch.Tensor:
    """Of flat `positions` over rows of width `width` (before padding), the ones this rank holds, as flat
    indices over its (rows, local_width) slice of the columns (`slice_rows`), in `positions`' order."""
    row, col = positions // width, positions % width
    mine = col // local_width == sp.rank
    return row[mine] * local_width + (col[mine] - sp.rank * local_width)
