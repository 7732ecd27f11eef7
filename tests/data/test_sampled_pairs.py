"""Preference pairs from a model's own samples: the most frequent wrong answer is rejected, a sampled correct
answer (else the ground truth) chosen, prompts with nothing to prefer give no pair, bad files are named."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from posttrain.cli import main
from posttrain.data.preference_dataset import PreferenceDataset
from posttrain.data.sampled_pairs import write_sampled_pairs
from posttrain.errors import DataError

MESSAGES = [{"role": "user", "content": "What is 2+3?"}]


def sample(index: int, response: str, correct: bool, truth: str = "5") -> dict:
    return {
        "index": index,
        "sample": 0,
        "data_source": "arithmetic",
        "prompt": "rendered",
        "messages": MESSAGES,
        "response": response,
        "ground_truth": truth,
        "score": float(correct),
        "correct": correct,
    }


def write(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_pairs_prefer_a_correct_answer_over_the_models_most_frequent_mistake(tmp_path) -> None:
    samples = tmp_path / "samples.jsonl"
    write(
        samples,
        [
            # prompt 0: right once, "6" twice, "7" once -> chosen "5" (sampled), rejected "6"
            sample(0, "5", True), sample(0, "6", False), sample(0, "7", False), sample(0, " 6", False),
            # prompt 1: never right -> the ground truth is chosen
            sample(1, "9", False, truth="8"), sample(1, "9", False, truth="8"),
            # prompt 2: always right -> no pair
            sample(2, "5", True), sample(2, "5", True),
            # prompt 3: only empty wrong answers -> no pair
            sample(3, "", False),
        ],
    )  # fmt: skip
    counts = write_sampled_pairs(samples, tmp_path / "pairs.parquet")
    assert counts == {"prompts": 4, "pairs": 2, "chosen_sampled": 1}
    rows = pq.read_table(tmp_path / "pairs.parquet").to_pylist()
    assert [(r["chosen"][0]["content"], r["rejected"][0]["content"]) for r in rows] == [
        ("5", "6"),
        ("8", "9"),
    ]
    assert rows[0]["prompt"] == MESSAGES and rows[0]["extra_info"] == {"index": 0, "chosen_sampled": True}
    # skip: a prompt with no correct sample gives no pair
    assert write_sampled_pairs(samples, tmp_path / "p2.parquet", "skip")["pairs"] == 1


def test_pairs_load_as_dpo_rows(tmp_path, tiny_model_dir) -> None:
    from posttrain.models import load_tokenizer

    samples = tmp_path / "samples.jsonl"
    write(samples, [sample(0, "5", True), sample(0, "4", False)])
    write_sampled_pairs(samples, tmp_path / "pairs.parquet")
    dataset = PreferenceDataset([tmp_path / "pairs.parquet"], load_tokenizer(tiny_model_dir), max_length=64)
    assert len(dataset) == 1


def test_bad_sample_files_are_named(tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"index": 0, "response": "1"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1: missing \['messages', 'ground_truth', 'correct'\]"):
        write_sampled_pairs(bad, tmp_path / "out.parquet")
    bad.write_text("not json\n")
    with pytest.raises(DataError, match="bad.jsonl:1: not JSON"):
        write_sampled_pairs(bad, tmp_path / "out.parquet")
    write(bad, [sample(0, "5", True)])
    with pytest.raises(DataError, match="no pairs"):
        write_sampled_pairs(bad, tmp_path / "out.parquet")


def test_data_command_writes_sampled_pairs(tmp_path, capsys) -> None:
    samples = tmp_path / "samples.jsonl"
    write(samples, [sample(0, "5", True), sample(0, "4", False)])
    out = tmp_path / "pairs.parquet"
    assert main(["data", "sampled_pairs", "--samples", str(samples), "--out", str(out)]) == 0
    assert "wrote 1 pairs from 1 prompts (1 with a sampled chosen answer)" in capsys.readouterr().out
