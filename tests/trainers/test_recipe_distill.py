"""recipes/distill.py: on-policy distillation on the explicit API, two steps on the ~1M preset."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from posttrain.models import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def test_distill_recipe_runs_two_steps(tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path) -> None:
    teacher = make_tiny_model("tiny", tmp_path / "teacher", [], seed=3, tokenizer_from=tiny_model_dir)
    out = tmp_path / "run"
    args = [
        "--student",
        str(tiny_model_dir),
        "--teacher",
        str(teacher),
        "--data",
        str(arithmetic_data["train"].parent),
    ]
    args += ["--out", str(out), "--steps", "2", "--prompts", "4", "--group", "2", "--val-prompts", "8"]
    env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "distill.py"), *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    curve = json.loads((out / "curve.json").read_text())["curve"]
    assert [r["step"] for r in curve] == [0, 1, 2]
    assert all(math.isfinite(r["kl_to_teacher"]) and r["kl_to_teacher"] > 0 for r in curve[1:])
    assert "acc" in curve[-1]
