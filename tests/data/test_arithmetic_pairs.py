"""Preference pairs of the arithmetic task: right vs plausible wrong answers, disjoint splits, the CLI writer."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from posttrain.cli import main
from posttrain.data.tasks import get_task_writer
from posttrain.data.tasks.arithmetic import OPS, _problem_key
from posttrain.data.tasks.arithmetic_pairs import near_answers, write_arithmetic_pairs, wrong_answer


def test_wrong_answers_are_wrong_and_plausible() -> None:
    rng = np.random.default_rng(0)
    for answer in [0, 1, 9, 10, 57, 198]:
        wrongs = [wrong_answer(rng, answer) for _ in range(200)]
        assert all(w >= 0 and w != answer for w in wrongs)
        assert all(abs(w - answer) < 100 for w in wrongs)
    offs = [abs(wrong_answer(rng, 150) - 150) for _ in range(1000)]
    assert 0.4 < np.mean([o < 10 for o in offs]) < 0.6  # mostly the last digit, often a carry, some far


def test_pairs_in_trl_columns_with_disjoint_splits(tmp_path) -> None:
    paths = write_arithmetic_pairs(tmp_path, n_train=300, n_test=50, seed=1)
    assert get_task_writer("arithmetic_pairs") is write_arithmetic_pairs
    splits = {name: pq.read_table(path).to_pylist() for name, path in paths.items()}
    assert len(splits["train"]) == 300 and len(splits["test"]) == 50
    for row in splits["train"] + splits["test"]:
        question = row["extra_info"]["question"]
        left, right = question.split("+")
        assert row["prompt"] == [{"role": "user", "content": f"What is {question}?"}]
        assert row["chosen"] == [{"role": "assistant", "content": str(OPS["+"](int(left), int(right)))}]
        (rejected,) = row["rejected"]
        assert rejected["role"] == "assistant" and rejected["content"] != row["chosen"][0]["content"]
    keys = {name: {_problem_key(r["extra_info"]["question"]) for r in rows} for name, rows in splits.items()}
    assert not keys["train"] & keys["test"]


def test_data_command_writes_pairs(tmp_path, capsys) -> None:
    out = tmp_path / "pairs"
    assert main(["data", "arithmetic_pairs", "--out", str(out), "--n-train", "40", "--n-test", "10"]) == 0
    assert "train:" in capsys.readouterr().out
    assert pq.read_table(out / "test.parquet").num_rows == 10


def test_several_wrong_answers_per_problem_keep_the_split(tmp_path) -> None:
    one = write_arithmetic_pairs(tmp_path / "one", n_train=40, n_test=10, seed=2)
    three = write_arithmetic_pairs(tmp_path / "three", n_train=40, n_test=10, seed=2, rejected_per_problem=3)
    for split in ("train", "test"):
        rows_one = pq.read_table(one[split]).to_pylist()
        rows_three = pq.read_table(three[split]).to_pylist()
        assert len(rows_three) == 3 * len(rows_one)
        by_question: dict[str, set[str]] = {}
        for row in rows_three:
            by_question.setdefault(row["extra_info"]["question"], set()).add(row["rejected"][0]["content"])
            assert row["rejected"][0]["content"] != row["chosen"][0]["content"]
        # the same problems in each split, each with three distinct wrong answers
        assert set(by_question) == {r["extra_info"]["question"] for r in rows_one}
        assert all(len(wrongs) == 3 for wrongs in by_question.values())


def test_data_command_rejected_per_problem(tmp_path) -> None:
    out = tmp_path / "pairs"
    args = ["data", "arithmetic_pairs", "--out", str(out), "--n-train", "8", "--n-test", "4"]
    assert main([*args, "--rejected-per-problem", "2"]) == 0
    assert pq.read_table(out / "train.parquet").num_rows == 16


def test_near_slips_add_the_answers_next_to_the_right_one(tmp_path) -> None:
    plain = write_arithmetic_pairs(tmp_path / "plain", n_train=40, n_test=10, seed=2, rejected_per_problem=2)
    near = write_arithmetic_pairs(
        tmp_path / "near", n_train=40, n_test=10, seed=2, rejected_per_problem=2, near_slips=(1, 10)
    )
    for split in ("train", "test"):
        by_question: dict[str, list[int]] = {}
        for row in pq.read_table(near[split]).to_pylist():
            by_question.setdefault(row["extra_info"]["question"], []).append(
                int(row["rejected"][0]["content"])
            )
        sampled: dict[str, list[int]] = {}
        for row in pq.read_table(plain[split]).to_pylist():
            sampled.setdefault(row["extra_info"]["question"], []).append(int(row["rejected"][0]["content"]))
        assert list(by_question) == list(sampled)  # the same problems, in the same split
        for question, wrongs in by_question.items():
            answer = int(OPS["+"](*map(int, question.split("+"))))
            near_ones = {w for w in (answer + 1, answer - 1, answer + 10, answer - 10) if w >= 0}
            assert wrongs[:2] == sampled[question]  # the sampled slips first, as drawn without near_slips
            assert set(wrongs) == set(sampled[question]) | near_ones
            assert len(wrongs) == len(set(wrongs)) and answer not in wrongs


def test_near_slips_refuse_sizes_below_one(tmp_path) -> None:
    with pytest.raises(ValueError, match="near_slips"):
        write_arithmetic_pairs(tmp_path, n_train=4, n_test=2, near_slips=(0,))
    assert near_answers(3, (1, 5), exclude=(4,)) == [2, 8]


def test_data_command_near_slips(tmp_path) -> None:
    out = tmp_path / "pairs"
    args = ["data", "arithmetic_pairs", "--out", str(out), "--n-train", "8", "--n-test", "4"]
    assert main([*args, "--near-slips", "1,2"]) == 0
    assert pq.read_table(out / "train.parquet").num_rows > 8
