"""Asynchronous RL against the best synchronous configuration on the same 2 cores: samples trained per second.

The long-response task (long_addition: every column and carry written out; 5-9 digit sums, 42-83 tokens), in two
cases: "mixed" as it is, and "tail" where a tenth of the problems have 10-50 digits (~100-520 tokens, up to ~8x
the median), so a few responses hold up each synchronous step. Each case starts from an SFT warm start on its own
worked solutions (stopped at held-out NLL 0.04 per token, as bench/vs_trl.py; `common.LONG_ADDITION_SFT`).
Configurations:

    sync-colocated   one worker holding trainer + rollout, using both cores (the best synchronous setting)
    sync-split k=0   one rollout worker + one training worker, synchronous (each waits for the other)
    async k=1, k=2   the same two workers, rollouts sampled 1 or 2 versions ahead (async_rl.staleness), the
                     reference beside the rollout (resources.ref: its forward runs on the producer's side)
    async k=1 ref on trainer   k=1 with the reference on the training worker (its forward in the trainer's step)
    async k=1 trainer2, gen2   k=1 with one side given 2 threads, the other 1 (resources.pools.gen.threads_per_worker):
                     the cores split unevenly, 3 threads on 2 cores
    async k=1/k=2 stream   the same, batches formed from the first complete groups (async_rl.streaming)

Each runs `--steps` GRPO steps; samples/s counts the steps after the first (start-up excluded), alternating
configurations across repeats. The speedup bound with two workers is (generation + reference + update) / the
busier worker's share, the reference's forward on whichever side balances them better, from the split k=0
run's own timings; two cores sharing memory bandwidth lower it further.
Each run also reports held-out accuracy after its last step (`val/acc` on the 64 test problems, outside the
timed steps), so that a speedup bought with worse learning shows; every configuration trains the same number
of samples. The speed runs are short (6 steps); the learning comparison runs longer with a curve, e.g.
`--steps 40 --val-every 20 --repeats 8 --configs sync-colocated,sync-split,async-k1,async-k2`. The actor's lr
is 1e-5: at 1e-4 the synchronous run itself ends below its warm start after 40 steps (~1M mixed: 53% -> 45%),
and each update moves some tokens' log-probs by several nats, so samples one version old are far off-policy.

    python bench/async_rl.py                 # tiny preset, mixed lengths and the long tail, 2 repeats
    python bench/async_rl.py --cases tail --repeats 4 --steps 12 --out async_rl_tail12.json
    python bench/async_rl.py --cases mixed --steps 40 --val-every 20 --repeats 8 --out async_rl_learning.json
    python bench/async_rl.py --preset small --repeats 3
    python bench/async_rl.py --cases tail --configs sync-colocated,sync-split,async-k2,async-k2-stream

Writes bench/results/async_rl.json (BENCHMARKS.md format).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from common import LONG_ADDITION_SFT, RESULTS, machine_info, recipe_tag, write_result

from posttrain.config.load import load_config
from posttrain.config.schema import RLConfig, SFTConfig
from posttrain.controller.ray_env import start_ray, stop_ray
from posttrain.data.tasks import long_addition
from posttrain.models import make_tiny_model
from posttrain.trainers.rl import RLTrainer
from posttrain.trainers.sft import SFTTrainer
from posttrain.workers.process import quiet_transformers

MAX_PROMPT = 160
SFT_MAX_STEPS = (
    1500  # the warm start's cap; it stops earlier at common.LONG_SFT_STOP_NLL (as bench/vs_trl.py)
)
SPLIT = ["resources.rollout=gen", "+resources.pools.gen.n_workers_per_node=1", "trainer.threads_per_worker=1"]
# the asynchronous runs put the reference beside the rollout (its forward runs on the producer's side, off the
# trainer's path); async-k1-ref-on-trainer keeps it on the trainer's worker, as the synchronous runs do
ASYNC = [*SPLIT, "resources.ref=gen", "algorithm.rollout_correction.rollout_is=token"]
CONFIGS = {
    "sync-colocated": ["trainer.n_workers_per_node=1", "trainer.threads_per_worker=2"],
    "sync-split": SPLIT,
    "async-k1": [*ASYNC, "async_rl.staleness=1"],
    # the two cores split unevenly (resources.pools.gen.threads_per_worker): 3 threads on 2 cores
    "async-k1-trainer2": [*ASYNC, "async_rl.staleness=1", "trainer.threads_per_worker=2",
                          "+resources.pools.gen.threads_per_worker=1"],
    "async-k1-gen2": [*ASYNC, "async_rl.staleness=1", "+resources.pools.gen.threads_per_worker=2"],
    "async-k1-ref-on-trainer": [*SPLIT, "async_rl.staleness=1", "algorithm.rollout_correction.rollout_is=token"],
    "async-k2": [*ASYNC, "async_rl.staleness=2"],
    "async-k1-stream": [*ASYNC, "async_rl.staleness=1", "async_rl.streaming=true"],
    # streaming: batches from the first complete groups, the others carried over within the bound
    "async-k2-stream": [*ASYNC, "async_rl.staleness=2", "async_rl.streaming=true"],
    # ablations for the accuracy gap of k=1 (README): without the KL loss (both sides), without importance
    # weights, and with token- or sequence-level rejection of the off-policy samples
    "sync-colocated-no-kl": ["trainer.n_workers_per_node=1", "trainer.threads_per_worker=2", "actor.use_kl_loss=false"],
    "async-k1-no-kl": [*SPLIT, "async_rl.staleness=1", "algorithm.rollout_correction.rollout_is=token",
                       "actor.use_kl_loss=false"],
    "async-k1-no-is": [*SPLIT, "resources.ref=gen", "async_rl.staleness=1"],
    "async-k1-rs-token": [*ASYNC, "async_rl.staleness=1", "algorithm.rollout_correction.rollout_rs=token_k1",
                          "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0"],
    "async-k1-rs-seq": [*ASYNC, "async_rl.staleness=1", "algorithm.rollout_correction.rollout_rs=seq_mean_k3",
                        "algorithm.rollout_correction.rollout_rs_threshold=0.01"],
}  # fmt: skip


# the long tail: a tenth of the problems have 10 to TAIL_DIGITS digits, worked solutions of ~100 to ~520 tokens
# against the mixed set's 42-83, so a few responses are up to ~8x the median (the "10x longer")
TAIL_PROB, TAIL_DIGITS = 0.1, 50
MAX_RESPONSE = {"mixed": 400, "tail": 600}


def prepare(
    work: Path, preset: str, case: str, sft_steps: int = SFT_MAX_STEPS, sft_lr: float | None = None
) -> tuple[Path, dict[str, Path]]:
    """The model, the case's data and its SFT warm start (each cached in `work`). The tail case's warm start
    is trained on the tail's own problems: one trained on the mixed set stops long sums early, and the "long
    tail" then has no long responses."""
    tag = f"-{sft_steps}" if sft_steps != SFT_MAX_STEPS else ""
    tag += f"-lr{sft_lr:g}" if sft_lr is not None else ""
    # each cache is named by what made it: a changed task or recipe makes a new one
    task = {"tail_prob": TAIL_PROB, "tail_digits": TAIL_DIGITS} if case == "tail" else {}
    data = work / f"data-{case}-{recipe_tag(task, 2000, 64, 5, 9)}"
    recipe = recipe_tag(LONG_ADDITION_SFT, MAX_RESPONSE[case], MAX_PROMPT, data.name)
    model, sft = work / f"model-{preset}", work / f"sft-{preset}-{case}{tag}-{recipe}"
    if not (model / "config.json").exists():
        make_tiny_model(preset, model, long_addition.corpus(10000, seed=0))
    if not (data / "test.parquet").exists():
        long_addition.write_long_addition_dataset(
            data, n_train=2000, n_test=64, min_digits=5, max_digits=9, **task
        )
    files = {"train": data / "train.parquet", "test": data / "test.parquet"}
    if not (sft / "hf" / "config.json").exists():
        overrides = [
            f"model.path={model}", f"data.train_files=[{files['train']}]", f"data.val_files=[{files['test']}]",
            f"trainer.run_dir={sft}", f"trainer.total_steps={sft_steps}", *LONG_ADDITION_SFT,
            *([f"optim.lr={sft_lr:g}"] if sft_lr is not None else []),
            f"data.max_response_length={MAX_RESPONSE[case]}", f"data.max_prompt_length={MAX_PROMPT}",
        ]  # fmt: skip
        SFTTrainer(load_config(SFTConfig, "sft", overrides)).fit()
    return sft / "hf", files


