"""Checkpoints as one component over the parts of a run, written under a temporary name, published by rename.

The trainer only says when: `save(step, workers, states, meta)` has each worker group write its own files
into the folder (`save_state(path)`: sharded weights, optimizer, per-rank RNGs) and stores every driver-side
part's `state_dict()` (dataloader, rewards and KL controller, the driver's RNG) in `trainer_state.pt`;
`restore` hands each back its own, as torchtitan's CheckpointManager does over `Stateful` parts.

Layout: `<run>/step_<N>/actor/` (sharded, written by the workers), `<run>/step_<N>/trainer_state.pt`
(step, dataloader position, driver RNG, config); `<run>/latest` holds the newest complete step's name.
A kill at any moment while saving leaves the previous checkpoint loadable: the new one becomes visible by
a rename once complete, and `latest` moves (another rename) only after that. What a crash can leave behind
(`.tmp-step_<N>`, a replaced `.old-step_<N>`, a half-deleted `.del-step_<N>`) is restored or cleaned up
by `recover()`, which only the run's trainer calls, holding the run directory's lock (`RunLock`): `latest()`
is a pure read, so `posttrain export`/`eval` on a live run never touch the save in progress.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from posttrain.controller.roles import Stateful
from posttrain.errors import ConfigError
from posttrain.trainers.fault import kill_point

log = logging.getLogger(__name__)

LATEST = "latest"
STATE_FILE = "trainer_state.pt"


class DriverState(Protocol):
    """A driver-side part of a checkpoint (dataloader, reward stage, RNG)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class CheckpointManager:
    def __init__(self, run_dir: str | Path, max_to_keep: int = 2) -> None:
        self.run_dir = Path(run_dir)
        self.max_to_keep = max_to_keep

    def save(
        self,
        step: int,
        workers: Sequence[Stateful],
        states: Mapping[str, DriverState],
        meta: Mapping[str, Any] | None = None,
    ) -> Path:
        """Step `step`'s checkpoint of every part; `meta` (step, config, model facts) goes beside the states.

        Test-only kill points (trainers/fault.py): `saving` with the shards written and nothing published,
        `saved` just after `latest` moved.
        """
        tmp = self.begin(step)
        for group in workers:
            group.save_state(tmp)
        trainer_state = {**{name: part.state_dict() for name, part in states.items()}, **(meta or {})}
        trainer_state["step"] = step
        kill_point("saving", step)
        path = self.publish(tmp, step, trainer_state)
        log.info("saved checkpoint %s", path)
        kill_point("saved", step)
        return path

    def restore(
        self, path: Path, workers: Sequence[Stateful], states: Mapping[str, DriverState]
    ) -> dict[str, Any]:
        """Load checkpoint `path` into every part; returns the whole trainer state (meta included)."""
        trainer_state = self.load_state(path)
        for group in workers:
            group.load_state(path)
        for name, part in states.items():
            part.load_state_dict(trainer_state.get(name, {}))
        return trainer_state

    def begin(self, step: int) -> Path:
        """A fresh temporary folder for step `step`; workers write their shards into it."""
        tmp = self.run_dir / f".tmp-step_{step}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        return tmp

    def publish(self, tmp: Path, step: int, trainer_state: dict[str, Any]) -> Path:
        """Write the driver state, rename the folder into place, then point `latest` at it.

        Saving a step that already has a checkpoint (a stop right after a resume) first moves the old one
        aside, so a kill between the two renames still finds it (`latest()` puts it back).
        """
        state_path = tmp / STATE_FILE
        torch.save(trainer_state, state_path)
        _fsync(state_path)
        final = self.run_dir / f"step_{step}"
        old = self.run_dir / f".old-{final.name}"
        if final.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
        os.replace(tmp, final)
        pointer_tmp = self.run_dir / f".{LATEST}.tmp"
        pointer_tmp.write_text(final.name)
        _fsync(pointer_tmp)
        os.replace(pointer_tmp, self.run_dir / LATEST)
        _fsync(self.run_dir)
        shutil.rmtree(old, ignore_errors=True)
        self._retain(keep=final)
        return final

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None; reads only (a trainer may be saving beside it).

        `latest` names it; a step moved aside by a save that was killed before its rename is read where it
        is (`.old-step_<N>`, until `recover()` puts it back); without the pointer, the highest complete
        `step_<N>`, with a warning (a hand-deleted pointer must not make the next start overwrite them)."""
        pointer = self.run_dir / LATEST
        if not pointer.exists():
            complete = [
                p for p in self.run_dir.glob("step_*") if _step(p) is not None and (p / STATE_FILE).exists()
            ]
            if not complete:
                return None
            newest = max(complete, key=lambda p: _step(p) or 0)
            log.warning("%s is missing; the newest complete checkpoint is %s", pointer, newest)
            return newest
        path = self.run_dir / pointer.read_text().strip()
        if (path / STATE_FILE).exists():
            return path
        moved = self.run_dir / f".old-{path.name}"
        if (moved / STATE_FILE).exists():
            return moved
        raise ConfigError(
            f"{pointer} names {path.name}, which is incomplete or missing; set trainer.resume_from to another "
            "checkpoint, or trainer.resume=false to start over"
        )

    def start_point(self, resume: bool, resume_from: str) -> Path | None:
        """The checkpoint a run starts from: `resume_from` (a `step_N` of this run directory, or a checkpoint
        folder's path), else the latest when `resume`, else None; ConfigError when `resume_from` is none."""
        if not resume_from:
            return self.latest() if resume else None
        path = Path(resume_from).expanduser()
        if not path.is_absolute() and not path.exists():
            path = self.run_dir / resume_from
        if not (path / STATE_FILE).exists():
            raise ConfigError(
                f"trainer.resume_from={resume_from}: {path} is not a checkpoint (no {STATE_FILE}); give step_N "
                f"of {self.run_dir} or a checkpoint folder's path"
            )
        return path

    def recover(self) -> None:
        """Clean up or restore what an interrupted save left (module docstring). The trainer calls it at
        start, holding the run directory's lock, before anything reads or writes checkpoints."""
        for stale in [*self.run_dir.glob(".tmp-step_*"), *self.run_dir.glob(".del-step_*")]:
            shutil.rmtree(stale, ignore_errors=True)
        for old in self.run_dir.glob(".old-step_*"):  # killed between moving it aside and the rename
            final = self.run_dir / old.name.removeprefix(".old-")
            if (final / STATE_FILE).exists():
                shutil.rmtree(old, ignore_errors=True)
            else:
                if final.exists():
                    shutil.rmtree(final)
                os.replace(old, final)

    def load_state(self, path: Path) -> dict[str, Any]:
        state = torch.load(path / STATE_FILE, weights_only=False)
        if not isinstance(state, dict):
            raise ConfigError(f"{path / STATE_FILE} is not a trainer state (a {type(state).__name__})")
        return state

    def _retain(self, keep: Path) -> None:
        """Delete the oldest checkpoints beyond `max_to_keep`; never `keep` (the one `latest` names). Oldest by
        when they were written (their trainer state is written last), then by step: in a directory that still
        holds an earlier run's higher steps (a new run with trainer.resume=false) numbers alone kept those and
        deleted this run's previous checkpoint."""
        if self.max_to_keep <= 0:
            return

        def written(path: Path) -> tuple[int, int]:
            state = path / STATE_FILE
            return (state.stat().st_mtime_ns if state.exists() else 0, int(path.name.split("_")[1]))

        steps = sorted(
            (p for p in self.run_dir.glob("step_*") if p.is_dir() and _step(p) is not None),
            key=written,
        )
        others = [p for p in steps if p != keep]
        for old in others[: max(0, len(others) - (self.max_to_keep - 1))]:
            # renamed first, so a kill halfway through the deletion never leaves a broken `step_N`
            doomed = self.run_dir / f".del-{old.name}"
            os.replace(old, doomed)
            shutil.rmtree(doomed, ignore_errors=True)


def _step(path: Path) -> int | None:
    """N of a `step_<N>` folder, else None."""
    number = path.name.removeprefix("step_")
    return int(number) if path.name.startswith("step_") and number.isdigit() and path.is_dir() else None


class RunLock:
    """An exclusive lock on a run directory for a trainer's lifetime (`<run>/.lock`, flock): a second
    trainer on the same directory would delete the first one's save in progress and interleave their
    checkpoints. Released when the process ends, however it ends. `export`/`eval` only read and take none."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / ".lock"
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise ConfigError(
                f"{self.path.parent} is in use by another trainer (pid {holder}); two runs in one "
                "run_dir would overwrite each other's checkpoints: wait for it, or set trainer.run_dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None


def _fsync(path: Path) -> None:
    """Flush a file (or a directory's entries) to disk: a rename is only as durable as what it points at."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
