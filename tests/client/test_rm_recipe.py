"""recipes/rm.py runs on the explicit API: its loss is Bradley-Terry of the pair's score margin, and it falls on a
repeated pair; held-out pairwise accuracy is logged before and after training."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.data.tasks.arithmetic_pairs import write_arithmetic_pairs

ROOT = Path(__file__).resolve().parents[2]


def test_rm_recipe_bradley_terry_on_the_lm_head(tiny_model_dir: Path, tmp_path: Path) -> None:
    pairs = tmp_path / "pairs"
    write_arithmetic_pairs(pairs, n_train=4, n_test=4)
    args = ["--model", str(tiny_model_dir), "--pairs", str(pairs), "--out", str(tmp_path / "out")]
    args += ["--n-pairs", "1", "--batch", "1", "--test-pairs", "4", "--steps", "3", "--lr", "1e-3"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "rm.py"), *args], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    curve = json.loads((tmp_path / "out" / "curve.json").read_text())
    train = curve["train"]
    assert [c["step"] for c in train] == [1, 2, 3]
    for c in train:  # one pair: the loss is -log sigmoid(r_chosen - r_rejected) of its margin
        assert c["loss"] == pytest.approx(math.log1p(math.exp(-c["margin"])), rel=1e-4)
    assert train[-1]["margin"] > train[0]["margin"] and train[-1]["loss"] < train[0]["loss"]
    assert [e["step"] for e in curve["eval"]] == [0, 3]
    assert all(e["accuracy"] in (0.0, 0.25, 0.5, 0.75, 1.0) for e in curve["eval"])
