"""Built-in task: multi-digit arithmetic ("What is 47+385?" -> "432"), small enough for a tiny model on CPU.

Writes verl-format parquet with train and test problems disjoint (a+b and b+a count as the same
problem). Must not import engine, rollout, worker, Ray or model code.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from posttrain.errors import DataError

DATA_SOURCE = "arithmetic"
OPS: dict[str, Callable[[int, int], int]] = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_COMMUTATIVE = {"+", "*"}


def _check_args(min_digits: int, max_digits: int, ops: Sequence[str]) -> None:
    if not 1 <= min_digits <= max_digits:
        raise DataError(f"arithmetic: need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
    unknown = [op for op in ops if op not in OPS]
    if not ops or unknown:
        raise DataError(f"arithmetic: ops must be a non-empty subset of {list(OPS)}, got {list(ops)}")


def _operand(rng: np.random.Generator, min_digits: int, max_digits: int) -> int:
    """A number whose digit count is uniform in [min_digits, max_digits] (1 digit includes 0)."""
    digits = int(rng.integers(min_digits, max_digits + 1))
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return int(rng.integers(low, 10**digits))


def make_problem(
    rng: np.random.Generator, min_digits: int = 1, max_digits: int = 3, ops: Sequence[str] = ("+",)
) -> tuple[str, str]:
    """(question, answer), e.g. ("47+385", "432"). Subtraction puts the larger operand first so
    answers are never negative (a minus sign is one more thing for a tiny model to learn)."""
    _check_args(min_digits, max_digits, ops)
    op = ops[int(rng.integers(len(ops)))]
    a, b = _operand(rng, min_digits, max_digits), _operand(rng, min_digits, max_digits)
    if op == "-" and a < b:
        a, b = b, a
    return f"{a}{op}{b}", str(OPS[op](a, b))


def prompt_text(question: str) -> str:
    """The user message for a question."""
    return f"What is {question}?"


def _problem_key(question: str) -> tuple:
    """Identity used for train/test disjointness: commutative ops ignore operand order."""
    for op in OPS:
        left, sep, right = question.partition(op)
        if sep and left and right:
            operands = (left, right) if op not in _COMMUTATIVE else tuple(sorted((left, right)))
            return (op, *operands)
    raise ValueError(f"not an arithmetic question: {question!r}")


def _n_distinct(min_digits: int, max_digits: int, ops: Sequence[str]) -> int:
    """A lower bound on the distinct problems available (commutative pairs counted once)."""
    n = 10**max_digits - (0 if min_digits == 1 else 10 ** (min_digits - 1))
    return len(set(ops)) * n * (n + 1) // 2


def sample_problems(
    n: int, rng: np.random.Generator, min_digits: int, max_digits: int, ops: Sequence[str]
) -> list[tuple[str, str]]:
    """`n` distinct problems; asking for more than half of all problems is refused (sampling would crawl)."""
    _check_args(min_digits, max_digits, ops)
    available = _n_distinct(min_digits, max_digits, ops)
    if n > available // 2:
        raise DataError(
            f"arithmetic: {n} distinct problems requested but only about {available} exist with "
            f"digits {min_digits}..{max_digits} and ops {list(ops)}; ask for fewer or allow more digits"
        )
    seen: set[tuple] = set()
    problems: list[tuple[str, str]] = []
    for _ in range(50 * n + 10_000):
        if len(problems) == n:
            break
        question, answer = make_problem(rng, min_digits, max_digits, ops)
        key = _problem_key(question)
        if key not in seen:
            seen.add(key)
            problems.append((question, answer))
    if len(problems) < n:
        raise DataError(f"arithmetic: found only {len(problems)} of {n} distinct problems; allow more digits")
    return problems


def _row(question: str, answer: str, split: str, index: int) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": prompt_text(question)}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index, "question": question, "answer": answer},
    }


def write_arithmetic_dataset(
    out_dir: str | Path,
    n_train: int = 10_000,
    n_test: int = 500,
    min_digits: int = 1,
    max_digits: int = 3,
    ops: Sequence[str] = ("+",),
    seed: int = 0,
) -> dict[str, Path]:
    """Write `train.parquet` and `test.parquet` (disjoint problems) to `out_dir`; returns {split: path}."""
    rng = np.random.default_rng(seed)
    problems = sample_problems(n_train + n_test, rng, min_digits, max_digits, tuple(ops))
    return write_splits(out_dir, problems, n_train, lambda p, split, i: _row(*p, split, i))


def write_splits(
    out_dir: str | Path, problems: Sequence[Any], n_train: int, row: Callable[[Any, str, int], dict]
) -> dict[str, Path]:
    """`train.parquet` (the first `n_train` problems) and `test.parquet` (the rest) in `out_dir`, each
    problem made a verl-format row by `row(problem, split, index)`; returns {split: path}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, chunk in (("train", problems[:n_train]), ("test", problems[n_train:])):
        rows = [row(problem, split, i) for i, problem in enumerate(chunk)]
        paths[split] = out / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), paths[split])
    return paths


def corpus(n: int, seed: int = 0, max_digits: int = 3, ops: Sequence[str] = ("+", "-", "*")) -> list[str]:
    """`n` sample texts (a question and its answer, as the prompt and response read) for training a tokenizer."""
    rng = np.random.default_rng(seed)
    texts = []
    for _ in range(n):
        question, answer = make_problem(rng, 1, max_digits, ops)
        texts.append(f"{prompt_text(question)} {answer}")
    return texts
