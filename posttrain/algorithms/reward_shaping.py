"""Reward shaping and batch filtering from DAPO (Yu et al. 2025): overlong penalty, dynamic-sampling filter.

Pure tensor functions on per-sequence values (B,); the caller adds the penalty to the scores and keeps the
rows the filter selects. Must not import engine, rollout, workers, Ray or data.batch.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import torch

from posttrain.errors import ConfigError


def overlong_penalty(
    response_lengths: torch.Tensor,
    max_response_length: int,
    buffer_length: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO's soft overlong punishment (B,): 0 up to max - buffer, then a linear ramp down to -penalty_factor.

    With L the response length and E = max_response_length - buffer_length:

        penalty = 0                                                 if L <= E
        penalty = max(-(L - E) / buffer_length * penalty_factor, -penalty_factor)   otherwise

    so a response that fills the whole budget (L = max_response_length) gets -penalty_factor, and a
    truncated one cannot get less. Raises ConfigError unless 0 < buffer_length <= max_response_length and
    penalty_factor >= 0.
    """
    if max_response_length <= 0:
        raise ConfigError(f"overlong penalty: max_response_length must be > 0, got {max_response_length}")
    if not 0 < buffer_length <= max_response_length:
        raise ConfigError(
            f"overlong penalty: buffer_length must be in (0, max_response_length={max_response_length}], "
            f"got {buffer_length}"
        )
    if penalty_factor < 0:
        raise ConfigError(f"overlong penalty: penalty_factor must be >= 0, got {penalty_factor}")
    lengths = torch.as_tensor(response_lengths).to(torch.get_default_dtype())
    exceed = (lengths - (max_response_length - buffer_length)).clamp(min=0.0)
    return (-exceed / buffer_length * penalty_factor).clamp(min=-penalty_factor)


def groups_with_reward_variance(
    group_ids: Sequence[Hashable] | np.ndarray | torch.Tensor, scores: torch.Tensor
) -> torch.Tensor:
    """Bool (B,): True for rows whose group's scores are not all equal (DAPO dynamic sampling keeps these).

    A group whose samples all got the same score has zero advantage under any group baseline and so no
    gradient; a group of one sample has no variance either. `group_ids` holds one hashable id per row (the
    `uid` of its prompt).
    """
    if isinstance(group_ids, torch.Tensor):
        group_ids = group_ids.tolist()
    if len(group_ids) != scores.shape[0]:
        raise ValueError(f"group_ids has {len(group_ids)} entries for {scores.shape[0]} scores")
    dense: dict[Hashable, int] = {}
    index = torch.tensor([dense.setdefault(g, len(dense)) for g in group_ids], dtype=torch.long)
    index = index.to(scores.device)
    n_groups = len(dense)
    scores = scores.detach()
    if not scores.is_floating_point():
        scores = scores.double()
    lowest = scores.new_full((n_groups,), float("inf")).scatter_reduce(0, index, scores, reduce="amin")
    highest = scores.new_full((n_groups,), float("-inf")).scatter_reduce(0, index, scores, reduce="amax")
    return (highest > lowest)[index]
