"""Test-only: a worker that stops at a named point of a verb so that a test can SIGKILL it from outside.

`POSTTRAIN_TEST_PAUSE_AT=<dir>;<role>:<verb>:<rank>:<nth>,<role>:<verb>:<rank>:<nth>,...` makes rank `rank` of
`role`, on the `nth` call of `verb` in its process, write `<dir>/pause-<i>` (its pid) and wait there, inside
the call, until something kills it. The points fire one after another in the order given: point i is
considered only once point i-1 has fired (its file exists), and a fired point never fires again, so the
workers started by a restart go on to the next point. The result is a deterministic series of deaths at
exact moments (during sampling, during forward/backward, during a checkpoint save), each from a real
SIGKILL, without a test reaching into the worker. Never set it in a real run.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

PAUSE_ENV = "POSTTRAIN_TEST_PAUSE_AT"
# A paused worker that nobody kills gives up after this long (and the test fails on the lost time).
PAUSE_LIMIT_S = 600.0


@dataclass(frozen=True)
class PausePoint:
    role: str
    verb: str
    rank: int
    nth: int


def parse(value: str) -> tuple[Path, list[PausePoint]]:
    """`<dir>;<role>:<verb>:<rank>:<nth>,...` -> the folder and the points, in order."""
    folder, _, points = value.partition(";")
    parsed = []
    for item in filter(None, points.split(",")):
        role, verb, rank, nth = item.split(":")
        parsed.append(PausePoint(role, verb, int(rank), int(nth)))
    return Path(folder), parsed


def marker(folder: Path, index: int) -> Path:
    return folder / f"pause-{index}"


def pause_if_asked(role: str, verb: str, rank: int, nth: int) -> None:
    """Wait here, to be killed, if the next point that has not fired is this role, verb, rank and call."""
    value = os.environ.get(PAUSE_ENV)
    if not value:
        return
    folder, points = parse(value)
    for index, point in enumerate(points):
        if marker(folder, index).exists():
            continue
        if point == PausePoint(role, verb, rank, nth):
            tmp = folder / f".pause-{index}.tmp"
            tmp.write_text(str(os.getpid()))
            os.replace(tmp, marker(folder, index))
            time.sleep(PAUSE_LIMIT_S)
        return
