"""Metrics loggers: one `Tracker` fanning each step's scalars out to console, JSONL, TensorBoard, W&B and MLflow.

W&B (offline) and MLflow (a local sqlite store) are optional extras, in tracking/external.py; they write only
under the run directory. Every Tracker given a run config writes `<log_dir>/run_info.json` (tracking/run_info.py)
and, with `plots`, PNG figures of `metrics.jsonl` in `<log_dir>/plots` when it closes (tracking/plots.py).
Must not import anything from posttrain except errors (tracking is the bottom layer).
"""

import dataclasses
import json
import logging
import numbers
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from posttrain.errors import ConfigError
from posttrain.tracking.external import MlflowBackend, WandbBackend, missing_package
from posttrain.tracking.plots import METRICS_FILE
from posttrain.tracking.run_info import RUN_INFO_FILE, collect_run_info

logger = logging.getLogger(__name__)

VALID_BACKENDS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
PLOTS_DIR = "plots"  # where a Tracker with `plots` draws metrics.jsonl when it closes

# Printed first on the console line, in this order, when present; the rest follow in the order logged.
DEFAULT_CONSOLE_KEYS = ("reward", "acc", "loss", "kl", "entropy", "grad_norm", "lr")


class _Backend(Protocol):
    """What a Tracker writes to: scalars for one step, then close."""

    def log(self, metrics: Mapping[str, float | int], step: int) -> None: ...

    def close(self) -> None: ...


def _to_scalar(value: Any) -> float | int | None:
    """Return `value` as a Python int/float, or None if it is not a single number."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, torch.Tensor):
        if value.ndim == 0 and not value.is_complex():
            return value.item()
        return None
    # numpy scalars and 0-d arrays, without importing numpy
    if getattr(value, "shape", None) == () and hasattr(value, "item"):
        item = value.item()
        return _to_scalar(item) if isinstance(item, numbers.Real) else None
    return None


def _format_value(value: float | int) -> str:
    """Compact console form: ints as-is, floats with 4 significant digits."""
    return str(value) if isinstance(value, int) else f"{value:.4g}"


class ConsoleBackend:
    """One line per step, `step 12 | reward 0.53 | acc 0.41 | ...`, printed and flushed."""

    def __init__(
        self, priority_keys: Sequence[str] = DEFAULT_CONSOLE_KEYS, only_priority: bool = False
    ) -> None:
        self.priority_keys = tuple(priority_keys)
        self.only_priority = only_priority  # a readable console; the files keep every metric

    def format(self, metrics: Mapping[str, float | int], step: int) -> str:
        """Render one step's line: priority keys first, then the rest in logging order."""
        first = [k for k in self.priority_keys if k in metrics]
        rest = [] if self.only_priority else [k for k in metrics if k not in self.priority_keys]
        parts = [f"step {step}"] + [f"{k} {_format_value(metrics[k])}" for k in first + rest]
        return " | ".join(parts)

    def log(self, metrics: Mapping[str, float | int], step: int) -> None:
        print(self.format(metrics, step), flush=True)

    def close(self) -> None:
        pass


class JsonlBackend:
    """`<log_dir>/metrics.jsonl`, one object per step; opened in append mode so a resumed run continues it.

    `new_run`: this run does not continue the one whose metrics the file holds (it starts at step 0), so
    an existing file is moved aside to `metrics.<N>.jsonl` (the first free N) rather than appended to: two
    runs' steps in one file read as one run whose counters go back to zero (a curve drawn from it doubles
    back, and cumulative sums such as generated tokens add both runs).
    """

    def __init__(self, log_dir: Path, new_run: bool = False) -> None:
        self.path = log_dir / METRICS_FILE
        self.previous: Path | None = None
        if new_run and self.path.exists() and self.path.stat().st_size > 0:
            self.previous = _free_name(self.path)
            self.path.rename(self.previous)
            logger.warning("%s holds an earlier run's metrics: moved to %s", self.path, self.previous.name)
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, metrics: Mapping[str, float | int], step: int) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()  # a crashed run keeps every step it logged

    def rewind(self, keep_through: int) -> None:
        """Keep the rows of steps <= `keep_through`; later ones (a failed attempt's, about to be logged
        again from a checkpoint) move to `metrics.<N>.jsonl`, so a step appears once and nothing is lost."""
        self._file.close()
        keep, later = [], []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                step = int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                step = keep_through  # an unreadable line stays where it is (plots skip it)
            (keep if step <= keep_through else later).append(line)
        if later:
            moved = _free_name(self.path)
            moved.write_text("\n".join(later) + "\n", encoding="utf-8")
            self.path.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
            logger.warning("%d rows after step %d moved to %s", len(later), keep_through, moved.name)
        self._file = self.path.open("a", encoding="utf-8")

    def close(self) -> None:
        self._file.close()


