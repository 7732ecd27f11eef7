"""Learning curves of PPO (GAE + critic), GRPO and DAPO on the built-in task, per generated token.

All three start from the same SFT warm start (the demo's model, task and warm start) and run the same number
of steps with the same prompts per step; the curves are plotted against cumulative generated tokens (DAPO's
dynamic sampling and PPO's equal n generate different amounts), and the table compares held-out greedy
accuracy at the largest token budget all three reached. Runs are repeated with different seeds.

    python bench/learning_curves.py                 # default: 40 steps x 3 seeds (~10 min on 2 cores)
    python bench/learning_curves.py --steps 20 --repeats 1

Writes bench/results/learning_curves.json (BENCHMARKS.md format) and bench/results/learning_curves.png.
Needs matplotlib (`pip install -e .[bench]`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from common import RESULTS, machine_info, write_result

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
    model, data, sft = work / "model", work / "data", work / "sft"
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
            curves[algorithm].append(run(algorithm, seed, model, files, run_dir, args.steps, args.workers))
            print(
                f"{algorithm} seed {seed}: final val acc {curves[algorithm][-1][-1]['val_acc']:.3f}",
                flush=True,
            )
    stop_ray()

    budget = min(c[-1]["gen_tokens"] for runs in curves.values() for c in runs)
    start_acc = curves["grpo"][0][0]["val_acc"]
    per_algo = {a: [accuracy_at(c, budget) for c in runs] for a, runs in curves.items()}
    rows = []
    for algorithm in ALGORITHMS:
        values = per_algo[algorithm]
        baseline = per_algo["grpo"]
        rows.append(
            {
                "case": f"{algorithm} arithmetic-2digit tiny, {int(budget)} generated tokens",
                "metric": "val_acc_at_equal_tokens",
                "value": round(statistics.median(values), 4),
                "baseline_name": "grpo",
                "baseline_value": round(statistics.median(baseline), 4),
                "ratio": round(statistics.median(values) / max(statistics.median(baseline), 1e-9), 4),
                "higher_is_better": True,
                "repeats": len(values),
                "spread": [round(min(values), 4), round(max(values), 4)],
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
    print(f"\nheld-out greedy accuracy at {int(budget)} generated tokens (start {start_acc:.3f}):")
    print(f"{'algorithm':<10}{'median':>8}{'min':>8}{'max':>8}")
    for algorithm, row in zip(ALGORITHMS, rows, strict=True):
        print(f"{algorithm:<10}{row['value']:>8.3f}{row['spread'][0]:>8.3f}{row['spread'][1]:>8.3f}")
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
