"""Splitting sequences by length: token-budget bins and balanced partitions across data-parallel ranks.

Pure functions over lists of lengths, returning lists of row indices; no tensors, no I/O.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from posttrain.errors import ConfigError


def first_fit_decreasing(
    lengths: Sequence[int], capacity: int, labels: Sequence[int] | None = None
) -> list[list[int]]:
    """Bins of row indices whose lengths sum to at most `capacity`, few bins (first-fit decreasing).

    Every index appears in exactly one bin. A row longer than `capacity` is an error naming both. With
    `labels`, a bin holds rows of one label only (the LoRA adapters of a shared pass: a tenant's rows never
    share a packed row, and so an attention, with another's, whose NaN would reach them through it).
    """
    if lengths and max(lengths) > capacity:
        raise ConfigError(
            f"a sequence of {max(lengths)} tokens exceeds the token budget of {capacity}; "
            "raise the budget (max_token_len_per_worker) to at least the longest prompt + response"
        )
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for b, free in enumerate(room):
            if lengths[i] <= free and (labels is None or labels[bins[b][0]] == labels[i]):
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def split_to_count(bins: list[list[int]], lengths: Sequence[int], count: int) -> list[list[int]]:
    """Split the heaviest multi-row bins in two until there are `count` bins (splitting keeps any budget).

    Needed so every data-parallel rank runs the same number of micro-batches (FSDP collectives pair up).
    """
    bins = [list(b) for b in bins]
    if count > sum(len(b) for b in bins):
        raise ValueError(f"cannot form {count} non-empty bins from {sum(len(b) for b in bins)} rows")
    while len(bins) < count:
        splittable = [b for b in bins if len(b) > 1]
        heaviest = max(splittable, key=lambda b: sum(lengths[i] for i in b))
        bins.remove(heaviest)
        half = len(heaviest) // 2
        bins += [heaviest[:half], heaviest[half:]]
    return bins


def balanced_partition(lengths: Sequence[int], parts: int) -> list[list[int]]:
    """`parts` groups of equal row count (sizes differ by at most one) with near-equal length sums.

    The largest differencing method of Karmarkar and Karp, generalised to k-way partitions: rows are taken
    in descending length, `parts` at a time, each such slice being a partial solution with one row per
    group; the two partial solutions with the largest spread are merged repeatedly, pairing the heaviest
    group of one with the lightest of the other. Each merge adds one slice to every group, so group sizes
    stay equal.
    """
    if parts <= 0:
        raise ValueError(f"parts must be positive, got {parts}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    # a partial solution: `parts` groups, each (sum, rows), kept sorted by sum descending
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for n, start in enumerate(range(0, len(order), parts)):
        rows = order[start : start + parts]
        groups = [(lengths[i], [i]) for i in rows] + [(0, []) for _ in range(parts - len(rows))]
        groups.sort(key=lambda g: -g[0])
        heapq.heappush(heap, (-(groups[0][0] - groups[-1][0]), n, groups))
    if not heap:
        return [[] for _ in range(parts)]
    tiebreak = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(sa + sb, ra + rb) for (sa, ra), (sb, rb) in zip(a, reversed(b), strict=True)]
        merged.sort(key=lambda g: -g[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tiebreak, merged))
        tiebreak += 1
    return [sorted(rows) for _, rows in heap[0][2]]


def trimmed_width(bins: list[list[int]], lengths: list[int], width: int) -> int:
    """The width rows need: the fullest row's tokens (rows share one width, so a row never needs more), at
    most `width`. Computing filler costs as much as real tokens, and with one small request all of a row of
    `row_tokens` but its own tokens would be filler."""
    used = max((sum(lengths[i] for i in members) for members in bins), default=0)
    return min(width, used) if used else width
