"""What every benchmark writes alongside its rows (../shared/BENCHMARKS.md): the machine and the results file."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parents[1]
POSTTRAIN = [sys.executable, "-m", "posttrain"]  # the CLI, in a child process per command

# The long-response task's SFT warm start (bench/vs_trl.py, bench/async_rl.py): the worked solutions, stopped
# early once held-out NLL per token reaches LONG_SFT_STOP_NLL (checked every 20 steps), under a step cap the
# caller sets (trainer.total_steps); a fixed 150 steps left the tiny model solving none of the held-out sums
LONG_SFT_STOP_NLL = 0.04
LONG_ADDITION_SFT = [
    "data.response_key=extra_info.solution", "data.max_response_length=400", "optim.lr=3e-3",
    "optim.lr_schedule=cosine", "optim.warmup_steps=50", "optim.batch_size=32", "trainer.val_every=20",
    f"trainer.stop_at_val_nll={LONG_SFT_STOP_NLL}", "trainer.loggers=[jsonl]", "trainer.plots=false",
]  # fmt: skip


def recipe_tag(*recipe: Any) -> str:
    """A short hash of everything a cached artefact (a warm start, a dataset, a run) was made with, for its
    directory name: a changed recipe then makes a new one instead of silently reusing the old."""
    return hashlib.sha1(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()[:8]


def machine_info(threads: int) -> dict[str, Any]:
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": threads,
        "torch": torch.__version__,
        "device": "cpu",
    }


MEASURED_CODE = [
    "posttrain",
    "bench",
    "recipes",
    ":!bench/results",
]  # what a bench runs (results: its output)


def code_commit() -> str:
    """The commit the benchmarked code is at, `+dirty` when what a bench runs (posttrain/, bench/, recipes/;
    new files included) has uncommitted changes, so README figures can be labelled with the code they came
    from; `unknown` outside a git checkout."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=normal", *MEASURED_CODE],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


# The code when the bench started: its worker processes import the working tree as it is when they start, so
# a commit or an edit during a long run mixes code into its figures (`write_result` then says so).
CODE_AT_START = code_commit()


def run_code() -> str:
    """The code a run measured: the commit at its start, marked when the code changed before it ended."""
    now = code_commit()
    return (
        CODE_AT_START
        if now == CODE_AT_START
        else f"{CODE_AT_START} (changed during the run: {now} at the end)"
    )


def write_result(filename: str, result: dict[str, Any]) -> Path:
    """Write `result` to bench/results/`filename`, with the code it measured (`code`, `run_code`) unless it
    has one."""
    result.setdefault("code", run_code())
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / filename
    path.write_text(json.dumps(result, indent=1))
    return path


def median_row(
    case: str, metric: str, values: list[float], baselines: list[float], baseline_name: str, higher: bool
) -> dict[str, Any]:
    """One BENCHMARKS.md row: the medians of `values` and `baselines` (the peer measured in the same run),
    their ratio, and the min-max spread of each."""
    value, baseline = statistics.median(values), statistics.median(baselines)
    return {
        "case": case,
        "metric": metric,
        "value": round(value, 3),
        "baseline_name": baseline_name,
        "baseline_value": round(baseline, 3),
        "ratio": round(value / baseline, 4) if baseline else None,
        "higher_is_better": higher,
        "repeats": len(values),
        "spread": [round(min(values), 3), round(max(values), 3)],
        "baseline_spread": [round(min(baselines), 3), round(max(baselines), 3)],
    }


def run_posttrain(cmd: list[str], log: Path) -> None:
    """Run a posttrain command (POSTTRAIN + arguments) from the repository, its output to `log`; raise naming
    the log on failure. The command is printed, so any run can be repeated by hand."""
    print("  $ posttrain " + " ".join(cmd[len(POSTTRAIN) :]), flush=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"command failed ({done.returncode}), see {log}:\n{log.read_text()[-3000:]}")


def held_out_accuracy(model: Path, data: Path, out: Path, max_response_length: int = 8) -> float:
    """Greedy accuracy on `data`/test.parquet by the rule scorer (`posttrain eval`), cached in
    `out/results.json`."""
    results = out / "results.json"
    if not results.exists():
        out.mkdir(parents=True, exist_ok=True)
        run_posttrain(
            [
                *POSTTRAIN, "eval", str(model), "--data", str(data / "test.parquet"), "--out", str(out),
                "--temperature", "0", "--max-prompt-length", "128",
                "--max-response-length", str(max_response_length),
            ],
            out / "eval.log",
        )  # fmt: skip
    return float(json.loads(results.read_text())["accuracy"])
