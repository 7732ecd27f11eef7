"""Preference pairs from the arithmetic task: for one problem, the right answer (chosen) and a wrong one (rejected).

Rows are in TRL's columns as chat messages (`prompt`: the user question as the RL task asks it; `chosen` /
`rejected`: one assistant message each), so `posttrain dpo` and `posttrain rm` read them, and a reward model
trained on them sees the same rendering as when it scores a policy's answers in RL. Wrong answers are the
slips a small model makes: the last digit off (1-9), a carry dropped or added (+-10), or further off
(+-11..99); never negative. Optionally also every near slip of given sizes (`near_slips`: the answer +- each
size), the hard negatives a policy's own mistakes sit among. Train and test problems are disjoint
(arithmetic.sample_problems). Must not import engine, rollout, worker, Ray or model code.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from posttrain.data.tasks.arithmetic import DATA_SOURCE, prompt_text, sample_problems, write_splits

# kinds of wrong answers and how often each is drawn
SLIPS = {"last_digit": 0.5, "carry": 0.3, "far": 0.2}


def wrong_answer(rng: np.random.Generator, answer: int) -> int:
    """A plausible wrong answer to a problem whose answer is `answer` (>= 0, != answer)."""
    kinds = list(SLIPS)
    for _ in range(100):
        kind = kinds[int(rng.choice(len(kinds), p=list(SLIPS.values())))]
        size = {"last_digit": rng.integers(1, 10), "carry": 10, "far": rng.integers(11, 100)}[kind]
        wrong = answer + int(size) * (1 if rng.random() < 0.5 else -1)
        if wrong >= 0 and wrong != answer:
            return wrong
    return answer + 1


def wrong_answers(rng: np.random.Generator, answer: int, count: int) -> list[int]:
    """`count` distinct wrong answers (see `wrong_answer`) to a problem whose answer is `answer`."""
    found: list[int] = []
    while len(found) < count:
        wrong = wrong_answer(rng, answer)
        if wrong not in found:
            found.append(wrong)
    return found


def near_answers(answer: int, sizes: Sequence[int], exclude: Sequence[int] = ()) -> list[int]:
    """answer + size and answer - size for each size (>= 1), in that order: those >= 0 and not in `exclude`."""
    found: list[int] = []
    for size in sizes:
        for wrong in (answer + size, answer - size):
            if wrong >= 0 and wrong not in found and wrong not in exclude:
                found.append(wrong)
    return found


def pair_row(question: str, answer: str, wrong: str, split: str, index: int) -> dict:
    return {
        "prompt": [{"role": "user", "content": prompt_text(question)}],
        "chosen": [{"role": "assistant", "content": answer}],
        "rejected": [{"role": "assistant", "content": wrong}],
        "data_source": DATA_SOURCE,
        "extra_info": {"split": split, "index": index, "question": question, "answer": answer},
    }


def write_arithmetic_pairs(
    out_dir: str | Path,
    n_train: int = 2000,
    n_test: int = 256,
    min_digits: int = 1,
    max_digits: int = 2,
    ops: Sequence[str] = ("+",),
    seed: int = 0,
    rejected_per_problem: int = 1,
    near_slips: Sequence[int] = (),
) -> dict[str, Path]:
    """`train.parquet` and `test.parquet` of preference pairs (disjoint problems) in `out_dir`; {split: path}.

    Each problem gives `rejected_per_problem` pairs, one per distinct wrong answer: more pairs per problem show
    a reward model many slips of one sum (it must learn to check the sum, not to recall one wrong answer). The
    problems (and so the split) depend only on `seed` and the sizes, not on `rejected_per_problem`.

    `near_slips` adds, after a problem's sampled wrong answers, one pair per near answer (`near_answers`: the
    answer +- each size, skipping negatives and answers already drawn); the sampled ones stay as without it."""
    if rejected_per_problem < 1:
        raise ValueError(f"rejected_per_problem must be >= 1, got {rejected_per_problem}")
    if any(int(size) != size or size < 1 for size in near_slips):
        raise ValueError(f"near_slips must be whole numbers >= 1, got {list(near_slips)}")
    rng = np.random.default_rng(seed)
    problems = sample_problems(n_train + n_test, rng, min_digits, max_digits, tuple(ops))
    triples, n_train_pairs = [], 0
    for k, (q, a) in enumerate(problems):
        sampled = wrong_answers(rng, int(a), rejected_per_problem)
        wrongs = sampled + near_answers(int(a), [int(size) for size in near_slips], sampled)
        triples += [(q, a, str(w)) for w in wrongs]
        if k == n_train - 1:
            n_train_pairs = len(triples)
    return write_splits(out_dir, triples, n_train_pairs, lambda t, split, i: pair_row(*t, split, i))
