"""What the explicit API costs: the RL recipe's step through `posttrain.client` against `posttrain train`'s step
on the same work, both in their default configuration.

The work per step, for both: 32 prompts of the built-in arithmetic task x 8 samples (temperature 1, up to
`--max-tokens` tokens, stop at eos), the built-in scorer, GRPO advantages, one AdamW step over the whole
batch (lr 2e-4, clip 1.0), full weights, no KL term, new weights to the sampler. `posttrain train` runs it as
`actor.use_kl_loss=false` with its defaults (shared-prompt packing on, the update's own log-probs as the old
ones); the recipe (`recipes/rl_loop.py`) runs it with `save_weights_and_get_sampling_client`, one `sample`
call per prompt, `forward_backward(importance_sampling)` over every sample (`--all-groups`: groups with
equal rewards too, as the trainer's update) and `optim_step`. Same model directory (a fresh
model of `--preset`, so every response runs to `--max-tokens` in both), same data, same seed.

Each run is a fresh process, alternating recipe / trainer, `--repeats` times, for each backend (`local`: one
in-process worker; `ray`: 2 workers, `--workers`); seconds per step are the median over the steps after the
first `--warmup` of a run (first-call allocations), then the median over repeats, min-max spread alongside.

    python bench/api_overhead.py                              # small (~10M), local and ray, 3 repeats
    python bench/api_overhead.py --preset tiny --steps 4 --repeats 1 --backends local --out trial.json

Writes bench/results/api_overhead.json (BENCHMARKS.md format).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import machine_info, write_result

ROOT = Path(__file__).resolve().parents[1]


def prepare(work: Path, preset: str) -> tuple[Path, Path]:
    from posttrain.data.tasks.arithmetic import corpus, write_arithmetic_dataset
    from posttrain.demo import TASK
    from posttrain.models import make_tiny_model

    model, data = work / f"model-{preset}", work / "data"
    if not (data / "test.parquet").exists():
        write_arithmetic_dataset(data, **TASK)
    if not (model / "config.json").exists():
        make_tiny_model(preset, model, corpus(20000, seed=0))
    return model, data


def recipe(model: Path, data: Path, out: Path, args: argparse.Namespace, backend: str) -> list[float]:
    command = [
        sys.executable, str(ROOT / "recipes" / "rl_loop.py"), "--model", str(model), "--data", str(data),
        "--out", str(out), "--steps", str(args.steps), "--val-every", "100000", "--backend", backend,
        "--workers", str(args.workers), "--max-tokens", str(args.max_tokens), "--all-groups",
    ]  # fmt: skip
    subprocess.run(command, check=True, cwd=ROOT, capture_output=True, text=True)
    runs = json.loads((out / "curves.json").read_text())["runs"]
    return [row["s"] for row in runs[0]["train"]]


def trainer(model: Path, data: Path, out: Path, args: argparse.Namespace, backend: str) -> list[float]:
    overrides = [
        f"model.path={model}", f"data.train_files=[{data / 'train.parquet'}]", f"trainer.run_dir={out}",
        f"trainer.total_steps={args.steps}", "trainer.val_before_train=false", "trainer.val_every=0",
        "trainer.save_every=0", "trainer.loggers=[jsonl]", "trainer.resume=false", "actor.use_kl_loss=false",
        "actor.optim.lr=2e-4", "data.train_batch_prompts=32", "rollout.n=8",
        f"data.max_response_length={args.max_tokens}", "trainer.peak_flops_per_worker=1e12",
        f"trainer.backend={backend}", f"trainer.n_workers_per_node={args.workers if backend == 'ray' else 1}",
    ]  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "posttrain", "train", *overrides], check=True, cwd=ROOT, capture_output=True
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["timing/step"] for r in rows if "timing/step" in r]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small")
    p.add_argument("--backends", default="local,ray")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--work", type=Path, default=Path("/tmp/posttrain-bench-api"))
    p.add_argument("--out", default="api_overhead.json")
    args = p.parse_args()
    model, data = prepare(args.work, args.preset)
    rows = []
    for backend in args.backends.split(","):
        timings: dict[str, list[float]] = {"recipe": [], "trainer": []}
        for repeat in range(args.repeats):
            for name, run in (("recipe", recipe), ("trainer", trainer)):
                out = args.work / f"{name}-{backend}-{repeat}-{time.time_ns()}"
                steps = run(model, data, out, args, backend)[args.warmup :]
                timings[name].append(statistics.median(steps))
                print(f"{backend} {name} repeat {repeat}: {timings[name][-1]:.3f} s/step", flush=True)
        value, base = statistics.median(timings["recipe"]), statistics.median(timings["trainer"])
        rows.append(
            {
                "case": f"{args.preset} {backend} 32x8 t{args.max_tokens}",
                "metric": "seconds_per_step",
                "value": round(value, 4),
                "baseline_name": "posttrain train",
                "baseline_value": round(base, 4),
                "ratio": round(value / base, 3),
                "higher_is_better": False,
                "repeats": args.repeats,
                "spread": [min(timings["recipe"]), max(timings["recipe"])],
                "baseline_spread": [min(timings["trainer"]), max(timings["trainer"])],
            }
        )
        print(f"{backend}: recipe {value:.3f} s/step, trainer {base:.3f} s/step, ratio {value / base:.3f}")
    command = "python bench/api_overhead.py " + " ".join(sys.argv[1:])
    path = write_result(
        args.out, {"bench": "api_overhead", "machine": machine_info(2), "command": command, "rows": rows}
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
