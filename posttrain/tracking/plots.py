"""PNG figures of runs' metrics over steps, several runs overlaid: `posttrain plot` and the end of every run.

Reads each run's `metrics.jsonl` (the jsonl logger's file). One figure per quantity (FIGURES: reward, held-out
accuracy, response length, KL, entropy, throughput, time shares, losses), one panel per metric key in it, one
line per run (legend = the run directory's name). A key no run logged is skipped with a note; a run directory
without metrics is an error naming it. matplotlib draws with its Agg canvas directly (no pyplot, no GUI, no
global backend switch). Must not import anything from posttrain except errors (tracking is the bottom layer).
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from posttrain.errors import DataError

METRICS_FILE = "metrics.jsonl"  # the jsonl logger's file in a run directory, one object per logged step


@dataclass(frozen=True)
class Figure:
    name: str  # the PNG's file name without .png, and what `--metrics` selects it by
    title: str
    keys: tuple[str, ...]  # metric keys; `*` patterns expand to every matching key a run logged


# the metric keys are the ones the trainers log (trainers/step_metrics.py, validation.py, throughput.py,
# workers/losses.py, rewarding.py for the in-reward KL, sft.py, dpo.py)
FIGURES = (
    Figure("reward", "Reward", ("reward/mean", "val/reward")),
    Figure(
        "accuracy",
        "Accuracy (held-out, training; reward models and DPO: pairwise)",
        ("val/acc", "acc", "val/accuracy", "rm/accuracy", "dpo/rewards_accuracy", "val/rewards_accuracy"),
    ),
    Figure("response_length", "Response length (tokens)", ("response_length/mean", "val/response_length")),
    Figure(
        "kl",
        "KL (to the reference; ppo_kl: updated vs old policy)",
        ("actor/kl_loss", "algorithm/kl_in_reward_token_mean", "actor/ppo_kl"),
    ),
    Figure("entropy", "Policy entropy (nats per token)", ("actor/entropy",)),
    Figure(
        "throughput",
        "Throughput (tokens/s)",
        ("throughput/tokens_per_s", "throughput/*_tokens_per_s"),
    ),
    Figure("mfu", "Model FLOPs utilisation", ("perf/mfu", "perf/mfu/*")),
    Figure("time_shares", "Share of the step's time", ("timing_share/*",)),
    Figure(
        "loss",
        "Losses",
        (
            "actor/pg_loss",
            "critic/vf_loss",
            "sft/nll",
            "val/nll",
            "loss",
            "dpo/loss_*",
            "val/loss",
            "rm/loss",
            "rm/bt_loss",
            "distill/jsd",
            "distill/kl_to_teacher",
            "val/kl_to_teacher",
        ),
    ),
)
FIGURE_NAMES = tuple(f.name for f in FIGURES)


@dataclass
class RunMetrics:
    label: str  # the legend entry: the run directory's name (with its parent's when two runs share a name)
    path: Path
    series: dict[str, dict[int, float]]  # key -> {step: value}; a step logged twice (a resume) keeps the last
    bad_lines: int = 0  # lines that are not JSON objects (a crash mid-line), skipped


@dataclass
class PlotResult:
    files: dict[str, Path] = field(default_factory=dict)  # figure name -> PNG
    series: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # figure -> (run label, key) drawn
    notes: list[str] = field(default_factory=list)  # what was skipped, and why


def read_metrics(run_dir: str | Path) -> RunMetrics:
    """The numeric series of `<run_dir>/metrics.jsonl`; DataError naming the directory when it has none."""
    path = Path(run_dir)
    file = path / METRICS_FILE if path.is_dir() else path
    if not file.is_file():
        what = "does not exist" if not path.exists() else f"has no {METRICS_FILE}"
        raise DataError(f"{path}: {what} (a run writes {METRICS_FILE} when trainer.loggers includes jsonl)")
    series: dict[str, dict[int, float]] = {}
    bad = 0
    for line in file.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            step = int(row["step"])
        except (ValueError, KeyError, TypeError):
            bad += 1
            continue
        for key, value in row.items():
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                series.setdefault(key, {})[step] = float(value)
    if not series:
        raise DataError(f"{path}: {file.name} has no metrics")
    return RunMetrics(path.name if path.is_dir() else path.parent.name, path, series, bad)


def _label_runs(runs: list[RunMetrics]) -> None:
    """Runs of the same directory name get their parent's name too, so the legend tells them apart."""
    counts: dict[str, int] = {}
    for run in runs:
        counts[run.label] = counts.get(run.label, 0) + 1
    for run in runs:
        if counts[run.label] > 1:
            directory = run.path if run.path.is_dir() else run.path.parent
            run.label = f"{directory.parent.name}/{directory.name}"


