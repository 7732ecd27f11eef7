"""`posttrain data validate` (every bad row by index, with the dataset's own reason) and `data gsm8k` offline."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.cli import main
from tests.data.conftest import make_row, write_rows


def bad_rows() -> list[dict]:
    rows = [make_row(i) for i in range(6)]
    del rows[1]["prompt"]
    rows[3]["reward_model"] = {"style": "rule"}
    rows[4]["prompt"] = [{"role": "user"}]
    rows[5]["prompt"] = [{"role": "user", "content": "What is " + "1+" * 200 + "1?"}]
    return rows


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_validate_lists_bad_rows_with_reasons(
    tmp_path: Path, suffix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_rows(tmp_path / f"d{suffix}", bad_rows())
    assert main(["data", "validate", str(path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{path}: 6 rows, 3 bad (rl rows; schema only")
    assert lines[1:] == [
        "row 1: missing field 'prompt'",
        "row 3: missing field 'reward_model.ground_truth'",
        "row 4: field 'prompt' message 0 must be a dict with string 'role' and 'content'",
    ]


def test_validate_with_a_tokenizer_checks_lengths(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_rows(tmp_path / "d.parquet", bad_rows())
    assert main(["data", "validate", str(path), "--model", str(tiny_model_dir), "--max-length", "64"]) == 1
    out = capsys.readouterr().out
    assert "schema and lengths" in out
    assert "row 5: prompt has" in out and "max_prompt_length is 64" in out
    good = write_rows(tmp_path / "good.jsonl", [make_row(i) for i in range(3)])
    assert main(["data", "validate", str(good), "--model", str(tiny_model_dir)]) == 0
    assert "3 rows, 0 bad" in capsys.readouterr().out


def test_validate_sft_and_dpo_need_a_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_rows(tmp_path / "d.jsonl", [make_row(0)])
    assert main(["data", "validate", str(path), "--kind", "sft"]) == 2
    assert "give --model DIR" in capsys.readouterr().err
    assert main(["data", "validate", str(tmp_path / "none.jsonl")]) == 2
    assert "dataset file not found" in capsys.readouterr().err


def test_gsm8k_without_src_offline_says_how_to_give_a_local_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network here: never wait on a timeout
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert main(["data", "gsm8k", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "posttrain data gsm8k --src DIR --out OUT" in err and "train.jsonl and test.jsonl" in err


def test_validate_reads_image_rows_and_relative_image_paths(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Image bytes in a parquet row, and a JSON row's image path relative to its file, as training reads them
    (each row used to be copied to a temporary JSON file: bytes failed, relative paths pointed elsewhere)."""
    assert main(["data", "shapes", "--out", str(tmp_path / "shapes"), "--n-train", "3", "--n-test", "1"]) == 0
    capsys.readouterr()
    assert main(["data", "validate", str(tmp_path / "shapes" / "train.parquet")]) == 0
    assert "3 rows, 0 bad" in capsys.readouterr().out
    from PIL import Image

    Image.new("RGB", (28, 28), "red").save(tmp_path / "red.png")
    row = {**make_row(0), "images": ["red.png"]}
    row["prompt"] = [{"role": "user", "content": "<image>What color?"}]
    path = write_rows(tmp_path / "rel.jsonl", [row])
    assert main(["data", "validate", str(path)]) == 0
    assert not list(tmp_path.glob(".posttrain-validate-*"))  # the one-row files are gone
