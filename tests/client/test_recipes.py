"""The explicit API's recipes run end to end (a few steps on the tiny model; their learning results are in
README, measured over 3 seeds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_recipe(name: str, *args: str, timeout: float = 600) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "recipes" / name), *args], capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_rl_recipe_takes_steps_and_validates(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    data = Path(arithmetic_data["train"]).parent
    run_recipe(
        "rl_loop.py", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(tmp_path),
        "--steps", "2", "--prompts", "4", "--group", "4", "--val-every", "2", "--lora-rank", "4",
    )  # fmt: skip
    run = json.loads((tmp_path / "curves.json").read_text())["runs"][0]
    assert [v["step"] for v in run["val"]] == [0, 2]
    assert len(run["train"]) == 2 and all(0.0 <= s["reward"] <= 1.0 for s in run["train"])


def test_the_sl_recipe_lowers_the_held_out_loss(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    data = Path(arithmetic_data["train"]).parent
    run_recipe(
        "sl_loop.py", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(tmp_path),
        "--steps", "6", "--batch", "16", "--warmup", "0", "--eval-every", "3", "--schedule", "constant",
    )  # fmt: skip
    curve = json.loads((tmp_path / "curves.json").read_text())["runs"][0]["curve"]
    assert [c["step"] for c in curve] == [0, 3, 6]
    assert curve[-1]["nll"] < curve[0]["nll"], "cross-entropy steps lower the held-out loss"


@pytest.mark.slow
def test_the_agent_recipe_sfts_then_trains_on_tool_episodes(tiny_model_dir: Path, tmp_path: Path) -> None:
    from posttrain.agents.tools import build_tools
    from posttrain.data.tasks import write_tool_multiplication_dataset

    tools = [t.schema() for t in build_tools(["calculator"], None)]
    data = tmp_path / "data"
    write_tool_multiplication_dataset(data, tools, n_train=32, n_test=8, n_sft=8)
    run_recipe(
        "agent_loop.py", "--model", str(tiny_model_dir), "--data", str(data), "--out", str(tmp_path),
        "--sft-steps", "1", "--steps", "1", "--prompts", "2", "--group", "2", "--val-every", "1",
        "--val-prompts", "2", "--lora-rank", "4", timeout=1800,
    )  # fmt: skip
    curve = json.loads((tmp_path / "curve.json").read_text())
    assert [c["step"] for c in curve] == [0, 1]
    assert all(0.0 <= c["val_acc"] <= 1.0 and 0.0 <= c["tool_success"] <= 1.0 for c in curve)
