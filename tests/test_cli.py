"""The `posttrain` command: sub-commands that build things, and one-line errors with exit code 2."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from posttrain.cli import main

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


def test_unknown_key_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "actor.optim.lrr=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "unknown config key 'actor.optim.lrr'; did you mean 'actor.optim.lr'" in err


def test_missing_model_dir_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", f"model.path={tmp_path}/none", "data.train_files=[x.parquet]"]) == 2
    assert "model directory not found" in capsys.readouterr().err


def test_make_model_and_data(tmp_path: Path) -> None:
    assert main(["make-model", "--preset", "tiny", "--out", str(tmp_path / "m"), "--corpus-size", "500"]) == 0
    assert (tmp_path / "m" / "config.json").exists() and (tmp_path / "m" / "tokenizer.json").exists()
    assert (
        main(["data", "arithmetic", "--out", str(tmp_path / "d"), "--n-train", "50", "--n-test", "10"]) == 0
    )
    assert pq.read_table(tmp_path / "d" / "train.parquet").num_rows == 50


@pytest.mark.skipif(not SHARED.exists(), reason="shared GSM8K data not beside the repository")
def test_gsm8k_preparation(tmp_path: Path) -> None:
    assert main(["data", "gsm8k", "--src", str(SHARED), "--out", str(tmp_path)]) == 0
    table = pq.read_table(tmp_path / "test.parquet").to_pylist()
    assert len(table) == 1319
    assert table[0]["data_source"] == "openai/gsm8k"
    assert table[0]["reward_model"]["ground_truth"] == table[0]["extra_info"]["answer"].split("####")[
        -1
    ].strip().replace(",", "")