def _expand(patterns: Iterable[str], runs: Sequence[RunMetrics]) -> list[str]:
    """The keys matching `patterns` that at least one run logged, in pattern order (matches sorted)."""
    logged = sorted({key for run in runs for key in run.series})
    out: list[str] = []
    for pattern in patterns:
        matches = fnmatch.filter(logged, pattern) if any(c in pattern for c in "*?[") else [pattern]
        out += [m for m in matches if m in logged and m not in out]
    return out


def _selected(metrics: Sequence[str] | None) -> list[Figure]:
    """The figures `--metrics` names: figure names as they are, any other name a figure of that key (pattern)."""
    if not metrics:
        return list(FIGURES)
    by_name = {f.name: f for f in FIGURES}
    return [by_name.get(m) or Figure(_file_name(m), m, (m,)) for m in metrics]


def _file_name(key: str) -> str:
    return re.sub(r"[^\w.-]+", "_", key).strip("_") or "metric"


def plot_runs(
    run_dirs: Sequence[str | Path],
    out_dir: str | Path,
    metrics: Sequence[str] | None = None,
    dpi: int = 100,
) -> PlotResult:
    """Draw the FIGURES (or the figures / metric keys named in `metrics`) of the runs' metrics.jsonl into
    `out_dir/<figure>.png`; returns the files, the (run, key) series each one shows, and notes on what
    was skipped. A run without metrics raises DataError naming it; a key no run logged is a note."""
    if not run_dirs:
        raise DataError("no run directory given")
    runs = [read_metrics(d) for d in run_dirs]
    _label_runs(runs)
    result = PlotResult()
    for run in runs:
        if run.bad_lines:
            result.notes.append(f"{run.path}: {run.bad_lines} unreadable lines of {METRICS_FILE} skipped")
    out = Path(out_dir)
    for figure in _selected(metrics):
        keys = _expand(figure.keys, runs)
        absent = [k for k in figure.keys if not any(fnmatch.fnmatch(key, k) for key in keys)]
        if not keys:
            result.notes.append(f"{figure.name}: skipped, no run logged {', '.join(figure.keys)}")
            continue
        if absent and metrics:  # asked for by name: say which parts are missing
            result.notes.append(f"{figure.name}: no run logged {', '.join(absent)}")
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{figure.name}.png"
        result.series[figure.name] = _draw(figure, keys, runs, path, dpi)
        result.files[figure.name] = path
    return result


def _draw(
    figure: Figure, keys: list[str], runs: Sequence[RunMetrics], path: Path, dpi: int
) -> list[tuple[str, str]]:
    """One run: one panel, a line per key (legend: the keys). Several runs: a panel per key, a line per run
    (legend: the run directories' names). Returns the (run label, key) lines drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure as MplFigure
    from matplotlib.ticker import MaxNLocator

    overlay = len(runs) > 1
    panels = keys if overlay else [figure.title]
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    width, height = 5.0 * cols, 3.4 * rows + 0.4
    fig = MplFigure(figsize=(width, height), dpi=dpi)
    FigureCanvasAgg(fig)
    # fixed margins in inches (constrained layout would double the drawing time)
    fig.subplots_adjust(
        left=0.75 / width, right=1 - 0.25 / width, bottom=0.55 / height, top=1 - 0.75 / height,
        wspace=0.35, hspace=0.6,
    )  # fmt: skip
    fig.suptitle(figure.title if overlay else f"{figure.title}: {runs[0].label}")
    axes = fig.subplots(rows, cols, squeeze=False).flatten()
    drawn: list[tuple[str, str]] = []
    for p, ax in enumerate(axes[: len(panels)]):
        lines = (
            [(i, run, keys[p]) for i, run in enumerate(runs)] if overlay else [(0, runs[0], k) for k in keys]
        )
        for n, (i, run, key) in enumerate(lines):
            points = run.series.get(key)
            if not points:
                continue
            steps = sorted(points)
            few = len(steps) <= 30  # sparse series (validation every k steps): show the points
            ax.plot(
                steps, [points[s] for s in steps], color=f"C{(i if overlay else n) % 10}",
                marker="o" if few else None, markersize=3, label=run.label if overlay else key,
            )  # fmt: skip
            drawn.append((run.label, key))
        if overlay:
            ax.set_title(keys[p], fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4), useOffset=False)
        if overlay or len(keys) > 1:
            ax.legend(fontsize=8)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    fig.savefig(path, format="png")
    return drawn
