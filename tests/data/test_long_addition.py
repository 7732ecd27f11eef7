"""The long-response task: worked solutions checked by hand, lengths in the promised range with a tokenizer
trained on its texts, a long tail that is really longer, disjoint splits, and the scorer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from posttrain.data.tasks import write_task
from posttrain.data.tasks.long_addition import corpus, make_problem, worked_solution
from posttrain.errors import DataError
from posttrain.models.tokenizer import train_tokenizer
from posttrain.rewards import get_scorer


def test_worked_solution_by_hand() -> None:
    assert worked_solution(4738, 2961) == "8+1=9\n3+6=9\n7+9=16 carry 1\n4+2+1=7\nanswer 7699"
    assert worked_solution(95, 7) == "5+7=12 carry 1\n9+0+1=10 carry 1\nanswer 102"
    assert worked_solution(0, 0) == "0+0=0\nanswer 0"


def test_operands_have_the_drawn_digit_count_and_the_tail_is_longer() -> None:
    rng = np.random.default_rng(0)
    body = [make_problem(rng, 8, 16) for _ in range(300)]
    assert {len(str(a)) for a, _ in body} == set(range(8, 17))
    assert all(len(str(a)) == len(str(b)) for a, b in body)
    tail = [make_problem(rng, 8, 16, tail_prob=0.5, tail_digits=40) for _ in range(300)]
    long = [a for a, _ in tail if len(str(a)) > 16]
    assert 100 < len(long) < 200 and max(len(str(a)) for a in long) == 40
    with pytest.raises(DataError, match="tail_digits > max_digits"):
        make_problem(rng, 8, 16, tail_prob=0.1, tail_digits=10)


def test_default_responses_are_50_to_150_tokens_with_a_tokenizer_trained_on_the_task() -> None:
    tokenizer = train_tokenizer(corpus(3000, seed=1), vocab_size=1024)
    rng = np.random.default_rng(2)
    lengths = [len(tokenizer.encode(worked_solution(*make_problem(rng)))) for _ in range(200)]
    assert 50 <= min(lengths) and max(lengths) <= 150, (min(lengths), max(lengths))


def test_dataset_rows_splits_and_scorer(tmp_path: Path) -> None:
    paths = write_task("long_addition", tmp_path, n_train=60, n_test=20, seed=3)
    train, test = (pq.read_table(paths[s]).to_pylist() for s in ("train", "test"))
    assert len(train) == 60 and len(test) == 20
    key = {
        (
            min(map(int, r["extra_info"]["question"].split("+"))),
            max(map(int, r["extra_info"]["question"].split("+"))),
        )
        for r in train
    }
    assert not key & {
        (
            min(map(int, r["extra_info"]["question"].split("+"))),
            max(map(int, r["extra_info"]["question"].split("+"))),
        )
        for r in test
    }
    row = train[0]
    a, b = map(int, row["extra_info"]["question"].split("+"))
    assert row["reward_model"]["ground_truth"] == str(a + b)
    assert row["prompt"][0]["content"] == f"Add {a}+{b} column by column."
    score = get_scorer("long_addition")
    assert score(row["extra_info"]["solution"], row["reward_model"]["ground_truth"]) == 1.0
    assert score(worked_solution(a, b + 1), row["reward_model"]["ground_truth"]) == 0.0
    assert score("8+1=9\n3+6=9", row["reward_model"]["ground_truth"]) == 0.0  # stopped early
