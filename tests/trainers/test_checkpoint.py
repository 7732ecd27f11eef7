"""Checkpoint folders: published atomically, `latest` written last, stale temporaries ignored, retention."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from posttrain.errors import ConfigError
from posttrain.trainers.checkpoint import CheckpointManager, RunLock


def save(manager: CheckpointManager, step: int) -> Path:
    tmp = manager.begin(step)
    (tmp / "actor").mkdir()
    (tmp / "actor" / "shard").write_text(str(step))
    return manager.publish(tmp, step, {"step": step})


def test_publish_then_latest(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, max_to_keep=2)
    assert manager.latest() is None
    save(manager, 1)
    save(manager, 2)
    latest = manager.latest()
    assert latest == tmp_path / "step_2"
    assert manager.load_state(latest) == {"step": 2}


def test_an_interrupted_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    save(manager, 1)
    tmp = manager.begin(2)  # the process dies here, before publish
    (tmp / "actor").mkdir()
    assert manager.latest() == tmp_path / "step_1"
    assert tmp.exists(), "a reader leaves it: it may be a live trainer's save in progress"
    manager.recover()  # the next trainer, holding the run's lock
    assert not tmp.exists(), "a stale temporary folder is cleaned up"


def test_retention_keeps_the_newest(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, max_to_keep=2)
    for step in (1, 2, 3, 4):
        save(manager, step)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_3", "step_4"]
    assert manager.latest() == tmp_path / "step_4"


def test_a_latest_pointing_nowhere_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "latest").write_text("step_9")
    with pytest.raises(ConfigError, match="step_9, which is incomplete or missing"):
        CheckpointManager(tmp_path).latest()


def test_retention_never_deletes_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, max_to_keep=1)
    save(manager, 1)
    save(manager, 2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_2"]
    # a higher-numbered leftover (e.g. of an earlier run with trainer.resume=false) does not push it out
    (tmp_path / "step_9").mkdir()
    save(manager, 3)
    assert manager.latest() == tmp_path / "step_3"
    assert (tmp_path / "step_3" / "actor" / "shard").read_text() == "3"


def test_saving_a_step_again_is_safe_against_a_kill_between_the_renames(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    save(manager, 2)
    save(manager, 2)  # e.g. a stop right after a resume saves the same step again
    assert manager.latest() == tmp_path / "step_2" and not list(tmp_path.glob(".old-*"))
    # the process dies after moving the old step_2 aside, before the new one is renamed into place
    (tmp_path / "step_2").rename(tmp_path / ".old-step_2")
    (tmp_path / ".tmp-step_2").mkdir()
    assert manager.latest() == tmp_path / ".old-step_2"  # a reader reads it where it is
    manager.recover()
    assert manager.latest() == tmp_path / "step_2"
    assert manager.load_state(tmp_path / "step_2") == {"step": 2}
    assert not list(tmp_path.glob(".*-step_*")), "leftovers are cleaned up"


def test_a_kill_before_latest_moves_keeps_the_previous_one_current(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    save(manager, 1)
    pointer = (tmp_path / "latest").read_text()
    save(manager, 2)
    (tmp_path / "latest").write_text(pointer)  # as if killed after the folder rename, before the pointer
    assert manager.latest() == tmp_path / "step_1"


def test_retention_keeps_this_runs_previous_checkpoint_over_an_earlier_runs_higher_steps(
    tmp_path: Path,
) -> None:
    """A new run (trainer.resume=false) in a directory holding an earlier run's step_10 and step_20: keeping
    the newest two keeps this run's step_2 and step_4, written last, not step_20 by its number."""
    earlier = CheckpointManager(tmp_path, max_to_keep=2)
    save(earlier, 10)
    save(earlier, 20)
    for old in ("step_10", "step_20"):  # written an hour before this run
        state = tmp_path / old / "trainer_state.pt"
        os.utime(state, ns=(state.stat().st_atime_ns, state.stat().st_mtime_ns - 3600 * 10**9))
    run = CheckpointManager(tmp_path, max_to_keep=2)
    save(run, 2)
    save(run, 4)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_2", "step_4"]
    assert run.latest() == tmp_path / "step_4"


def test_without_the_pointer_the_newest_complete_checkpoint_is_latest(tmp_path: Path) -> None:
    """A lost `latest` must not make the next start a new run that overwrites the step folders."""
    manager = CheckpointManager(tmp_path, max_to_keep=0)
    for step in (2, 10, 4):
        save(manager, step)
    (tmp_path / "latest").unlink()
    (tmp_path / "step_12").mkdir()  # incomplete: no trainer state
    assert manager.latest() == tmp_path / "step_10"


def test_one_trainer_per_run_directory(tmp_path: Path) -> None:
    """A second trainer on a run directory in use is refused (it would delete the first one's save in
    progress); the lock goes with the first one's end. Another process is what holds it in real use: flock
    locks belong to open files, so a second open in this process conflicts too."""
    with RunLock(tmp_path):
        with pytest.raises(ConfigError, match=rf"in use by another trainer \(pid {os.getpid()}\)"):
            RunLock(tmp_path).__enter__()
    with RunLock(tmp_path):
        pass


def test_a_run_starts_from_the_checkpoint_resume_from_names(tmp_path: Path) -> None:
    """trainer.resume_from (verl's resume_mode=resume_path): a step_N of the run, or any checkpoint's path
    (a run forked from another's step); without it, latest when trainer.resume."""
    manager = CheckpointManager(tmp_path / "run", max_to_keep=0)
    for step in (2, 4):
        save(manager, step)
    other = CheckpointManager(tmp_path / "other")
    save(other, 7)
    assert manager.start_point(True, "") == tmp_path / "run" / "step_4"
    assert manager.start_point(False, "") is None
    assert manager.start_point(True, "step_2") == tmp_path / "run" / "step_2"
    assert manager.start_point(False, str(tmp_path / "other" / "step_7")) == tmp_path / "other" / "step_7"
    with pytest.raises(ConfigError, match=r"trainer.resume_from=step_3: .* is not a checkpoint"):
        manager.start_point(True, "step_3")
