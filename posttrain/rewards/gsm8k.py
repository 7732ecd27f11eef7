"""Scorer for GSM8K (data_source "openai/gsm8k" or "gsm8k"), compatible with verl's rule.

Two extraction methods, as verl:
* "strict": the last "#### <number>" (the dataset's own answer format, so it also rewards the format);
* "flexible": the last number anywhere in the response.

Unlike verl, which compares strings, answers are compared as numbers after removing commas and `$`
("72" == "72.0" == "$72", "1,234" == "1234", and "72." at the end of a sentence reads as 72), so a correct
answer is not lost to formatting.
Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

from posttrain.errors import ConfigError, RewardError
from posttrain.rewards.registry import register_scorer

# Only the tail of a response is searched. The final answer is at the end, and long degenerate outputs
# (thousands of repeated tokens, common early in RL) would otherwise make the regex cost grow with the
# response for every row of every step. 300 characters is verl's choice; a number cut at the boundary can
# only matter if 300 characters follow the final answer.
SOLUTION_CLIP_CHARS = 300

# A signed number with optional thousands separators and decimals ("1,234.50", "-3", "72", ".5").
_NUMBER = r"-?(?:\d[\d,]*(?:\.\d+)?|\.\d+)"
_STRICT = re.compile(r"####\s*\$?\s*(" + _NUMBER + r")")
_FLEXIBLE = re.compile(_NUMBER)
METHODS = ("strict", "flexible")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The answer string (commas and `$` removed) found by `method`, or None if there is none."""
    if method not in METHODS:
        raise ConfigError(f"unknown gsm8k method {method!r}; valid: {', '.join(METHODS)}")
    tail = solution_str[-SOLUTION_CLIP_CHARS:]
    pattern = _STRICT if method == "strict" else _FLEXIBLE
    matches = pattern.findall(tail)
    if not matches:
        return None
    return matches[-1].replace(",", "").replace("$", "")


def _to_number(text: str) -> Decimal | None:
    """The number `text` writes, exactly ("72" == "72.0" == "$72"; 1000000001 != 1000000000, which floats
    compared with a relative tolerance would call equal)."""
    try:
        value = Decimal(text.replace(",", "").replace("$", "").strip())
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


@register_scorer("openai/gsm8k", "gsm8k")
def compute_score(
    solution_str: str,
    ground_truth: Any,
    extra_info: Mapping[str, Any] | None = None,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """`score` if the extracted answer equals the ground truth numerically, `format_score` if an answer was
    found but is wrong, 0.0 if none was found."""
    answer = extract_solution(solution_str, method)
    expected = _to_number(str(ground_truth))
    if expected is None:
        raise RewardError(f"gsm8k ground truth is not a number: {ground_truth!r}")
    if answer is None:
        return 0.0
    value = _to_number(answer)
    if value is not None and value == expected:
        return score
    return format_score