def _free_name(path: Path) -> Path:
    """`metrics.jsonl` -> the first of `metrics.1.jsonl`, `metrics.2.jsonl`, ... that does not exist."""
    n = 1
    while (candidate := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
        n += 1
    return candidate


class TensorboardBackend:
    """TensorBoard event files under `<log_dir>/tensorboard`. A new run in a directory that holds another
    run's events moves them aside (`tensorboard.1`, ...: two runs in one folder draw one interleaved curve);
    a resumed run hides the steps after its checkpoint (`rewind`: SummaryWriter's purge_step), so redone
    steps are not drawn twice, as JsonlBackend drops its rows."""

    def __init__(self, log_dir: Path, config_text: str | None = None, new_run: bool = False) -> None:
        self.folder = log_dir / "tensorboard"
        if new_run and self.folder.is_dir() and any(self.folder.iterdir()):
            moved = _free_name(self.folder)
            self.folder.rename(moved)
            logger.warning("an earlier run's TensorBoard events moved to %s", moved.name)
        self.writer = self._open(None)
        if config_text is not None:
            self.writer.add_text("config", f"```\n{config_text}\n```")

    def _open(self, purge_step: int | None):  # noqa: ANN202 (SummaryWriter: imported lazily)
        from torch.utils.tensorboard import SummaryWriter  # slow import, only when asked for

        return SummaryWriter(log_dir=str(self.folder), purge_step=purge_step)

    def rewind(self, keep_through: int) -> None:
        """Steps after `keep_through` are hidden from here on (they are logged again)."""
        self.writer.close()
        self.writer = self._open(keep_through + 1)

    def log(self, metrics: Mapping[str, float | int], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _external_config(run_info: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """W&B's run config / MLflow's params: the resolved config, and the rest of the run info as `run_info`."""
    if run_info is None:
        return None
    config = run_info.get("config")
    out = dict(config) if isinstance(config, Mapping) else {}
    out["run_info"] = {k: v for k, v in run_info.items() if k != "config"}
    return out


def _config_to_text(config: Any) -> str:
    """Serialise a run config (mapping or dataclass) as indented JSON, stringifying what JSON cannot hold."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    return json.dumps(config, indent=2, default=str, sort_keys=False)


def check_backends(backends: Sequence[str], key: str = "tracking backend") -> None:
    """ConfigError for an unknown backend name (listing the valid ones) or one whose package is missing."""
    for name in backends:
        if name not in VALID_BACKENDS:
            raise ConfigError(f"unknown {key} entry '{name}'; valid: {', '.join(VALID_BACKENDS)}")
        hint = missing_package(name)
        if hint:
            raise ConfigError(f"{key} entry '{name}': {hint}")


class Tracker:
    """Log scalar metrics per step to any of the backends "console", "jsonl", "tensorboard", "wandb" and
    "mlflow", several at once.

    Values may be ints, floats, 0-d tensors or numpy scalars; anything else (vectors, strings, None)
    is skipped with a one-time warning per key, so a stray metric never stops a run.
    The run config, if given, goes to `<log_dir>/config.json` (jsonl), a TensorBoard text panel, W&B's run
    config and MLflow's params; with it, `<log_dir>/run_info.json` records the config, the posttrain version,
    its git commit and package versions (passed to W&B and MLflow under `run_info`).
    `plots`: when it closes, PNG figures of `<log_dir>/metrics.jsonl` in `<log_dir>/plots` (jsonl only;
    a failure to draw is a warning, never an error).
    `new_run`: the run starts from step 0 rather than continuing the one logged in `<log_dir>` (a trainer
    that did not resume a checkpoint); an earlier run's `metrics.jsonl` is moved aside, not appended to.
    """

    def __init__(
        self,
        backends: Sequence[str],
        log_dir: str | Path,
        run_name: str = "run",
        config: Mapping[str, Any] | None = None,
        console_keys: Sequence[str] = DEFAULT_CONSOLE_KEYS,
        console_only_keys: bool = False,
        plots: bool = False,
        new_run: bool = False,
    ) -> None:
        if isinstance(backends, str):
            backends = [backends]
        unknown = [b for b in backends if b not in VALID_BACKENDS]
        if unknown:
            raise ConfigError(
                f"unknown tracking backend(s) {', '.join(map(repr, unknown))}; "
                f"valid backends: {', '.join(VALID_BACKENDS)}"
            )
        check_backends(backends)  # an optional backend whose package is missing: how to install it
        self.run_name = run_name
        self.log_dir = Path(log_dir)
        self.plots = plots
        self.plot_files: dict[str, Path] = {}  # figure name -> PNG, after close() drew them
        self._skipped: set[str] = set()
        self._closed = False
        names = tuple(dict.fromkeys(backends))  # dedupe, keep order
        config_text = _config_to_text(config) if config is not None else None

        if any(b != "console" for b in names) or config is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        self.run_info: dict[str, Any] | None = None
        if config is not None:
            self.run_info = collect_run_info(config, names)
            text = json.dumps(self.run_info, indent=1, default=str)
            (self.log_dir / RUN_INFO_FILE).write_text(text + "\n", encoding="utf-8")
        run_config = _external_config(self.run_info)
        self._backends: list[_Backend] = []
        try:
            for name in names:
                if name == "console":
                    self._backends.append(ConsoleBackend(console_keys, console_only_keys))
                elif name == "jsonl":
                    self._backends.append(JsonlBackend(self.log_dir, new_run))
                    if config_text is not None:
                        (self.log_dir / "config.json").write_text(config_text + "\n", encoding="utf-8")
                elif name == "tensorboard":
                    self._backends.append(TensorboardBackend(self.log_dir, config_text, new_run))
                elif name == "wandb":
                    self._backends.append(WandbBackend(self.log_dir, run_name, run_config))
                elif name == "mlflow":
                    self._backends.append(MlflowBackend(self.log_dir, run_name, run_config, self.run_info))
        except BaseException:
            for backend in self._backends:  # the ones already open: files closed, runs ended
                backend.close()
            raise

    def rewind(self, keep_through: int) -> None:
        """The run continues from step `keep_through` (a resumed checkpoint; -1: from scratch): the jsonl
        file keeps only the steps up to it (JsonlBackend.rewind), TensorBoard hides the later ones. W&B and
        MLflow keep what they logged."""
        for backend in self._backends:
            if isinstance(backend, JsonlBackend | TensorboardBackend):
                backend.rewind(keep_through)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Write the scalar values of `metrics` for training step `step` to every backend."""
        if self._closed:
            raise RuntimeError(f"Tracker for run {self.run_name!r} is closed")
        scalars: dict[str, float | int] = {}
        for key, value in metrics.items():
            scalar = _to_scalar(value)
            if scalar is None:
                if key not in self._skipped:
                    self._skipped.add(key)
                    logger.warning("metric %r is not a scalar (%s); not logged", key, type(value).__name__)
                continue
            scalars[key] = scalar
        for backend in self._backends:
            backend.log(scalars, int(step))

    def close(self) -> None:
        """Flush and close every backend (W&B and MLflow runs end as failed when an exception is on its way
        through the caller's `finally`), then draw the plots; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        errors = []
        for backend in self._backends:
            try:
                backend.close()
            except Exception as exc:  # noqa: BLE001 - one backend's failure must not keep the others open
                errors.append(exc)
                logger.warning("closing the %s logger failed: %s", type(backend).__name__, exc)
        if self.plots and any(isinstance(b, JsonlBackend) for b in self._backends):
            self._draw_plots()
        if errors and sys.exc_info()[1] is None:
            raise errors[0]

    def _draw_plots(self) -> None:
        try:
            from posttrain.tracking.plots import plot_runs

            result = plot_runs([self.log_dir], self.log_dir / PLOTS_DIR)
        except Exception as exc:  # noqa: BLE001 - figures are a convenience; the run's outcome stands
            logger.warning("plots of %s not drawn: %s", self.log_dir, exc)
            return
        self.plot_files = dict(result.files)
        if result.files and any(isinstance(b, ConsoleBackend) for b in self._backends):
            print(f"plots: {len(result.files)} figures in {self.log_dir / PLOTS_DIR}", flush=True)

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
