"""GRPO with images on the built-in visual task: held-out accuracy of tiny-vl on shapes `count` before and
after GRPO from an SFT warm start, over several seeds.

One tiny-vl model (make-model's from-scratch tower, trained in both stages) and one dataset (2,000 train /
256 held-out 84x84 images of 1-6 squares on a 3x3 grid of 28-pixel cells, one cell per image token); per
seed, a short SFT warm start (`trainer.seed`; 40 steps leaves it part-way, ~65% greedy), then GRPO with the
shapes rule scorer on one worker, validated (all 256 held-out prompts, one sample each) before training and
every `--val-every` steps. The warm starts are cached in `--work`.

    python bench/vl_grpo.py                       # 3 seeds, 40 SFT steps, 100 GRPO steps at lr 5e-4
    python bench/vl_grpo.py --val-temperature 0   # the same runs validated greedily
    python bench/vl_grpo.py --seeds 1 --grpo-steps 10

Held-out accuracy is sampled at temperature 1 by default, as GRPO samples (`--val-temperature 0`: greedy).
Writes bench/results/vl_grpo_<kind>[_greedy].json (BENCHMARKS.md format) and a .png of the same name (needs
matplotlib, `pip install -e .[bench]`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from common import RESULTS, code_commit, machine_info, write_result

from posttrain.config.load import load_config
from posttrain.config.schema import RLConfig, SFTConfig
from posttrain.data.tasks.shapes import corpus, write_shapes_dataset
from posttrain.models import make_tiny_model
from posttrain.trainers.rl import RLTrainer
from posttrain.trainers.sft import SFTTrainer
from posttrain.workers.process import quiet_transformers

PADDED = ["model.remove_padding=false", "model.share_prompt=false", "data.max_prompt_length=128"]


def warm_start(work: Path, data_name: str, seed: int, steps: int, files: list[str]) -> Path:
    """SFT on the shapes task (cached): batch 32, lr 1e-3 constant, the answer and eos as the target."""
    model, sft = work / "model", work / f"sft-{data_name}-seed{seed}-{steps}"
    if not (model / "config.json").exists():
        make_tiny_model("tiny-vl", model, corpus(2000), seed=0)
    if not (sft / "hf" / "config.json").exists():
        cfg = load_config(
            SFTConfig,
            "sft",
            [
                f"model.path={model}",
                *files,
                *PADDED[:1],
                PADDED[2],
                f"trainer.run_dir={sft}",
                f"trainer.seed={seed}",
                f"trainer.total_steps={steps}",
                "trainer.val_every=0",
                "trainer.plots=false",
                "optim.batch_size=32",
                "optim.micro_batch_size=32",
            ],
        )
        SFTTrainer(cfg).fit()
    return sft / "hf"


def grpo(
    model: Path, files: list[str], run_dir: Path, seed: int, steps: int, args: argparse.Namespace
) -> list[dict]:
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: its metrics.jsonl would be appended to
    cfg = load_config(
        RLConfig,
        "rl",
        [
            f"model.path={model}",
            *files,
            *PADDED,
            f"trainer.run_dir={run_dir}",
            f"trainer.seed={seed}",
            f"trainer.total_steps={steps}",
            f"trainer.val_every={args.val_every}",
            "trainer.val_before_train=true",
            "trainer.backend=local",
            "trainer.save_every=0",
            "trainer.loggers=[jsonl]",
            "trainer.plots=false",
            "trainer.resume=false",
            "data.max_response_length=4",
            f"data.train_batch_prompts={args.prompts}",
            f"rollout.n={args.n}",
            f"rollout.val_temperature={args.val_temperature}",
            f"actor.optim.lr={args.lr}",
            "data.val_max_prompts=256",
        ],
    )
    trainer = RLTrainer(cfg)
    trainer.fit()
    if trainer.stop_signal is not None:  # a run stopped early would be counted as a finished one
        raise SystemExit(
            f"{run_dir}: stopped by signal {trainer.stop_signal} after step {trainer.step_count}"
        )
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summarise(runs: list[dict], args: argparse.Namespace, seconds: float, code: str) -> dict:
    """The bench's JSON (BENCHMARKS.md format): mean held-out accuracy after GRPO against the SFT warm start
    over the seeds, each seed's run, and the code commit the run was made on (`common.code_commit()`, as the
    other benches record it)."""
    before = [r["val_acc"][0][1] for r in runs]
    after = [r["val_acc"][-1][1] for r in runs]
    gains = [a - b for a, b in zip(after, before, strict=True)]
    result = {
        "bench": "vl_grpo",
        "machine": machine_info(torch.get_num_threads()),
        "command": "python " + " ".join(sys.argv),
        "settings": vars(args),
        "code": code,
        "seconds": seconds,
        "rows": [
            {
                "case": f"tiny-vl shapes {args.kind}, SFT {args.sft_steps} steps then GRPO {args.grpo_steps} steps",
                "metric": "held-out accuracy after GRPO, "
                + (
                    "greedy"
                    if args.val_temperature == 0
                    else f"sampled at temperature {args.val_temperature:g}"
                ),
                "statistic": "mean",
                "value": round(statistics.mean(after), 4),
                "baseline_name": "SFT warm start",
                "baseline_value": round(statistics.mean(before), 4),
                "ratio": round(statistics.mean(after) / max(statistics.mean(before), 1e-9), 3),
                "higher_is_better": True,
                "repeats": len(runs),
                "spread": [round(min(after), 4), round(max(after), 4)],
                "baseline_spread": [round(min(before), 4), round(max(before), 4)],
                "gain_per_seed": [round(g, 4) for g in gains],
            }
        ],  # fmt: skip
        "runs": runs,
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--sft-steps", type=int, default=40)
    parser.add_argument("--grpo-steps", type=int, default=100)
    parser.add_argument("--val-every", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument(
        "--val-temperature",
        type=float,
        default=1.0,
        help="held-out accuracy sampled as GRPO samples (1.0), or greedy (0)",
    )
    parser.add_argument("--kind", default="count", choices=["count", "color"])
    parser.add_argument("--size", type=int, default=84, help="image side in pixels (84: 9 image tokens)")
    parser.add_argument("--square-side", type=int, default=28, help="grid cell side in pixels")
    parser.add_argument("--max-squares", type=int, default=6)
    parser.add_argument("--reuse", action="store_true", help="take finished seeds' figures from --work")
    parser.add_argument("--work", default="/tmp/posttrain-bench-vl")
    args = parser.parse_args()
    quiet_transformers()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data_name = f"{args.kind}-{args.size}px-side{args.square_side}-max{args.max_squares}"
    data = work / f"shapes-{data_name}"
    if not (data / "test.parquet").exists():
        write_shapes_dataset(
            data, n_train=2000, n_test=256, kind=args.kind, size=args.size, square_side=args.square_side,
            max_squares=args.max_squares, seed=0,
        )  # fmt: skip
    files = [f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{data / 'test.parquet'}]"]
    started = time.perf_counter()
    code = code_commit()  # the code this invocation runs, read before the minutes of training
    runs = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        run_dir = work / f"grpo-{data_name}-sft{args.sft_steps}-t{args.val_temperature:g}-seed{seed}"
        summary = run_dir / "summary.json"  # a finished seed's figures (kept by --reuse)
        if args.reuse and summary.exists():
            runs.append(json.loads(summary.read_text()))
            continue
        model = warm_start(work, data_name, seed, args.sft_steps, files)
        rows = grpo(model, files, run_dir, seed, args.grpo_steps, args)
        val = [(r["step"], r["val/acc"]) for r in rows if "val/acc" in r]
        train = [r for r in rows if "reward/mean" in r]
        run = {
            "seed": seed,
            "val_acc": val,
            "train_reward_first5": statistics.mean(r["reward/mean"] for r in train[:5]),
            "train_reward_last5": statistics.mean(r["reward/mean"] for r in train[-5:]),
            "logprob_diff_max": max(r["rollout/logprob_diff_max"] for r in train),
            "seconds_per_step": statistics.median(r["timing/step"] for r in train),
            "code": code,  # a seed taken back with --reuse keeps the code it ran on
        }
        summary.write_text(json.dumps(run))
        runs.append(run)
        print(f"seed {seed}: {json.dumps(run)}", flush=True)
    result = summarise(runs, args, round(time.perf_counter() - started, 1), code)
    name = f"vl_grpo_{args.kind}" + ("_greedy" if args.val_temperature == 0 else "")
    path = write_result(f"{name}.json", result)
    plot(runs, args, RESULTS / f"{name}.png")
    for r in runs:
        print(f"seed {r['seed']}: " + ", ".join(f"step {s}: {a:.3f}" for s, a in r["val_acc"]))
    print(f"wrote {path} ({result['seconds']} s)")


def plot(runs: list[dict], args: argparse.Namespace, out: Path) -> None:
    """Held-out greedy accuracy against GRPO step, one line per seed and their mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        steps, acc = zip(*run["val_acc"], strict=True)
        ax.plot(steps, acc, color="tab:blue", alpha=0.35, marker="o", markersize=3)
    steps = [s for s, _ in runs[0]["val_acc"]]
    mean = [statistics.mean(r["val_acc"][i][1] for r in runs) for i in range(len(steps))]
    ax.plot(steps, mean, color="tab:blue", linewidth=2.5, label=f"mean of {len(runs)} seeds")
    ax.set_xlabel(f"GRPO step ({args.prompts} prompts x {args.n} samples, lr {args.lr:g})")
    how = "greedy" if args.val_temperature == 0 else f"sampled at temperature {args.val_temperature:g}"
    ax.set_ylabel(f"held-out accuracy ({how}, 256 images)")
    ax.set_title(f"tiny-vl counting squares: GRPO after {args.sft_steps} SFT steps")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main()
