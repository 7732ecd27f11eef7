"""What every benchmark writes alongside its rows (../shared/BENCHMARKS.md): the machine and the results file."""

from __future__ import annotations

import json
import platform
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


def write_result(filename: str, result: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / filename
    path.write_text(json.dumps(result, indent=1))
    return path
