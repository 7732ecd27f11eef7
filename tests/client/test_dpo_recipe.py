"""recipes/dpo.py runs on the explicit API: step 1 is at the reference (loss log 2, margin 0), metrics logged."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dpo_recipe_steps_from_the_reference(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    data = Path(arithmetic_data["train"]).parent
    args = ["--model", str(tiny_model_dir), "--data", str(data), "--out", str(tmp_path), "--steps", "3"]
    args += [
        "--pairs",
        "32",
        "--batch",
        "8",
        "--loss",
        "sigmoid,sft",
        "--weights",
        "1,0.1",
        "--lora-rank",
        "4",
    ]
    result = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "dpo.py"), *args], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    curve = json.loads((tmp_path / "curve.json").read_text())["curve"]
    assert [c["step"] for c in curve] == [1, 2, 3]
    assert abs(curve[0]["margin"]) < 1e-4
    assert curve[0]["loss"] > math.log(2)  # log 2 + 0.1 * the chosen NLL
    assert all(0.0 <= c["accuracy"] <= 1.0 for c in curve)
