"""Built-in tasks by name: each writer makes `train.parquet` / `test.parquet` in a directory (verl-format prompt
rows; `arithmetic_pairs`: preference pairs in TRL's columns)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from posttrain.data.tasks.arithmetic import write_arithmetic_dataset
from posttrain.data.tasks.arithmetic_pairs import write_arithmetic_pairs
from posttrain.data.tasks.long_addition import write_long_addition_dataset
from posttrain.data.tasks.tool_multiplication import write_tool_multiplication_dataset
from posttrain.errors import DataError

TaskWriter = Callable[..., dict[str, Path]]

TASK_WRITERS: dict[str, TaskWriter] = {
    "arithmetic": write_arithmetic_dataset,
    "arithmetic_pairs": write_arithmetic_pairs,
    "long_addition": write_long_addition_dataset,
    "tool_multiplication": write_tool_multiplication_dataset,
}


def get_task_writer(name: str) -> TaskWriter:
    """The writer registered as `name`; an unknown name lists the valid ones."""
    if name not in TASK_WRITERS:
        raise DataError(f"unknown task {name!r}; known tasks: {sorted(TASK_WRITERS)}")
    return TASK_WRITERS[name]


def write_task(name: str, out_dir: str | Path, **kwargs: Any) -> dict[str, Path]:
    """Write the named task's dataset to `out_dir`; returns {split: path}."""
    return get_task_writer(name)(out_dir, **kwargs)


__all__ = [
    "TASK_WRITERS",
    "get_task_writer",
    "write_arithmetic_dataset",
    "write_arithmetic_pairs",
    "write_long_addition_dataset",
    "write_tool_multiplication_dataset",
    "write_task",
]
