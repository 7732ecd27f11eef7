"""Built-in rule-based scorers, looked up by a dataset row's `data_source`.

A scorer has verl's per-source signature `fn(solution_str, ground_truth, extra_info=None, **kwargs)` and
returns a float or a dict with a "score" key and any extra per-row values. `default_compute_score` has
verl's `compute_score(data_source, solution_str, ground_truth, extra_info)` signature, so a user's own
verl reward function is a drop-in replacement for it.

Pure: no I/O. Reuses the algorithms' generic `Registry` (pure too) with `RewardError`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from posttrain.algorithms.registry import Registry
from posttrain.errors import RewardError

Scorer = Callable[..., float | dict[str, Any]]

SCORERS: Registry[Scorer] = Registry("data_source", error=RewardError)


def register_scorer(*data_sources: str) -> Callable[[Scorer], Scorer]:
    """Decorator registering a scorer for one or more data_source names (a duplicate name is an error)."""
    if not data_sources:
        raise RewardError("register_scorer needs at least one data_source name")
    return SCORERS.register(*data_sources)


def get_scorer(data_source: str) -> Scorer:
    """The built-in scorer for `data_source`; RewardError listing the known data sources otherwise."""
    return SCORERS.get(data_source)


def default_compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> float | dict[str, Any]:
    """Score one response with the built-in scorer of its data_source (verl's `compute_score` signature).

    `kwargs` are scorer options (e.g. `method="flexible"` for gsm8k).
    """
    return get_scorer(data_source)(solution_str, ground_truth, extra_info=extra_info, **kwargs)
