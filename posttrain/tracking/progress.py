"""Progress display: a bar over a run's steps with an ETA, and under it a bar over the current step's stages.

On only where someone watches: stdout is a terminal and the environment variable CI is unset (CI services set
it), and POSTTRAIN_PROGRESS is not 0. Elsewhere (logs, pipes, captured test output) every call is a no-op and
the trackers' one line per step is all that is printed. While the bars are up, prints and logging go through
tqdm's writer, so each step's console line scrolls above the bars instead of tearing them.
Must not import anything from posttrain except errors (tracking is the bottom layer).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any, TextIO

ENV_SWITCH = "POSTTRAIN_PROGRESS"  # "0" turns the bars off on a terminal too
_ETA_WINDOW = (
    20  # steps averaged for the ETA: recent enough to follow a change of pace, long enough to be steady
)
_TICK_S = 1.0  # redraw period while a stage runs (elapsed time, ETA countdown)

_active = threading.Lock()  # one display at a time: a run inside a run (none today) shows no second set


def progress_enabled(stream: Any = None, environ: Mapping[str, str] | None = None) -> bool:
    """Whether bars are drawn on `stream` (default sys.stdout): a TTY, CI unset, POSTTRAIN_PROGRESS not 0."""
    env = os.environ if environ is None else environ
    if env.get("CI", "").strip().lower() not in ("", "0", "false"):
        return False
    if env.get(ENV_SWITCH, "").strip() == "0":
        return False
    stream = sys.stdout if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (ValueError, OSError):  # a closed stream
        return False


def format_eta(seconds: float | None) -> str:
    """Remaining time, short: `45s`, `4m05s`, `2h03m`, `3d04h`; `?` when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _format_value(value: float) -> str:
    return f"{value:.3g}"


_BAR_FORMAT = "{desc} {n_fmt}/{total_fmt} |{bar}| {extra}"


def _bar_class() -> Any:
    """tqdm with one more field for bar_format, `extra`: text shown right of the bar (tqdm's own postfix
    comes with a leading comma)."""
    from tqdm import tqdm  # a dependency of transformers; imported only when drawing

    class Bar(tqdm):  # type: ignore[misc]
        extra = ""

        @property
        def format_dict(self) -> dict[str, Any]:
            return {**super().format_dict, "extra": self.extra}

    return Bar


class _AboveBars:
    """A stand-in for sys.stdout / sys.stderr (and the logging handlers writing to them) while bars are up:
    each whole line is written with the bars cleared, then the bars are drawn again. Everything else is the
    wrapped stream's."""

    def __init__(self, wrapped: TextIO, progress: RunProgress) -> None:
        self._wrapped = wrapped
        self._progress = progress
        self._pending: list[str] = []

    def write(self, text: str) -> int:
        head, newline, tail = text.rpartition("\n")
        if newline:
            self._progress._write_above("".join([*self._pending, head, newline]), self._wrapped)
            self._pending = [tail] if tail else []
        elif text:
            self._pending.append(text)
        return len(text)

    def write_pending(self) -> None:
        if self._pending:
            self._progress._write_above("".join(self._pending), self._wrapped)
            self._pending = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapped, name)


