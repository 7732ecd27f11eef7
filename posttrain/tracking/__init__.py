"""Tracking: metrics loggers (console, jsonl, tensorboard, wandb, mlflow), run info, plots and samples tables.
The bottom layer: imports only posttrain.errors."""

from posttrain.tracking.loggers import (
    DEFAULT_CONSOLE_KEYS,
    PLOTS_DIR,
    VALID_BACKENDS,
    Tracker,
    check_backends,
)
from posttrain.tracking.plots import METRICS_FILE

__all__ = ["DEFAULT_CONSOLE_KEYS", "METRICS_FILE", "PLOTS_DIR", "VALID_BACKENDS", "Tracker", "check_backends"]
