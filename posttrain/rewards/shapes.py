"""Scorer for the built-in visual task "shapes" (posttrain/data/tasks/shapes.py): a count question's answer is
the last integer in the response, a colour question's the last colour name (a whole word, any case).

Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from posttrain.data.tasks.shapes import COLORS, DATA_SOURCE
from posttrain.errors import RewardError
from posttrain.rewards.arithmetic import extract_last_integer
from posttrain.rewards.registry import register_scorer

_WORD = re.compile(r"[a-z]+")


def last_color(text: str) -> str | None:
    """The last of the task's colour names that appears as a whole word in `text` (lower-cased), else None."""
    found = [w for w in _WORD.findall(text.lower()) if w in COLORS]
    return found[-1] if found else None


@register_scorer(DATA_SOURCE)
def compute_score(solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> float:
    """1.0 if the response answers the shapes question, else 0.0: for an integer ground truth (count) the
    last integer in the response equals it; for a colour ground truth the last colour name equals it."""
    truth = str(ground_truth).strip().lower()
    try:
        count = int(truth)
    except ValueError:
        if truth not in COLORS:
            raise RewardError(
                f"shapes ground truth {ground_truth!r} is neither an integer count nor one of the colours "
                f"{', '.join(COLORS)}"
            ) from None
        return 1.0 if last_color(solution_str) == truth else 0.0
    return 1.0 if extract_last_integer(solution_str) == count else 0.0
