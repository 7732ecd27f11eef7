"""Tests for posttrain/tracking/loggers.py: console line, jsonl content and resume, tensorboard, errors."""

import json

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from posttrain.errors import ConfigError
from posttrain.tracking import Tracker


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_one_object_per_step(tmp_path):
    with Tracker(["jsonl"], tmp_path, config={"lr": 1e-6, "model": {"path": tmp_path}}) as tracker:
        tracker.log({"reward": 0.5, "n": 3, "kl": torch.tensor(0.25)}, step=1)
        tracker.log({"reward": np.float32(0.75), "n": np.int64(4)}, step=2)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert rows == [
        {"step": 1, "reward": 0.5, "n": 3, "kl": 0.25},
        {"step": 2, "reward": 0.75, "n": 4},
    ]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config == {"lr": 1e-6, "model": {"path": str(tmp_path)}}


def test_jsonl_appends_on_resume(tmp_path):
    with Tracker(["jsonl"], tmp_path) as tracker:
        tracker.log({"loss": 1.0}, step=1)
        tracker.log({"loss": 0.9}, step=2)
    with Tracker(["jsonl"], tmp_path) as tracker:
        tracker.log({"loss": 0.8}, step=3)
    assert [row["step"] for row in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_a_new_run_moves_an_earlier_runs_metrics_aside(tmp_path):
    """A run that starts from step 0 in a directory holding another run's metrics.jsonl must not append
    to it (a bench reading the file would see steps 0..N twice and add both runs' token counts)."""
    for loss in (1.0, 2.0):
        with Tracker(["jsonl"], tmp_path, new_run=True) as tracker:
            tracker.log({"loss": loss}, step=1)
    with Tracker(["jsonl"], tmp_path, new_run=True) as tracker:
        tracker.log({"loss": 3.0}, step=1)
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 3.0}]
    assert read_jsonl(tmp_path / "metrics.1.jsonl") == [{"step": 1, "loss": 1.0}]  # nothing is lost
    assert read_jsonl(tmp_path / "metrics.2.jsonl") == [{"step": 1, "loss": 2.0}]


def test_rewind_keeps_each_step_once_and_moves_the_rest_aside(tmp_path):
    """A resume from the checkpoint of step 2 after a crash at step 4: steps 3-4 are logged again, once."""
    with Tracker(["jsonl"], tmp_path) as tracker:
        for step in range(5):
            tracker.log({"loss": float(step)}, step=step)
        tracker.rewind(2)
        tracker.log({"loss": 30.0}, step=3)
    assert [row["step"] for row in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]
    assert read_jsonl(tmp_path / "metrics.jsonl")[-1]["loss"] == 30.0
    assert [row["step"] for row in read_jsonl(tmp_path / "metrics.1.jsonl")] == [3, 4]
    with Tracker(["jsonl"], tmp_path) as tracker:  # a restart from scratch: everything aside
        tracker.rewind(-1)
    assert read_jsonl(tmp_path / "metrics.jsonl") == []
    assert [row["step"] for row in read_jsonl(tmp_path / "metrics.2.jsonl")] == [0, 1, 2, 3]


def test_non_scalars_are_skipped(tmp_path, caplog):
    with Tracker(["jsonl", "console"], tmp_path) as tracker:
        for step in (1, 2):
            tracker.log(
                {
                    "ok": 1.5,
                    "vec": torch.ones(3),
                    "arr": np.zeros(2),
                    "s": "text",
                    "none": None,
                    "flag": True,
                },
                step=step,
            )
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert rows[0] == {"step": 1, "ok": 1.5, "flag": 1}
    assert caplog.text.count("'vec' is not a scalar") == 1  # warned once, not every step


def test_console_line(tmp_path, capsys):
    with Tracker(["console"], tmp_path / "unused") as tracker:
        tracker.log(
            {"loss": 2.0, "zeta": 1 / 3, "acc": 0.41, "reward": torch.tensor(0.53), "tokens": 1200}, step=12
        )
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "step 12 | reward 0.53 | acc 0.41 | loss 2 | zeta 0.3333 | tokens 1200"
    assert not (tmp_path / "unused").exists()  # console alone writes no files


def test_console_custom_keys(tmp_path, capsys):
    with Tracker(["console"], tmp_path, console_keys=["score/mean"]) as tracker:
        tracker.log({"a": 123456.789, "score/mean": 1e-7}, step=0)
    assert capsys.readouterr().out.strip() == "step 0 | score/mean 1e-07 | a 1.235e+05"


def test_tensorboard_scalars(tmp_path):
    with Tracker(["tensorboard"], tmp_path, run_name="exp", config={"algo": "grpo"}) as tracker:
        tracker.log({"reward": 0.25, "vec": torch.ones(2)}, step=1)
        tracker.log({"reward": torch.tensor(0.75)}, step=2)
    event_files = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert event_files
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert "vec" not in acc.Tags()["scalars"]
    events = acc.Scalars("reward")
    assert [(e.step, e.value) for e in events] == [(1, 0.25), (2, 0.75)]


def tensorboard_steps(folder, tag="reward"):
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_hides_redone_steps_and_moves_an_earlier_runs_events_aside(tmp_path):
    """A resume redoes the steps after its checkpoint: drawn once, with the redone values; a new run in the
    same directory starts its own curve (the earlier one moves to tensorboard.1)."""
    with Tracker(["tensorboard"], tmp_path) as tracker:
        for step in (1, 2, 3, 4):
            tracker.log({"reward": float(step)}, step=step)
    with Tracker(["tensorboard"], tmp_path, new_run=False) as tracker:  # resumed from step 2's checkpoint
        tracker.rewind(2)
        for step in (3, 4):
            tracker.log({"reward": 10.0 * step}, step=step)
    assert tensorboard_steps(tmp_path / "tensorboard") == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    with Tracker(["tensorboard"], tmp_path, new_run=True) as tracker:  # a new run (trainer.resume=false)
        tracker.log({"reward": -1.0}, step=1)
    assert tensorboard_steps(tmp_path / "tensorboard") == [(1, -1.0)]
    assert tensorboard_steps(tmp_path / "tensorboard.1")[-1] == (4, 40.0)


def test_unknown_backend_lists_valid_ones(tmp_path):
    with pytest.raises(ConfigError, match="'wandbb'.*console, jsonl, tensorboard"):
        Tracker(["console", "wandbb"], tmp_path)


def test_log_after_close_raises(tmp_path):
    tracker = Tracker(["jsonl"], tmp_path)
    tracker.close()
    tracker.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        tracker.log({"x": 1}, step=1)
