"""Metrics loggers: one `Tracker` fanning each step's scalars out to console, JSONL and TensorBoard.

Must not import anything from posttrain except errors (tracking is the bottom layer).
"""

import dataclasses
import json
import logging
import numbers
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from posttrain.errors import ConfigError

logger = logging.getLogger(__name__)

VALID_BACKENDS = ("console", "jsonl", "tensorboard")

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
    """`<log_dir>/metrics.jsonl`, one object per step; opened in append mode so a resumed run continues it."""

    def __init__(self, log_dir: Path) -> None:
        self.path = log_dir / "metrics.jsonl"
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, metrics: Mapping[str, float | int], step: int) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()  # a crashed run keeps every step it logged

    def close(self) -> None:
        self._file.close()


class TensorboardBackend:
    """TensorBoard event files under `<log_dir>/tensorboard`."""

    def __init__(self, log_dir: Path, config_text: str | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter  # slow import, only when asked for

        self.writer = SummaryWriter(log_dir=str(log_dir / "tensorboard"))
        if config_text is not None:
            self.writer.add_text("config", f"```\n{config_text}\n```")

    def log(self, metrics: Mapping[str, float | int], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _config_to_text(config: Any) -> str:
    """Serialise a run config (mapping or dataclass) as indented JSON, stringifying what JSON cannot hold."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    return json.dumps(config, indent=2, default=str, sort_keys=False)


class Tracker:
    """Log scalar metrics per step to any of the backends "console", "jsonl" and "tensorboard".

    Values may be ints, floats, 0-d tensors or numpy scalars; anything else (vectors, strings, None)
    is skipped with a one-time warning per key, so a stray metric never stops a run.
    The run config, if given, goes to `<log_dir>/config.json` (jsonl) and a TensorBoard text panel.
    """

    def __init__(
        self,
        backends: Sequence[str],
        log_dir: str | Path,
        run_name: str = "run",
        config: Mapping[str, Any] | None = None,
        console_keys: Sequence[str] = DEFAULT_CONSOLE_KEYS,
        console_only_keys: bool = False,
    ) -> None:
        if isinstance(backends, str):
            backends = [backends]
        unknown = [b for b in backends if b not in VALID_BACKENDS]
        if unknown:
            raise ConfigError(
                f"unknown tracking backend(s) {', '.join(map(repr, unknown))}; "
                f"valid backends: {', '.join(VALID_BACKENDS)}"
            )
        self.run_name = run_name
        self.log_dir = Path(log_dir)
        self._skipped: set[str] = set()
        self._closed = False
        config_text = _config_to_text(config) if config is not None else None

        if any(b != "console" for b in backends):
            self.log_dir.mkdir(parents=True, exist_ok=True)
        self._backends: list[_Backend] = []
        for name in dict.fromkeys(backends):  # dedupe, keep order
            if name == "console":
                self._backends.append(ConsoleBackend(console_keys, console_only_keys))
            elif name == "jsonl":
                self._backends.append(JsonlBackend(self.log_dir))
                if config_text is not None:
                    (self.log_dir / "config.json").write_text(config_text + "\n", encoding="utf-8")
            elif name == "tensorboard":
                self._backends.append(TensorboardBackend(self.log_dir, config_text))

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
        """Flush and close every backend; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for backend in self._backends:
            backend.close()

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
