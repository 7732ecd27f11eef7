"""`posttrain plot` end to end, and what a training run leaves for it: plots at the end, run_info.json, and each
validation's samples table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from posttrain.cli import main
from posttrain.tracking import Tracker


def synthetic_run(run_dir: Path, slope: float) -> Path:
    """metrics.jsonl of a short run, written by the real jsonl logger with the RL trainer's keys."""
    with Tracker(["jsonl"], run_dir) as tracker:
        tracker.log({"val/acc": 0.0}, step=0)
        for step in range(1, 9):
            tracker.log(
                {
                    "reward/mean": slope * step,
                    "response_length/mean": 20.0 - step,
                    "throughput/tokens_per_s": 250.0,
                    "timing_share/gen": 0.4,
                    "val/acc": slope * step / 2,
                },
                step=step,
            )
    return run_dir


def is_png(path: Path) -> bool:
    with Image.open(path) as image:
        image.verify()
        return image.format == "PNG"


def test_plot_two_runs_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = synthetic_run(tmp_path / "grpo", 0.1), synthetic_run(tmp_path / "ppo", 0.05)
    out = tmp_path / "figures"
    assert main(["plot", str(a), str(b), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == [
        "accuracy.png", "response_length.png", "reward.png", "throughput.png", "time_shares.png",
    ]  # fmt: skip
    assert all(is_png(p) for p in out.iterdir())
    assert f"wrote {out / 'reward.png'}: reward/mean" in printed
    assert "note: entropy: skipped, no run logged actor/entropy" in printed


def test_plot_defaults_to_the_run_dir_and_selected_metrics(tmp_path: Path, capsys) -> None:
    run = synthetic_run(tmp_path / "run", 0.1)
    assert main(["plot", str(run), "--metrics", "reward", "timing_share/*"]) == 0
    assert sorted(p.name for p in (run / "plots").iterdir()) == ["reward.png", "timing_share.png"]
    printed = capsys.readouterr().out
    assert "note: reward: no run logged val/reward" in printed  # asked for by name: its missing part said
    assert f"wrote {run / 'plots' / 'timing_share.png'}: timing_share/gen" in printed


def test_plot_run_without_metrics_fails_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = synthetic_run(tmp_path / "good", 0.1)
    (tmp_path / "crashed").mkdir()
    assert main(["plot", str(good), str(tmp_path / "crashed"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("posttrain plot: error:") and f"{tmp_path / 'crashed'}: has no metrics.jsonl" in err
    assert err.count("\n") == 0


def test_training_run_leaves_plots_run_info_and_samples(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    train = [
        f"model.path={tiny_model_dir}", f"data.train_files=[{arithmetic_data['train']}]",
        f"data.val_files=[{arithmetic_data['test']}]", f"trainer.run_dir={run}", "trainer.total_steps=2",
        "trainer.backend=local", "trainer.val_every=2", "data.val_max_prompts=4", "data.train_batch_prompts=2",
        "rollout.n=2", "data.max_response_length=4", "trainer.loggers=[console,jsonl]", "trainer.save_every=0",
    ]  # fmt: skip
    assert main(["train", *train]) == 0
    assert "plots: " in capsys.readouterr().out
    figures = sorted(p.name for p in (run / "plots").iterdir())
    assert {"reward.png", "accuracy.png", "response_length.png", "throughput.png", "time_shares.png"} <= set(
        figures
    )
    assert all(is_png(run / "plots" / name) for name in figures)

    info = json.loads((run / "run_info.json").read_text())
    assert info["config"]["trainer"]["total_steps"] == 2 and info["packages"]["torch"]
    assert info["loggers"] == ["console", "jsonl"]

    for step in (0, 2):  # before training and at step 2
        rows = [
            json.loads(line) for line in (run / "samples" / f"val_step_{step}.jsonl").read_text().splitlines()
        ]
        assert len(rows) == 4
        assert {"prompt", "response", "reward", "ground_truth", "data_source", "correct"} <= set(rows[0])
        assert all(r["step"] == step and isinstance(r["reward"], float) for r in rows)
        page = (run / "samples" / f"val_step_{step}.html").read_text()
        assert page.startswith("<!DOCTYPE html>") and f"step {step}" in page
    val = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if "val/acc" in line]
    assert val[-1]["step"] == 2 and val[-1]["val/acc"] == sum(r["correct"] for r in rows) / len(rows)

    assert main(["plot", str(run), "--out", str(tmp_path / "again"), "--metrics", "reward", "accuracy"]) == 0
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == ["accuracy.png", "reward.png"]
