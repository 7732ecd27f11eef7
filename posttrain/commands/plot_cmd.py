"""`posttrain plot RUN_DIR [RUN_DIR...]`: PNG figures of runs' metrics over steps, the runs overlaid.

Reads each run's metrics.jsonl (the jsonl logger's file) and draws reward, held-out accuracy, response length,
KL, entropy, throughput, MFU, time shares and losses (posttrain/tracking/plots.py), one PNG per figure.
A metric no run logged is skipped with a note; a directory without metrics.jsonl is an error naming it.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    from posttrain.tracking.plots import FIGURE_NAMES

    p = sub.add_parser("plot", help="PNG figures of runs' metrics over steps, several runs overlaid")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (each with metrics.jsonl)")
    p.add_argument(
        "--out",
        help="folder for the PNGs; unset: RUN_DIR/plots for one run, ./plots for several",
    )
    p.add_argument(
        "--metrics",
        nargs="+",
        metavar="NAME",
        help=f"figures ({', '.join(FIGURE_NAMES)}) or metric keys (`*` patterns too, e.g. 'actor/*'), "
        "each key a figure of its own; unset: every figure",
    )
    p.add_argument("--dpi", type=_positive, default=100, help="resolution of the PNGs, dots per inch")
    p.set_defaults(func=_plot)


def _plot(args: argparse.Namespace) -> int:
    from posttrain.tracking.plots import plot_runs

    out = (
        Path(args.out)
        if args.out
        else (Path(args.run_dirs[0]) / "plots" if len(args.run_dirs) == 1 else Path("plots"))
    )
    result = plot_runs(args.run_dirs, out, metrics=args.metrics, dpi=args.dpi)
    for note in result.notes:
        print(f"note: {note}")
    for name, path in result.files.items():
        keys = sorted({key for _, key in result.series[name]})
        print(f"wrote {path}: {', '.join(keys)}")
    if not result.files:
        print("no figure written: none of the asked-for metrics is in these runs")
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