def run(
    name: str,
    case: str,
    model: Path,
    files: dict[str, Path],
    run_dir: Path,
    steps: int,
    seed: int,
    lr: float = 1e-5,
    val_every: int = 0,
) -> dict:
    """One configuration's run; `val_every` > 0 also validates before training and every that many steps
    (the learning curve), else only after the last step."""
    cfg = load_config(
        RLConfig,
        "rl",
        [
            f"model.path={model}",
            f"data.train_files=[{files['train']}]",
            f"data.val_files=[{files['test']}]",
            f"trainer.run_dir={run_dir}",
            f"trainer.total_steps={steps}",
            f"trainer.seed={seed}",
            "trainer.backend=ray",
            "data.train_batch_prompts=8",
            "rollout.n=4",
            f"data.max_response_length={MAX_RESPONSE[case]}",
            f"data.max_prompt_length={MAX_PROMPT}",  # the tail's long problems (the default 64 drops them)
            f"actor.optim.lr={lr:g}",
            # held-out accuracy after the last step (not timed in it), and along the way with val_every
            f"trainer.val_every={val_every or steps}",
            f"trainer.val_before_train={str(val_every > 0).lower()}",
            "trainer.save_every=0",
            "trainer.loggers=[jsonl]",
            "trainer.plots=false",
            "trainer.resume=false",
            *CONFIGS[name],
        ],
    )
    RLTrainer(cfg).fit()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in rows if "timing/step" in r][1:]
    samples = sum(r["batch/samples"] for r in steady)  # counted, not assumed (streaming may drop some)
    seconds = sum(r["timing/step"] for r in steady)
    out = {
        "samples_per_s": samples / seconds,
        "gen_s": statistics.fmean(r.get("timing/gen", 0.0) for r in steady),
        "ref_s": statistics.fmean(r.get("timing/ref", 0.0) + r.get("async/ref_s", 0.0) for r in steady),
        "update_s": statistics.fmean(
            r.get("timing/update_actor", 0.0) + r.get("timing/old_log_prob", 0.0) for r in steady
        ),
        "reward": statistics.fmean(r["reward/mean"] for r in steady),
        "response_length": statistics.fmean(r["response_length/mean"] for r in steady),
        "response_length_max": max(r["response_length/max"] for r in steady),
        "samples_trained": sum(r["batch/samples"] for r in rows if "batch/samples" in r),
        "val_acc_after": [r["val/acc"] for r in rows if "val/acc" in r][-1],
        "val_acc_curve": [[r["step"], r["val/acc"]] for r in rows if "val/acc" in r],
    }
    for key in ("async/trainer_idle_share", "async/rollout_idle_share", "async/staleness",
                "async/groups_carried_over", "async/time_to_batch_s", "async/dropped_samples"):  # fmt: skip
        if key in steady[0]:
            out[key] = statistics.fmean(r[key] for r in steady)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--lr",
        type=float,
        default=1e-5,
        help="the actor's lr (1e-4 lowers held-out accuracy even synchronously)",
    )
    parser.add_argument(
        "--val-every", type=int, default=0, help="also validate before training and every N steps (a curve)"
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--cases", default="mixed,tail")
    parser.add_argument("--work", default="/tmp/posttrain-bench-async")
    parser.add_argument(
        "--sft-steps", type=int, default=SFT_MAX_STEPS, help="the warm start's step cap (it may stop earlier)"
    )
    parser.add_argument("--sft-lr", type=float, default=None, help="the warm start's lr (default 3e-3)")
    parser.add_argument("--sft-only", action="store_true", help="prepare the warm starts, time nothing")
    parser.add_argument("--out", default="async_rl.json", help="results file name in bench/results")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"a subset of {', '.join(CONFIGS)}")
    args = parser.parse_args()
    names = args.configs.split(",")
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown or "sync-colocated" not in names or "sync-split" not in names:
        parser.error(
            f"--configs: unknown {unknown}; sync-colocated and sync-split are needed (baseline, bound)"
        )
    quiet_transformers()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.sft_only:  # untimed: can run beside other work
        for case in args.cases.split(","):
            prepare(work, args.preset, case, args.sft_steps, args.sft_lr)
        return
    start_ray()
    started = time.perf_counter()
    rows = []
    for case in args.cases.split(","):
        model, files = prepare(work, args.preset, case, args.sft_steps, args.sft_lr)
        results: dict[str, list[dict]] = {name: [] for name in names}
        for repeat in range(args.repeats):
            for name in names:  # alternating, as BENCHMARKS.md asks
                results[name].append(
                    run(
                        name,
                        case,
                        model,
                        files,
                        work / f"{case}-{name}-{repeat}",
                        args.steps,
                        repeat,
                        args.lr,
                        args.val_every,
                    )
                )
                print(f"{case} {name} repeat {repeat}: {results[name][-1]}", flush=True)
        base_runs = [r["samples_per_s"] for r in results["sync-colocated"]]
        base = statistics.median(base_runs)
        split = results["sync-split"]
        gen, ref, upd = (statistics.median(r[key] for r in split) for key in ("gen_s", "ref_s", "update_s"))
        busier = min(max(gen + ref, upd), max(gen, ref + upd))  # the reference on the better side
        bound = (gen + ref + upd) / busier if busier > 0 else 1.0
        base_accs = [r["val_acc_after"] for r in results["sync-colocated"]]
        for name, runs in results.items():
            values = [r["samples_per_s"] for r in runs]
            accs = [r["val_acc_after"] for r in runs]
            paired = [a - b for a, b in zip(accs, base_accs, strict=True)]
            value = statistics.median(values)
            rows.append(
                {
                    "case": f"{args.preset} long_addition {case}, {name}",
                    "metric": "samples_trained_per_s",
                    "value": round(value, 3),
                    "baseline_name": "sync-colocated",
                    "baseline_value": round(base, 3),
                    "ratio": round(value / base, 3),
                    "higher_is_better": True,
                    "repeats": len(values),
                    "spread": [round(min(values), 3), round(max(values), 3)],
                    # each repeat against the synchronous run of the same seed (same prompts and lengths)
                    "ratio_per_repeat": [round(v / b, 3) for v, b in zip(values, base_runs, strict=True)],
                    "two_worker_speedup_bound": round(bound, 3),
                    # generated but never trained (too old); the longest response trained: a length bias shows
                    "dropped_samples_per_step": round(
                        statistics.fmean(r.get("async/dropped_samples", 0.0) for r in runs), 2
                    ),
                    "response_length_max": [r["response_length_max"] for r in runs],
                    "val_acc_after": accs,
                    "val_acc_mean": round(statistics.fmean(accs), 4),
                    "val_acc_sd": round(statistics.stdev(accs), 4) if len(accs) > 1 else 0.0,
                    # against the synchronous run of the same seed: mean and sd of the differences
                    "val_acc_paired_diff_mean": round(statistics.fmean(paired), 4),
                    "val_acc_paired_diff_sd": round(statistics.stdev(paired), 4) if len(paired) > 1 else 0.0,
                    "details": runs,
                }
            )
    stop_ray()
    result = {
        "bench": "async_rl",
        "machine": machine_info(torch.get_num_threads()),
        "command": "python " + " ".join(sys.argv),
        "seconds": round(time.perf_counter() - started, 1),
        "rows": rows,
    }
    write_result(args.out, result)
    plot(rows, RESULTS / args.out.replace(".json", ".png"))
    print(f"\n{'case':<48}{'samples/s':>10}{'ratio':>8}{'bound':>8}{'val acc':>9}{'paired':>8}{'dropped':>9}")
    for row in rows:
        print(
            f"{row['case']:<48}{row['value']:>10.3f}{row['ratio']:>8.3f}{row['two_worker_speedup_bound']:>8.3f}"
            f"{row['val_acc_mean']:>9.3f}{row['val_acc_paired_diff_mean']:>+8.3f}"
            f"{row['dropped_samples_per_step']:>9.2f}"
        )


