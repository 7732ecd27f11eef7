"""Checkpoint directories: written under a temporary name, published by rename, `latest` written last.

Layout: `<run>/step_<N>/actor/` (sharded, written by the workers), `<run>/step_<N>/trainer_state.pt`
(step, dataloader position, driver RNG, config); `<run>/latest` holds the newest complete step's name.
A crash while saving leaves at most a `.tmp-step_<N>` folder behind, which is ignored and cleaned up.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from posttrain.errors import ConfigError

log = logging.getLogger(__name__)

LATEST = "latest"
STATE_FILE = "trainer_state.pt"


class CheckpointManager:
    def __init__(self, run_dir: str | Path, max_to_keep: int = 2) -> None:
        self.run_dir = Path(run_dir)
        self.max_to_keep = max_to_keep

    def begin(self, step: int) -> Path:
        """A fresh temporary folder for step `step`; workers write their shards into it."""
        tmp = self.run_dir / f".tmp-step_{step}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        return tmp

    def publish(self, tmp: Path, step: int, trainer_state: dict[str, Any]) -> Path:
        """Write the driver state, rename the folder into place, then point `latest` at it."""
        torch.save(trainer_state, tmp / STATE_FILE)
        final = self.run_dir / f"step_{step}"
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer_tmp = self.run_dir / f".{LATEST}.tmp"
        pointer_tmp.write_text(final.name)
        os.replace(pointer_tmp, self.run_dir / LATEST)
        self._retain(keep=final)
        return final

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None; stale temporary folders are removed."""
        for stale in self.run_dir.glob(".tmp-step_*"):
            shutil.rmtree(stale, ignore_errors=True)
        pointer = self.run_dir / LATEST
        if not pointer.exists():
            return None
        path = self.run_dir / pointer.read_text().strip()
        if not (path / STATE_FILE).exists():
            raise ConfigError(
                f"{pointer} names {path.name}, which is incomplete or missing; remove it to start over"
            )
        return path

    def load_state(self, path: Path) -> dict[str, Any]:
        return torch.load(path / STATE_FILE, weights_only=False)

    def _retain(self, keep: Path) -> None:
        if self.max_to_keep <= 0:
            return
        steps = sorted(
            (p for p in self.run_dir.glob("step_*") if p.is_dir()), key=lambda p: int(p.name.split("_")[1])
        )
        for old in steps[: max(0, len(steps) - self.max_to_keep)]:
            if old != keep:
                shutil.rmtree(old, ignore_errors=True)


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
