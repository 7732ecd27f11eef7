"""Plots of metrics.jsonl: valid PNGs with the expected series, runs overlaid, missing series noted."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from posttrain.errors import DataError
from posttrain.tracking import Tracker
from posttrain.tracking.plots import FIGURE_NAMES, plot_runs, read_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir: Path, steps: int = 6, with_entropy: bool = True, scale: float = 1.0) -> Path:
    """A run's metrics.jsonl written by the real jsonl logger, with the keys the RL trainer logs."""
    with Tracker(["jsonl"], run_dir) as tracker:
        tracker.log({"val/acc": 0.0, "val/reward": 0.1, "val/response_length": 9.0}, step=0)
        for step in range(1, steps + 1):
            metrics = {
                "reward/mean": scale * step / steps,
                "acc": 0.5 * step / steps,
                "response_length/mean": 10.0 + step,
                "actor/kl_loss": 0.001 * step,
                "actor/pg_loss": -0.1,
                "throughput/tokens_per_s": 300.0 + step,
                "throughput/gen_tokens_per_s": 200.0,
                "timing_share/gen": 0.3,
                "timing_share/update_actor": 0.6,
                "perf/mfu": 0.04,
            }
            if with_entropy:
                metrics["actor/entropy"] = 6.9 - 0.1 * step
            if step % 3 == 0:
                metrics.update({"val/acc": 0.1 * step, "val/reward": 0.2, "val/response_length": 11.0})
            tracker.log(metrics, step=step)
    return run_dir


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size[0] >= 300 and image.size[1] >= 200
        image.verify()


def test_one_run_every_figure(tmp_path: Path) -> None:
    run = write_run(tmp_path / "grpo")
    result = plot_runs([run], tmp_path / "plots")
    assert list(result.files) == list(FIGURE_NAMES)
    for path in result.files.values():
        assert_png(path)
    assert result.series["reward"] == [("grpo", "reward/mean"), ("grpo", "val/reward")]
    assert result.series["accuracy"] == [("grpo", "val/acc"), ("grpo", "acc")]
    assert result.series["kl"] == [("grpo", "actor/kl_loss")]
    assert result.series["throughput"] == [
        ("grpo", "throughput/tokens_per_s"),
        ("grpo", "throughput/gen_tokens_per_s"),
    ]
    assert result.series["time_shares"] == [
        ("grpo", "timing_share/gen"),
        ("grpo", "timing_share/update_actor"),
    ]
    assert result.notes == []


