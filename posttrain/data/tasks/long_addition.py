"""Built-in task with naturally long responses: multi-digit addition with every column and carry written out.

    question  "Add 4738+2961 column by column."
    solution  "8+1=9\n3+6=9\n7+9=16 carry 1\n4+2+1=7\nanswer 7699"

A correct response works the sum from the rightmost column to the left, one line per column (the two digits,
the carry when there is one, their sum, and " carry 1" when it overflows), then the answer. Its length grows
with the digits (about 7-12 tokens a column with a 1024-token BPE trained on these texts), so the default
7-11 digit operands give responses of 50-150 tokens, without any ignore-EOS trick: the model has to get to the end and stop.
The digit count is uniform in [min_digits, max_digits]; `tail_prob` > 0 draws it, that often, from
(max_digits, tail_digits] instead, a long tail of longer responses (for asynchronous RL and agent tests, whose
point is that some responses take much longer than others).

The rows are verl's format (the arithmetic task's), with `extra_info.solution` holding the worked solution
(an SFT warm-up target and tokenizer corpus); the reward is the arithmetic scorer's: the last integer of
the response must be the sum (`rewards/arithmetic.py`, registered here under this task's data source).
Must not import engine, rollout, worker, Ray or model code.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from posttrain.data.tasks.arithmetic import write_splits
from posttrain.errors import DataError

DATA_SOURCE = "long_addition"


def prompt_text(a: int, b: int) -> str:
    return f"Add {a}+{b} column by column."


def worked_solution(a: int, b: int) -> str:
    """Every column from the right: digits (+ carry) = sum (" carry 1" on overflow); then the answer."""
    da, db = str(a)[::-1], str(b)[::-1]
    lines, carry = [], 0
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        total = x + y + carry
        terms = f"{x}+{y}" + (f"+{carry}" if carry else "")
        carry = total // 10
        lines.append(f"{terms}={total}" + (" carry 1" if carry else ""))
    lines.append(f"answer {a + b}")
    return "\n".join(lines)


def _check(min_digits: int, max_digits: int, tail_prob: float, tail_digits: int) -> None:
    if not 1 <= min_digits <= max_digits:
        raise DataError(f"long_addition: need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
    if not 0.0 <= tail_prob <= 1.0:
        raise DataError(f"long_addition: tail_prob must be in [0, 1], got {tail_prob}")
    if tail_prob > 0 and tail_digits <= max_digits:
        raise DataError(
            f"long_addition: a long tail needs tail_digits > max_digits ({tail_digits} <= {max_digits})"
        )


def _digits(rng: np.random.Generator, min_d: int, max_d: int, tail_prob: float, tail_d: int) -> int:
    if tail_prob > 0 and rng.random() < tail_prob:
        return int(rng.integers(max_d + 1, tail_d + 1))
    return int(rng.integers(min_d, max_d + 1))


def _number(rng: np.random.Generator, digits: int) -> int:
    """A number of exactly `digits` digits (leading digit 1-9, 0 allowed for one digit), drawn digit by
    digit so that 20-digit numbers do not overflow a 64-bit integer draw."""
    if digits == 1:
        return int(rng.integers(0, 10))
    rest = "".join(str(d) for d in rng.integers(0, 10, digits - 1))
    return int(str(int(rng.integers(1, 10))) + rest)


def make_problem(
    rng: np.random.Generator,
    min_digits: int = 7,
    max_digits: int = 11,
    tail_prob: float = 0.0,
    tail_digits: int = 0,
) -> tuple[int, int]:
    """Two operands; both have the drawn digit count (so every column has two digits to add)."""
    _check(min_digits, max_digits, tail_prob, tail_digits)
    digits = _digits(rng, min_digits, max_digits, tail_prob, tail_digits)
    return _number(rng, digits), _number(rng, digits)


def _row(a: int, b: int, split: str, index: int) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": prompt_text(a, b)}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {
            "split": split,
            "index": index,
            "question": f"{a}+{b}",
            "answer": str(a + b),
            "solution": worked_solution(a, b),
        },
    }


def write_long_addition_dataset(
    out_dir: str | Path,
    n_train: int = 10_000,
    n_test: int = 500,
    min_digits: int = 7,
    max_digits: int = 11,
    tail_prob: float = 0.0,
    tail_digits: int = 0,
    seed: int = 0,
) -> dict[str, Path]:
    """Write `train.parquet` and `test.parquet` (no problem in both; a+b and b+a count as one)."""
    rng = np.random.default_rng(seed)
    seen: set[tuple[int, int]] = set()
    problems: list[tuple[int, int]] = []
    for _ in range(50 * (n_train + n_test) + 10_000):
        if len(problems) == n_train + n_test:
            break
        a, b = make_problem(rng, min_digits, max_digits, tail_prob, tail_digits)
        if (min(a, b), max(a, b)) not in seen:
            seen.add((min(a, b), max(a, b)))
            problems.append((a, b))
    if len(problems) < n_train + n_test:
        raise DataError(f"long_addition: only {len(problems)} distinct problems found; allow more digits")
    return write_splits(out_dir, problems, n_train, lambda p, split, i: _row(*p, split, i))


def corpus(n: int, seed: int = 0, min_digits: int = 1, max_digits: int = 20) -> list[str]:
    """`n` prompt + worked-solution texts, for training a tokenizer that knows this task's pieces."""
    rng = np.random.default_rng(seed)
    texts = []
    for _ in range(n):
        a, b = make_problem(rng, min_digits, max_digits)
        texts.append(f"{prompt_text(a, b)} {worked_solution(a, b)}")
    return texts
