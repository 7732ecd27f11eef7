"""Learning curves of PPO (GAE + critic), GRPO and DAPO on the built-in task, per generated token.

All three start from the same SFT warm start (the demo's model, task and warm start) and run the same number
of steps with the same prompts per step; the curves are plotted against cumulative generated tokens (DAPO's
dynamic sampling and PPO's equal n generate different amounts), and the table compares held-out greedy
accuracy at the largest token budget all three reached, and after the same number of steps: the mean and
min-max over seeds (BENCHMARKS.md: a learning claim is a mean over seeds).

The DAPO anomaly of an earlier run (one seed at its starting accuracy at the token budget) was a bug in what
the curve read, not in DAPO: each run directory still held an earlier invocation's metrics.jsonl, the trainer
(trainer.resume=false) appended the new run to it, and the curve then held two runs whose cumulative token
counts added up, so one seed's point at the budget was the second run's step 0. The trainer now moves an
earlier run's metrics aside when it starts from step 0 (tracking/loggers.py), and the bench clears each run
directory before it starts.

    python bench/learning_curves.py                 # default: 40 steps x 3 seeds (~12 min on 2 cores)
    python bench/learning_curves.py --steps 20 --repeats 1

Writes bench/results/learning_curves.json (BENCHMARKS.md format) and bench/results/learning_curves.png.
Needs matplotlib (`pip install -e .[bench]`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from common import RESULTS, machine_info, recipe_tag, write_result

from posttrain.config.load import load_config
from posttrain.config.schema import RLConfig, SFTConfig
from posttrain.controller.ray_env import start_ray, stop_ray
from posttrain.data.tasks.arithmetic import corpus, write_arithmetic_dataset
from posttrain.demo import RL_OVERRIDES, SFT_OVERRIDES, TASK
from posttrain.models import make_tiny_model
from posttrain.trainers.rl import RLTrainer
from posttrain.trainers.sft import SFTTrainer
from posttrain.workers.process import quiet_transformers

ALGORITHMS = ("ppo", "grpo", "dapo")


def warm_start(work: Path) -> tuple[Path, list[str]]:
    model, data = work / "model", work / "data"
    sft = work / f"sft-{recipe_tag(SFT_OVERRIDES, TASK)}"  # a changed recipe makes a new warm start
    if not (model / "config.json").exists():
        make_tiny_model("tiny", model, corpus(20000, seed=0))
    if not (data / "test.parquet").exists():
        write_arithmetic_dataset(data, **TASK)
    files = [f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{data / 'test.parquet'}]"]
    if not (sft / "hf" / "config.json").exists():
        cfg = load_config(
            SFTConfig, "sft", [f"model.path={model}", *files, f"trainer.run_dir={sft}", *SFT_OVERRIDES]
        )
        SFTTrainer(cfg).fit()
    return sft / "hf", files


def run(
    algorithm: str, seed: int, model: Path, files: list[str], run_dir: Path, steps: int, workers: int
) -> list[dict]:
    overrides = [
        o
        for o in RL_OVERRIDES
        if not o.startswith(("trainer.loggers", "trainer.val_every", "trainer.save_every"))
    ]
    cfg = load_config(
        RLConfig,
        "rl",
        [
            f"algorithm={algorithm}",
            f"model.path={model}",
            *files,
            *overrides,
            f"trainer.run_dir={run_dir}",
            f"trainer.total_steps={steps}",
            f"trainer.seed={seed}",
            f"trainer.n_workers_per_node={workers}",
            "trainer.val_every=5",
            "trainer.save_every=0",
            "trainer.loggers=[jsonl]",
            "trainer.resume=false",
        ],
    )
    RLTrainer(cfg).fit()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    tokens, curve = 0.0, []
    for row in rows:
        tokens += row.get("throughput/gen_tokens_total", 0.0)
        if "val/acc" in row:
            curve.append({"step": row["step"], "gen_tokens": tokens, "val_acc": row["val/acc"]})
    return curve


def accuracy_at(curve: list[dict], budget: float) -> float:
    xs = [c["gen_tokens"] for c in curve]
    ys = [c["val_acc"] for c in curve]
    return float(np.interp(budget, xs, ys))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--work", default="/tmp/posttrain-bench-curves")
    args = parser.parse_args()
    quiet_transformers()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    start_ray()
    started = time.perf_counter()
    model, files = warm_start(work)
    curves: dict[str, list[list[dict]]] = {a: [] for a in ALGORITHMS}
    for seed in range(args.repeats):
        for algorithm in ALGORITHMS:  # alternate A B C A B C, as BENCHMARKS.md asks
            run_dir = work / f"{algorithm}-seed{seed}"
            shutil.rmtree(run_dir, ignore_errors=True)  # a curve is one run's, never an earlier one's too
            curves[algorithm].append(run(algorithm, seed, model, files, run_dir, args.steps, args.workers))
            print(
                f"{algorithm} seed {seed}: final val acc {curves[algorithm][-1][-1]['val_acc']:.3f}",
                flush=True,
            )
    stop_ray()

    budget = min(c[-1]["gen_tokens"] for runs in curves.values() for c in runs)
    start_acc = curves["grpo"][0][0]["val_acc"]
    per_algo = {a: [accuracy_at(c, budget) for c in runs] for a, runs in curves.items()}
    final = {a: [c[-1]["val_acc"] for c in runs] for a, runs in curves.items()}
    rows = []
    for metric, values_of, case in (
        ("val_acc_at_equal_tokens", per_algo, f"arithmetic-2digit tiny, {int(budget)} generated tokens"),
        ("val_acc_after_steps", final, f"arithmetic-2digit tiny, {args.steps} steps"),
    ):
        baseline = statistics.fmean(values_of["grpo"])
        for algorithm in ALGORITHMS:
            values = values_of[algorithm]
            mean = statistics.fmean(values)
            rows.append(
                {
                    "case": f"{algorithm} {case}",
                    "metric": metric,
                    "statistic": "mean",
                    "value": round(mean, 4),
                    "baseline_name": "grpo",
                    "baseline_value": round(baseline, 4),
                    "ratio": round(mean / max(baseline, 1e-9), 4),
                    "higher_is_better": True,
                    "repeats": len(values),
                    "spread": [round(min(values), 4), round(max(values), 4)],
                    "std": round(statistics.stdev(values), 4) if len(values) > 1 else 0.0,
                    "per_seed": [round(v, 4) for v in values],
                }
            )
    result = {
        "bench": "learning_curves",
        "machine": machine_info(torch.get_num_threads()),
        "command": "python " + " ".join(sys.argv),
        "start_val_acc": start_acc,
        "token_budget": budget,
        "seconds": round(time.perf_counter() - started, 1),
        "rows": rows,
        "curves": curves,
    }
    write_result("learning_curves.json", result)
    plot(curves, budget, RESULTS / "learning_curves.png")
    print(f"\nheld-out greedy accuracy, mean over {args.repeats} seeds (start {start_acc:.3f}):")
    print(
        f"{'algorithm':<10}{'at ' + str(int(budget)) + ' tokens':>22}{'after ' + str(args.steps) + ' steps':>22}"
    )
    for algorithm in ALGORITHMS:
        cells = []
        for metric in ("val_acc_at_equal_tokens", "val_acc_after_steps"):
            row = next(r for r in rows if r["metric"] == metric and r["case"].startswith(algorithm + " "))
            cells.append(f"{row['value']:.3f} ({row['spread'][0]:.3f}-{row['spread'][1]:.3f})")
        print(f"{algorithm:<10}{cells[0]:>22}{cells[1]:>22}")
    print(f"wrote {RESULTS / 'learning_curves.json'} and learning_curves.png ({result['seconds']} s)")


def plot(curves: dict[str, list[list[dict]]], budget: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {"ppo": "tab:blue", "grpo": "tab:orange", "dapo": "tab:green"}
    for algorithm, runs in curves.items():
        for i, curve in enumerate(runs):
            ax.plot(
                [c["gen_tokens"] for c in curve],
                [c["val_acc"] for c in curve],
                color=colors[algorithm],
                alpha=0.9 if i == 0 else 0.45,
                label=algorithm if i == 0 else None,
                marker="o",
                markersize=3,
            )
    ax.axvline(budget, color="grey", linestyle="--", linewidth=1, label="equal-token budget")
    ax.set_xlabel("generated tokens (cumulative)")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_title("posttrain on the built-in arithmetic task (tiny Qwen2, 2 CPU workers)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main()
