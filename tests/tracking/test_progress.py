"""Tests for posttrain/tracking/progress.py: bars only on a terminal outside CI, what they show, the ETA,
prints and log lines above the bars, and the SFT trainer's stages on a (fake) terminal."""

from __future__ import annotations

import io
import logging
import sys
import types
from pathlib import Path

import pytest

from posttrain.tracking import progress as progress_module
from posttrain.tracking.progress import RunProgress, format_eta, progress_enabled


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        if self.closed:
            raise ValueError("I/O operation on closed file")  # as a real file does
        return True


def use_terminal(monkeypatch: pytest.MonkeyPatch) -> FakeTTY:
    """sys.stdout is a terminal and no CI variable is set (called in the test body: pytest's capture
    replaces sys.stdout between a fixture's set-up and the test)."""
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv("POSTTRAIN_PROGRESS", raising=False)
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stdout", tty)
    return tty


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now


def test_enabled_only_on_a_terminal_outside_ci() -> None:
    assert not progress_enabled(io.StringIO(), {})
    assert progress_enabled(FakeTTY(), {})
    assert not progress_enabled(FakeTTY(), {"CI": "true"})
    assert not progress_enabled(FakeTTY(), {"CI": "1"})
    assert progress_enabled(FakeTTY(), {"CI": "false"})
    assert progress_enabled(FakeTTY(), {"CI": ""})
    assert not progress_enabled(FakeTTY(), {"POSTTRAIN_PROGRESS": "0"})
    closed = FakeTTY()
    closed.close()
    assert not progress_enabled(closed, {})


def test_under_ci_nothing_is_drawn_or_redirected(monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = use_terminal(monkeypatch)
    monkeypatch.setenv("CI", "true")
    with RunProgress(3, desc="rl") as progress:
        assert not progress.enabled
        assert sys.stdout is terminal
        with progress.stage("generate+score"):
            pass
        print("step 1 | reward/mean 0.5")
        progress.step_done(1, {"reward/mean": 0.5})
    assert terminal.getvalue() == "step 1 | reward/mean 0.5\n"
    assert progress.step == 1


def test_not_a_tty_nothing_is_drawn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    with RunProgress(3, desc="sft") as progress:
        assert not progress.enabled
        with progress.stage("update"):
            pass
        progress.step_done(1)
    assert out.getvalue() == ""


def test_bars_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = use_terminal(monkeypatch)
    progress = RunProgress(3, desc="rl", show=("reward/mean", "val/acc")).start()
    try:
        assert progress.enabled
        assert sys.stdout is not terminal  # prints go through the bars' writer
        for step in (1, 2):
            for stage in ("generate+score", "update_actor"):
                with progress.stage(stage):
                    pass
            print(f"step {step} | reward/mean 0.25")
            progress.step_done(step, {"reward/mean": 0.25 * step, "other": 1.0})
    finally:
        progress.close()
    assert sys.stdout is terminal
    text = terminal.getvalue()
    assert "rl 0/3" in text and "rl 1/3" in text and "rl 2/3" in text
    assert "step 1: generate+score" in text and "step 2: update_actor" in text
    assert "reward/mean 0.5" in text and "other" not in text  # only the `show` metrics, last step's value
    assert "eta ?" in text and "s/step | eta " in text
    # each console line arrives whole, at the start of a line (the bars were cleared before it)
    for step in (1, 2):
        assert (
            f"\rstep {step} | reward/mean 0.25\n" in text or f"\x1b[Astep {step} | reward/mean 0.25\n" in text
        )
    progress.close()  # twice is fine


def test_log_records_go_above_the_bars(monkeypatch: pytest.MonkeyPatch) -> None:
    terminal = use_terminal(monkeypatch)
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stdout)  # as logging.basicConfig(stream=sys.stdout) makes it
    root.addHandler(handler)
    try:
        with RunProgress(2, desc="rl") as progress:
            assert handler.stream is not terminal
            logging.getLogger("posttrain.test").warning("checkpoint deferred")
        assert handler.stream is terminal
    finally:
        root.removeHandler(handler)
    assert "checkpoint deferred\n" in terminal.getvalue()
    assert progress.step == 0


def test_one_display_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    use_terminal(monkeypatch)
    with RunProgress(2, desc="outer") as outer:
        with RunProgress(2, desc="inner") as inner:
            assert outer.enabled and not inner.enabled
    with RunProgress(2, desc="again") as again:  # the first one gave the display back
        assert again.enabled


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "?"),
        (float("nan"), "?"),
        (float("inf"), "?"),
        (-1.0, "?"),
        (0.0, "0s"),
        (12.4, "12s"),
        (59.6, "1m00s"),
        (245.0, "4m05s"),
        (3599.0, "59m59s"),
        (3600.0, "1h00m"),
        (7380.0, "2h03m"),
        (86400.0 + 4 * 3600 + 59, "1d04h"),
    ],
)
def test_format_eta(seconds: float | None, text: str) -> None:
    assert format_eta(seconds) == text


def test_eta_from_the_recent_pace(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(progress_module, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    progress = RunProgress(10, initial=2, enabled=False)  # a resumed run: 8 steps left
    assert progress.eta_s() is None
    clock.now += 4.0
    progress.step_done(3)
    clock.now += 2.0
    progress.step_done(4)
    assert progress.seconds_per_step == pytest.approx(3.0)
    assert progress.eta_s() == pytest.approx(6 * 3.0)
    clock.now += 1.0  # the running step counts down
    assert progress.eta_s() == pytest.approx(17.0)
    clock.now += 60.0
    assert progress.eta_s() == 0.0  # late, not negative
    for step in range(5, 11):
        progress.step_done(step)
    assert progress.eta_s() == 0.0


def test_eta_follows_the_last_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(progress_module, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    progress = RunProgress(100, enabled=False)
    for step in range(1, 41):  # 10 s per step, then 1 s per step: only the last 20 count
        clock.now += 10.0 if step <= 20 else 1.0
        progress.step_done(step)
    assert progress.seconds_per_step == pytest.approx(1.0)
    assert format_eta(progress.eta_s()) == "1m00s"


def test_sft_shows_its_stages_on_a_terminal(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path, arithmetic_data: dict[str, Path], tmp_path: Path
) -> None:
    from posttrain.config.load import load_config
    from posttrain.config.schema import SFTConfig
    from posttrain.trainers.sft import SFTTrainer

    cfg = load_config(
        SFTConfig,
        "sft",
        [
            f"model.path={tiny_model_dir}",
            f"data.train_files=[{arithmetic_data['train']}]",
            f"data.val_files=[{arithmetic_data['test']}]",
            f"trainer.run_dir={tmp_path}",
            "trainer.total_steps=2",
            "trainer.val_every=2",
            "trainer.loggers=[console]",
            "optim.batch_size=8",
            "optim.micro_batch_size=8",
        ],
    )
    terminal = use_terminal(monkeypatch)
    SFTTrainer(cfg).fit()
    assert sys.stdout is terminal
    text = terminal.getvalue()
    assert "sft 2/2" in text and "step 1: update" in text and "step 2: validate" in text and "export" in text
    assert "s/step | eta 0s | loss " in text and "val/nll" in text
    assert "\rstep 2 | " in text or "\x1b[Astep 2 | " in text  # the tracker's line, above the bars
