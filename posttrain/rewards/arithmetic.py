"""Scorer for the built-in "arithmetic" and "long_addition" tasks: the last integer in the response must equal
the answer.

Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from posttrain.errors import RewardError
from posttrain.rewards.registry import register_scorer

# A signed number, with optional thousands separators and decimals. Decimals are matched (not skipped) so
# that "3.5" does not read as the integer 5; an integral decimal such as "19.0" counts as 19.
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def extract_last_integer(text: str) -> int | None:
    """The last number in `text` if it is an integer (commas removed, "19.0" -> 19), else None. Read exactly
    (never through a float, which holds every integer only up to 2**53: long_addition's 20-digit sums would
    score a correct answer 0 and a nearby wrong one 1)."""
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    whole, _, fraction = matches[-1].replace(",", "").partition(".")
    if fraction.strip("0"):
        return None
    return int(whole)


# long_addition's worked solution ends "answer <sum>"; tool_multiplication's answer "The answer is <product>."
@register_scorer("arithmetic", "long_addition", "tool_multiplication")
def compute_score(solution_str: str, ground_truth: Any, extra_info: Mapping[str, Any] | None = None) -> float:
    """1.0 if the last integer in the response equals the integer ground truth, else 0.0."""
    try:
        expected = int(str(ground_truth).strip())
    except ValueError:
        raise RewardError(f"arithmetic ground truth is not an integer: {ground_truth!r}") from None
    return 1.0 if extract_last_integer(solution_str) == expected else 0.0
