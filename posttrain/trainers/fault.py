"""Fault tolerance of the driver loop: a graceful stop on SIGINT/SIGTERM, restarts after a worker failure, and
the kill points the crash tests use.

What it guarantees, with the checkpoint layout of `trainers/checkpoint.py`: a kill at any moment leaves the
newest complete checkpoint loadable; a run started again from it repeats, for the steps after it, what the
uninterrupted run would have done (same seed, same world size). Imports no Ray and no algorithm code.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

from posttrain.config.schema import TrainerConfig
from posttrain.errors import ConfigError, WorkerError

log = logging.getLogger(__name__)

T = TypeVar("T")

# Test-only: `POSTTRAIN_TEST_KILL_AT=<point>:<step>` makes the driver SIGKILL itself at that point of that
# step, so the crash tests can kill it at an exact moment (`saving`: worker shards written, checkpoint not
# yet published; `saved`: just after `latest` moved). Never set it in a real run.
TEST_KILL_ENV = "POSTTRAIN_TEST_KILL_AT"


def check_fault_config(trainer: TrainerConfig) -> None:
    if trainer.max_restarts < 0:
        raise ConfigError(f"trainer.max_restarts must be >= 0 (0 = no restarts), got {trainer.max_restarts}")
    if trainer.restart_wait_s < 0:
        raise ConfigError(f"trainer.restart_wait_s must be >= 0, got {trainer.restart_wait_s}")


def kill_point(point: str, step: int) -> None:
    """SIGKILL this process here if the test-only `POSTTRAIN_TEST_KILL_AT` names this point and step."""
    if os.environ.get(TEST_KILL_ENV) == f"{point}:{step}":
        print(f"{TEST_KILL_ENV}: killing the driver at {point}:{step}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


class RunStopped(Exception):
    """An offline trainer stopped by SIGINT/SIGTERM after saving a checkpoint (no export): the command exits
    128 + `signum`; a script calling `fit()` stops here rather than going on without the trained model."""

    def __init__(self, signum: int, message: str) -> None:
        super().__init__(message)
        self.signum = signum


class StopSignals:
    """SIGINT/SIGTERM handlers for the duration of a `with` block; the previous handlers come back after.

    The first signal is only recorded: the loop finishes the current step, saves a checkpoint and returns.
    A second one aborts at once (KeyboardInterrupt; no checkpoint), for someone who will not wait. Outside the
    main thread Python cannot take signals, and the block installs nothing.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            raise KeyboardInterrupt(f"second stop signal ({name}): aborting without a checkpoint")
        self.signum = signum
        print(
            f"{name} received: finishing the current step, then saving a checkpoint and stopping "
            "(send it again to abort at once, without a checkpoint)",
            file=sys.stderr,
            flush=True,
        )


def run_with_restarts(
    attempt: Callable[[], T], recover: Callable[[WorkerError, int], None], max_restarts: int
) -> T:
    """`attempt()` until it returns. After a WorkerError, `recover(error, restarts_so_far)` and attempt again,
    at most `max_restarts` times; then the error is raised as one line saying that no restarts are left. A
    deterministic one (an error of the input or settings a worker raised) is raised at once, saying so."""
    restarts = 0
    while True:
        try:
            return attempt()
        except WorkerError as exc:
            if exc.deterministic and max_restarts > 0:  # a restart would end in the same error
                raise WorkerError(
                    f"{exc} (not restarted: an error of the input or settings, which a restart would raise "
                    "again)",
                    role=exc.role,
                    rank=exc.rank,
                    deterministic=True,
                ) from None
            if restarts >= max_restarts:
                if max_restarts == 0:
                    raise
                raise WorkerError(
                    f"{exc} (after {restarts} restart(s); trainer.max_restarts={max_restarts})",
                    role=exc.role,
                    rank=exc.rank,
                    died=exc.died,
                ) from None
            restarts += 1
            print(
                f"worker failure: {exc}; restart {restarts} of {max_restarts} (trainer.max_restarts)",
                file=sys.stderr,
                flush=True,
            )
            log.warning("worker failure (restart %d of %d): %s", restarts, max_restarts, exc)
            recover(exc, restarts)