def plot(rows: list[dict], out: Path) -> None:
    """Per case: each configuration's samples/s against the best synchronous one (median bar, one dot per
    repeat against its own seed's synchronous run; the goal and the two-worker bound as lines), and the
    held-out accuracy after the run (one dot per repeat)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"].split(", ")[0] for r in rows))
    fig, axes = plt.subplots(2, len(cases), figsize=(5.5 * len(cases), 7), squeeze=False)
    for col, case in enumerate(cases):
        mine = [r for r in rows if r["case"].startswith(case + ",")]
        names = [r["case"].split(", ")[1] for r in mine]
        speed, acc = axes[0][col], axes[1][col]
        speed.bar(range(len(mine)), [r["ratio"] for r in mine], color="tab:blue", alpha=0.6)
        for i, r in enumerate(mine):
            speed.plot([i] * len(r["ratio_per_repeat"]), r["ratio_per_repeat"], "k.", markersize=5)
            acc.plot([i] * len(r["val_acc_after"]), r["val_acc_after"], "o", color="tab:green", alpha=0.7)
        speed.axhline(1.15, color="tab:red", ls="--", label="goal 1.15x")
        speed.axhline(mine[0]["two_worker_speedup_bound"], color="gray", ls=":", label="two-worker bound")
        speed.set_title(case)
        speed.set_ylabel("samples trained/s vs sync-colocated")
        speed.legend(fontsize=8)
        acc.set_ylabel("held-out accuracy after the run")
        acc.set_ylim(0, 1)
        for ax in (speed, acc):
            ax.set_xticks(range(len(mine)), names, rotation=20, fontsize=8)
            ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
