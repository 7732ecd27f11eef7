"""GRPO with images on the built-in visual task: held-out accuracy of tiny-vl on shapes `count` before and
after GRPO from an SFT warm start, over several seeds.

One tiny-vl model (make-model's from-scratch tower, trained in both stages) and one dataset (2,000 train /
256 held-out images of 1-4 squares); per seed, an SFT warm start (`trainer.seed`), then GRPO with the shapes
rule scorer on one worker, validated (greedy, all 256 held-out prompts) before training and every
`--val-every` steps. The warm starts are cached in `--work`.

    python bench/vl_grpo.py                       # 3 seeds, 150 SFT steps, 30 GRPO steps
    python bench/vl_grpo.py --seeds 1 --grpo-steps 10

Writes bench/results/vl_grpo_<kind>.json (BENCHMARKS.md format).
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
from common import machine_info, write_result

from posttrain.config.load import load_config
from posttrain.config.schema import RLConfig, SFTConfig
from posttrain.data.tasks.shapes import corpus, write_shapes_dataset
from posttrain.models import make_tiny_model
from posttrain.trainers.rl import RLTrainer
from posttrain.trainers.sft import SFTTrainer
from posttrain.workers.process import quiet_transformers

PADDED = ["model.remove_padding=false", "model.share_prompt=false", "data.max_prompt_length=128"]


def warm_start(work: Path, kind: str, seed: int, steps: int, files: list[str]) -> Path:
    """SFT on the shapes task (cached): batch 32, lr 1e-3 constant, the answer and eos as the target."""
    model, sft = work / "model", work / f"sft-{kind}-seed{seed}-{steps}"
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--sft-steps", type=int, default=150)
    parser.add_argument("--grpo-steps", type=int, default=30)
    parser.add_argument("--val-every", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--kind", default="count", choices=["count", "color"])
    parser.add_argument("--reuse", action="store_true", help="take finished seeds' figures from --work")
    parser.add_argument("--work", default="/tmp/posttrain-bench-vl")
    args = parser.parse_args()
    quiet_transformers()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data = work / f"shapes-{args.kind}"
    if not (data / "test.parquet").exists():
        write_shapes_dataset(data, n_train=2000, n_test=256, kind=args.kind, seed=0)
    files = [f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{data / 'test.parquet'}]"]
    started = time.perf_counter()
    runs = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        run_dir = work / f"grpo-{args.kind}-seed{seed}"
        summary = run_dir / "summary.json"  # a finished seed's figures (kept by --reuse)
        if args.reuse and summary.exists():
            runs.append(json.loads(summary.read_text()))
            continue
        model = warm_start(work, args.kind, seed, args.sft_steps, files)
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
        }
        summary.write_text(json.dumps(run))
        runs.append(run)
        print(f"seed {seed}: {json.dumps(run)}", flush=True)
    before = [r["val_acc"][0][1] for r in runs]
    after = [r["val_acc"][-1][1] for r in runs]
    result = {
        "bench": "vl_grpo",
        "machine": machine_info(torch.get_num_threads()),
        "command": "python " + " ".join(sys.argv),
        "settings": vars(args),
        "seconds": round(time.perf_counter() - started, 1),
        "rows": [
            {
                "case": f"tiny-vl shapes {args.kind}, SFT {args.sft_steps} steps then GRPO {args.grpo_steps} steps",
                "metric": "held-out greedy accuracy after GRPO",
                "value": round(statistics.median(after), 4),
                "baseline_name": "SFT warm start",
                "baseline_value": round(statistics.median(before), 4),
                "higher_is_better": True,
                "repeats": len(runs),
                "spread": [
                    round(min(a - b for a, b in zip(after, before, strict=True)), 4),
                    round(max(a - b for a, b in zip(after, before, strict=True)), 4),
                ],
            }
        ],  # fmt: skip
        "runs": runs,
    }
    path = write_result(f"vl_grpo_{args.kind}.json", result)
    for r in runs:
        print(f"seed {r['seed']}: " + ", ".join(f"step {s}: {a:.3f}" for s, a in r["val_acc"]))
    print(f"wrote {path} ({result['seconds']} s)")


if __name__ == "__main__":
    main()
