"""GSM8K preparation: verl-format rows from the original JSONL, errors naming file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from posttrain.data.dataset import PromptDataset
from posttrain.data.gsm8k import extract_answer, prepare_gsm8k
from posttrain.errors import DataError

# the shared/ beside the clone, else this workplace's (a clone elsewhere, e.g. CI's, still runs these)
SRC = (
    next(
        (
            p
            for p in (Path(__file__).resolve().parents[3] / "shared", Path("/work/shared"))
            if (p / "data" / "gsm8k" / "train.jsonl").is_file()
        ),
        Path("/work/shared"),
    )
    / "data"
    / "gsm8k"
)
needs_src = pytest.mark.skipif(not (SRC / "train.jsonl").is_file(), reason="shared GSM8K files not present")


def copy_head(tmp_path: Path, n: int = 50) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for split in ("train", "test"):
        lines = (SRC / f"{split}.jsonl").read_text().splitlines()[:n]
        (src / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return src


def test_extract_answer():
    assert extract_answer("a\nb\n#### 1,234") == "1234"
    assert extract_answer("x #### -5 ") == "-5"
    assert extract_answer("no marker") is None


@needs_src
def test_prepare_writes_verl_rows(tmp_path, tokenizer):
    src = copy_head(tmp_path)
    paths = prepare_gsm8k(src, tmp_path / "out")
    train = pq.read_table(paths["train"]).to_pylist()
    assert len(train) == 50 and pq.read_table(paths["test"]).num_rows == 50
    first = json.loads((src / "train.jsonl").read_text().splitlines()[0])
    row = train[0]
    assert row["data_source"] == "openai/gsm8k"
    assert row["prompt"] == [
        {
            "role": "user",
            "content": first["question"]
            + ' Let\'s think step by step and output the final answer after "####".',
        }
    ]
    assert row["reward_model"]["ground_truth"] == "72"
    assert row["extra_info"] == {
        "split": "train",
        "index": 0,
        "question": first["question"],
        "answer": first["answer"],
    }
    assert all("," not in r["reward_model"]["ground_truth"] for r in train)
    ds = PromptDataset(paths["test"], tokenizer, max_prompt_length=4096)
    assert len(ds) == 50


@needs_src
def test_row_without_marker_names_file_and_line(tmp_path):
    src = copy_head(tmp_path, n=5)
    lines = (src / "test.jsonl").read_text().splitlines()
    bad = json.loads(lines[3])
    bad["answer"] = bad["answer"].replace("####", "answer:")
    lines[3] = json.dumps(bad)
    (src / "test.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"test\.jsonl: line 4: .*'####'"):
        prepare_gsm8k(src, tmp_path / "out")


def test_missing_source_file(tmp_path):
    with pytest.raises(DataError, match="train.jsonl: GSM8K file not found"):
        prepare_gsm8k(tmp_path, tmp_path / "out")