def test_several_runs_overlaid_and_missing_series_noted(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a" / "lr1e-3")
    b = write_run(tmp_path / "b" / "lr1e-3", with_entropy=False, scale=0.5)  # same name: parents tell apart
    c = write_run(tmp_path / "kl0", with_entropy=False)
    result = plot_runs([a, b, c], tmp_path / "out")
    labels = ["a/lr1e-3", "b/lr1e-3", "kl0"]
    assert result.series["reward"] == [(r, "reward/mean") for r in labels] + [
        (r, "val/reward") for r in labels
    ]
    assert result.series["entropy"] == [("a/lr1e-3", "actor/entropy")]  # the runs without it are left out
    assert_png(result.files["reward"])
    wide = Image.open(result.files["reward"]).size
    single = Image.open(plot_runs([a], tmp_path / "one").files["reward"]).size
    assert wide[0] > single[0]  # a panel per key when runs are overlaid


def test_asked_for_metrics_and_missing_ones(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", with_entropy=False)
    result = plot_runs([run], tmp_path / "plots", metrics=["entropy", "reward", "actor/*", "no/such"])
    assert list(result.files) == ["reward", "actor"]
    assert result.series["actor"] == [("run", "actor/kl_loss"), ("run", "actor/pg_loss")]
    assert any(n.startswith("entropy: skipped") for n in result.notes)
    assert any(n.startswith("no_such: skipped") for n in result.notes)
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["actor.png", "reward.png"]


def test_run_without_metrics_is_an_error_naming_it(tmp_path: Path) -> None:
    good = write_run(tmp_path / "good")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty: has no metrics\.jsonl"):
        plot_runs([good, tmp_path / "empty"], tmp_path / "out")
    with pytest.raises(DataError, match="missing: does not exist"):
        plot_runs([tmp_path / "missing"], tmp_path / "out")
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "metrics.jsonl").write_text("")
    with pytest.raises(DataError, match="blank: metrics.jsonl has no metrics"):
        plot_runs([tmp_path / "blank"], tmp_path / "out")


def test_resumed_steps_keep_the_last_value_and_torn_lines_are_skipped(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with Tracker(["jsonl"], run) as tracker:
        tracker.log({"reward/mean": 0.1}, step=1)
        tracker.log({"reward/mean": 0.2}, step=2)
    with Tracker(["jsonl"], run) as tracker:  # resumed from step 1's checkpoint: step 2 again
        tracker.log({"reward/mean": 0.3}, step=2)
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "reward/me')  # a crash mid-line
    metrics = read_metrics(run)
    assert metrics.series["reward/mean"] == {1: 0.1, 2: 0.3}
    assert metrics.bad_lines == 1
    result = plot_runs([run], tmp_path / "plots", metrics=["reward"])
    assert "1 unreadable lines" in result.notes[0]


def test_tracker_draws_plots_when_it_closes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with Tracker(["console", "jsonl"], tmp_path, plots=True) as tracker:
        for step in range(1, 4):
            tracker.log({"reward/mean": 0.1 * step, "actor/entropy": 1.0}, step=step)
    assert sorted(tracker.plot_files) == ["entropy", "reward"]
    assert_png(tmp_path / "plots" / "reward.png")
    assert f"plots: 2 figures in {tmp_path / 'plots'}" in capsys.readouterr().out


def test_tracker_plots_never_fail_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("no fonts")

    monkeypatch.setattr("posttrain.tracking.plots.plot_runs", broken)
    with Tracker(["jsonl"], tmp_path, plots=True) as tracker:
        tracker.log({"reward/mean": 0.1}, step=1)
    assert "plots of" in caplog.text and "no fonts" in caplog.text
    with Tracker(["console"], tmp_path / "console-only", plots=True):  # no jsonl: nothing to draw
        pass
    assert not (tmp_path / "console-only").exists()


def test_the_offline_trainers_losses_and_pairwise_accuracies_are_drawn(tmp_path: Path) -> None:
    """DPO logs `loss` and `dpo/loss_<type>`, RM `rm/bt_loss` and `val/accuracy`, distill `distill/jsd`: the
    loss figure showed none of them (only val/loss), and distill's was skipped."""
    runs = {
        "dpo": {"loss": 0.6, "dpo/loss_sigmoid": 0.6, "dpo/rewards_accuracy": 0.5},
        "rm": {"rm/bt_loss": 0.7, "rm/accuracy": 0.6, "val/accuracy": 0.55},
        "distill": {"distill/jsd": 0.2, "val/kl_to_teacher": 0.3},
    }
    for name, metrics in runs.items():
        with Tracker(["jsonl"], tmp_path / name) as tracker:
            for step in (1, 2):
                tracker.log(metrics, step=step)
    result = plot_runs([tmp_path / name for name in runs], tmp_path / "plots", metrics=["loss", "accuracy"])
    assert set(result.series["loss"]) == {
        ("dpo", "loss"), ("dpo", "dpo/loss_sigmoid"), ("rm", "rm/bt_loss"), ("distill", "distill/jsd"),
        ("distill", "val/kl_to_teacher"),
    }  # fmt: skip
    assert set(result.series["accuracy"]) == {
        ("dpo", "dpo/rewards_accuracy"), ("rm", "rm/accuracy"), ("rm", "val/accuracy"),
    }  # fmt: skip
