"""What every benchmark writes alongside its rows (../shared/BENCHMARKS.md): the machine and the results file."""

from __future__ import annotations

import json
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results"


def machine_info(threads: int) -> dict[str, Any]:
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": threads,
        "torch": torch.__version__,
        "device": "cpu",
    }


def code_commit() -> str:
    """The commit the benchmarked code is at, `+dirty` when posttrain/ or bench/ have uncommitted changes
    (so README figures can be labelled with the code they came from); `unknown` outside a git checkout."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "posttrain", "bench"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def write_result(filename: str, result: dict[str, Any]) -> Path:
    """Write `result` to bench/results/`filename`, with the code's commit (`code`) unless it has one."""
    result.setdefault("code", code_commit())
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / filename
    path.write_text(json.dumps(result, indent=1))
    return path
