"""Tracking: metrics loggers (console, jsonl, tensorboard). The bottom layer: imports only posttrain.errors."""

from posttrain.tracking.loggers import DEFAULT_CONSOLE_KEYS, VALID_BACKENDS, Tracker

__all__ = ["DEFAULT_CONSOLE_KEYS", "VALID_BACKENDS", "Tracker"]
