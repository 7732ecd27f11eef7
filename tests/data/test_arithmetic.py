"""Arithmetic task: correct answers, verl row format, disjoint splits, registry."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from posttrain.data.tasks import get_task_writer, write_task
from posttrain.data.tasks.arithmetic import corpus, make_problem, write_arithmetic_dataset
from posttrain.errors import DataError


@pytest.mark.parametrize("ops", [("+",), ("-",), ("*",), ("+", "-", "*")])
def test_answer_equals_eval(ops):
    rng = np.random.default_rng(0)
    for _ in range(200):
        question, answer = make_problem(rng, 1, 4, ops)
        assert any(op in question for op in ops)
        assert int(answer) == eval(question)  # noqa: S307 - the generator's own output
        assert int(answer) >= 0


def test_digit_range():
    rng = np.random.default_rng(1)
    for _ in range(200):
        question, _ = make_problem(rng, 2, 3, ("+",))
        a, b = question.split("+")
        assert 2 <= len(a) <= 3 and 2 <= len(b) <= 3
        assert not a.startswith("0") and not b.startswith("0")


def test_bad_args():
    rng = np.random.default_rng(0)
    with pytest.raises(DataError, match="ops"):
        make_problem(rng, 1, 2, ("/",))
    with pytest.raises(DataError, match="min_digits"):
        make_problem(rng, 3, 2, ("+",))
    with pytest.raises(DataError, match="distinct problems"):
        write_arithmetic_dataset("unused", n_train=50, n_test=10, min_digits=1, max_digits=1)


def test_write_dataset_rows_and_disjoint_splits(tmp_path):
    paths = write_arithmetic_dataset(tmp_path, n_train=300, n_test=100, max_digits=2, ops=("+", "*"), seed=3)
    assert set(paths) == {"train", "test"}
    train, test = (pq.read_table(paths[s]).to_pylist() for s in ("train", "test"))
    assert len(train) == 300 and len(test) == 100
    row = train[5]
    q = row["extra_info"]["question"]
    assert row["data_source"] == "arithmetic"
    assert row["ability"] == "math"
    assert row["prompt"] == [{"role": "user", "content": f"What is {q}?"}]
    assert row["reward_model"] == {"style": "rule", "ground_truth": row["extra_info"]["answer"]}
    assert row["extra_info"]["split"] == "train" and row["extra_info"]["index"] == 5
    for r in train + test:
        assert int(r["reward_model"]["ground_truth"]) == eval(r["extra_info"]["question"])  # noqa: S307

    def canon(question):
        for op in "+*":
            if op in question:
                return (op, *sorted(question.split(op)))

    train_keys = {canon(r["extra_info"]["question"]) for r in train}
    test_keys = {canon(r["extra_info"]["question"]) for r in test}
    assert len(train_keys) == 300 and len(test_keys) == 100
    assert not train_keys & test_keys


def test_same_seed_same_files(tmp_path):
    a = write_arithmetic_dataset(tmp_path / "a", n_train=20, n_test=5, seed=9)
    b = write_arithmetic_dataset(tmp_path / "b", n_train=20, n_test=5, seed=9)
    assert pq.read_table(a["train"]).to_pylist() == pq.read_table(b["train"]).to_pylist()


def test_registry_and_corpus(tmp_path):
    assert get_task_writer("arithmetic") is write_arithmetic_dataset
    paths = write_task("arithmetic", tmp_path, n_train=10, n_test=5)
    assert pq.read_table(paths["test"]).num_rows == 5
    with pytest.raises(DataError, match="unknown task 'nope'.*arithmetic"):
        get_task_writer("nope")
    texts = corpus(20, seed=0)
    assert len(texts) == 20
    assert all(t.startswith("What is ") for t in texts)
    assert corpus(20, seed=0) == texts