class RunProgress:
    """Bars for one run: `progress = RunProgress(total_steps, initial=step).start()` (or a `with`), then per step
    `progress.stage(name)` around each stage, `progress.step_done(step, metrics)` at its end; `close()` at the end
    of the run.

    The run bar shows steps done of `total_steps`, seconds per step, the ETA (the mean of the last 20 steps
    times the steps left) and the `show` metrics of the last step; the stage bar shows the stage running,
    how many of the previous step's stages are done and how long this one has run. Disabled (see
    `progress_enabled`), it draws nothing and redirects nothing.
    """

    def __init__(
        self,
        total_steps: int,
        initial: int = 0,
        desc: str = "step",
        show: Sequence[str] = (),
        stream: TextIO | None = None,
        enabled: bool | None = None,
    ) -> None:
        self.total_steps = total_steps
        self.step = initial  # the last step done
        self.desc = desc
        self.show = tuple(show)
        self.stream = sys.stdout if stream is None else stream
        self.enabled = progress_enabled(self.stream) if enabled is None else enabled
        self._durations: deque[float] = deque(maxlen=_ETA_WINDOW)
        self._last_done = time.perf_counter()
        self._stage_start = self._last_done
        self._stages_done = 0
        self._stages_expected: int | None = None  # the previous step's number of stages
        self._summary = ""
        self._run_bar: Any = None
        self._stage_bar: Any = None
        self._owns_display = False
        self._exit = ExitStack()
        self._stop_tick = threading.Event()
        self._ticker: threading.Thread | None = None
        self._lock: Any = threading.RLock()  # tqdm's write lock once the bars are up

    @classmethod
    def disabled(cls) -> RunProgress:
        """A display that shows nothing (the trainers' default outside a run)."""
        return cls(0, enabled=False)

    # ---- the display -----------------------------------------------------------------------------
    def start(self) -> RunProgress:
        """Draw the bars (when enabled); `close()` takes them down. Also `with RunProgress(...) as p:`."""
        if not self.enabled or self._owns_display:
            return self
        if not _active.acquire(blocking=False):  # another run's bars are up
            self.enabled = False
            return self
        self._owns_display = True
        try:
            self._open()
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Take the bars down and give stdout, stderr and logging back; safe to call twice."""
        if not self._owns_display:
            return
        self._stop_tick.set()
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None
        try:
            self._exit.close()
        finally:
            self._owns_display = False
            self.enabled = False
            _active.release()

    def __enter__(self) -> RunProgress:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self) -> None:
        bar_class = _bar_class()
        self._lock = bar_class.get_lock()
        self._last_done = self._stage_start = time.perf_counter()
        common = {"file": self.stream, "bar_format": _BAR_FORMAT, "dynamic_ncols": True, "mininterval": 0.0}
        self._run_bar = bar_class(
            total=self.total_steps, initial=self.step, desc=self.desc, position=0, leave=True, **common
        )
        self._stage_bar = bar_class(total=None, desc="", position=1, leave=False, **common)
        self._exit.callback(self._close_bars)
        # prints and log records go above the bars (cleared, the line written, drawn again)
        out, err = sys.stdout, sys.stderr
        wrappers = {id(out): _AboveBars(out, self), id(err): _AboveBars(err, self)}
        sys.stdout, sys.stderr = wrappers[id(out)], wrappers[id(err)]
        self._exit.callback(self._restore_streams, out, err)
        for handler in logging.getLogger().handlers:  # the console handlers of logging.basicConfig & co
            if isinstance(handler, logging.StreamHandler) and id(handler.stream) in wrappers:
                previous = handler.setStream(wrappers[id(handler.stream)])
                self._exit.callback(handler.setStream, previous)
        self._render()
        self._ticker = threading.Thread(target=self._tick, name="posttrain-progress", daemon=True)
        self._ticker.start()

    def _write_above(self, text: str, stream: TextIO) -> None:
        """Write `text` to `stream` with the bars cleared first and drawn again after."""
        with self._lock:
            bars = [b for b in (self._run_bar, self._stage_bar) if b is not None]
            for bar in bars:
                bar.clear(nolock=True)
            stream.write(text)
            stream.flush()
            for bar in bars:
                bar.refresh(nolock=True)

    def _close_bars(self) -> None:
        for bar in (self._stage_bar, self._run_bar):
            if bar is not None:
                bar.close()
        self._stage_bar = self._run_bar = None

    @staticmethod
    def _restore_streams(out: TextIO, err: TextIO) -> None:
        for wrapper in (sys.stdout, sys.stderr):
            if isinstance(wrapper, _AboveBars):
                wrapper.write_pending()
        sys.stdout, sys.stderr = out, err

    def _tick(self) -> None:
        while not self._stop_tick.wait(_TICK_S):
            self._render()

    def _render(self) -> None:
        with self._lock:
            run_bar, stage_bar = self._run_bar, self._stage_bar
            if run_bar is None or stage_bar is None:
                return
            now = time.perf_counter()
            pace = f"{self.seconds_per_step:.2f}s/step" if self._durations else "-s/step"
            fields = [pace, f"eta {format_eta(self.eta_s(now))}"]
            if self._summary:
                fields.append(self._summary)
            run_bar.extra = " | ".join(fields)
            stage_bar.extra = f"{now - self._stage_start:.1f}s"
            run_bar.refresh(nolock=True)
            stage_bar.refresh(nolock=True)

    # ---- what the trainers call ------------------------------------------------------------------
    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Show `name` as the running stage of the step (generation, scoring, update, ...)."""
        if self._stage_bar is None:
            yield
            return
        with self._lock:
            self._stage_start = time.perf_counter()
            self._stage_bar.set_description_str(self._stage_label(name), refresh=False)
        self._render()
        try:
            yield
        finally:
            with self._lock:
                bar = self._stage_bar
                if bar is not None:
                    self._stages_done += 1
                    if bar.total is not None and self._stages_done > bar.total:
                        bar.total = self._stages_done  # more stages than the step before (a validation)
                    bar.update(1)

    def step_done(self, step: int, metrics: Mapping[str, float] | None = None) -> None:
        """Step `step` has finished: advance the run bar, update the pace, ETA and the shown metrics."""
        with self._lock:
            now = time.perf_counter()
            self._durations.append(now - self._last_done)
            self._last_done = self._stage_start = now
            advance, self.step = step - self.step, step
            if metrics is not None:
                shown = [f"{k} {_format_value(float(metrics[k]))}" for k in self.show if k in metrics]
                self._summary = " ".join(shown)
            if self._run_bar is None or self._stage_bar is None:
                return
            self._stages_expected = self._stages_done or None
            self._stages_done = 0
            self._run_bar.update(advance)
            self._stage_bar.reset(total=self._stages_expected)
            self._stage_bar.set_description_str(self._stage_label(""), refresh=False)
        self._render()

    def _stage_label(self, name: str) -> str:
        """`  step 13: update_actor`; after the last step (an export, say) only the stage's name."""
        if self.step >= self.total_steps:
            return f"  {name}"
        return f"  step {self.step + 1}: {name}" if name else f"  step {self.step + 1}"

    @property
    def seconds_per_step(self) -> float:
        """Mean duration of the recent steps (0 before the first)."""
        return sum(self._durations) / len(self._durations) if self._durations else 0.0

    def eta_s(self, now: float | None = None) -> float | None:
        """Seconds to `total_steps` at the recent pace, less the time the running step has had; None before
        the first step is done."""
        if not self._durations:
            return None
        left = max(self.total_steps - self.step, 0)
        if left == 0:
            return 0.0
        since = (time.perf_counter() if now is None else now) - self._last_done
        return max(left * self.seconds_per_step - since, 0.0)
