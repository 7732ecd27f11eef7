"""posttrain GRPO against TRL's `GRPOTrainer`: same model, prompts, reward and hyper-parameters, on CPU.

Cases are preset:task pairs. `arithmetic` is the demo's task (1-2 digit addition, answers of 3-8 tokens,
32 prompts per step); `long_addition` writes every column and carry out (5-9 digit operands, responses of
~40-110 tokens, 8 prompts per step so that TRL's runs fit the time budget). For each case both frameworks
start from the same SFT warm-started directory (tiny-model factory with a tokenizer trained on the task ->
the task's files -> `posttrain sft`: the demo's recipe for arithmetic, a longer one on the worked solutions
for long_addition), read the same prompts in the same order (the task's train.parquet, unshuffled, so step k
of both sees the same problems) with the same chat template, score with the same function (posttrain's
built-in scorer of the task's data source, wrapped as a TRL reward function), and take one optimizer step
per generation batch:

| setting                     | posttrain                                  | TRL (`GRPOConfig`)                         |
|-----------------------------|--------------------------------------------|--------------------------------------------|
| prompts per step (32 or 8)  | data.train_batch_prompts=32                | generation_batch_size = 64 x 4 = 256       |
| samples per prompt          | rollout.n=8                                | num_generations=8                          |
| max completion (8 or 160)   | data.max_response_length=8                 | max_completion_length=8                    |
| sampling                    | rollout.temperature=1.0, top_p=1, top_k=0  | temperature=1.0, top_p=1.0, top_k=0        |
| advantages                  | grpo, norm_adv_by_std_in_grpo=true         | scale_rewards="group"                      |
| KL                          | actor.use_kl_loss=false (no reference)     | beta=0.0 (no reference model)              |
| loss aggregation            | actor.loss_agg_mode=token-mean             | loss_type="dapo"                           |
| clipping                    | clip_ratio_low/high=0.2                    | epsilon=0.2 (epsilon_high = epsilon)       |
| updates per batch           | ppo_epochs=1, mini_batch_size=0 (whole)    | num_iterations=1, steps_per_generation=4   |
| micro-batch                 | actor.micro_batch_size=64                  | per_device_train_batch_size=64, grad acc 4 |
| optimizer                   | AdamW lr 2e-4 (5e-5 long), betas, wd 0     | adamw_torch, same; lr_scheduler constant   |
| gradient clipping           | actor.optim.grad_clip=1.0                  | max_grad_norm=1.0                          |
| precision                   | fp32 (model.dtype default)                 | fp32: bf16=False, fp16=False               |
| device, threads             | trainer.backend=local, 1 worker, 2 threads | use_cpu=True, no vLLM, 2 threads           |
| seed                        | trainer.seed                               | seed, data_seed                            |

Why TRL's "dapo" and not "bnpo" for token-mean: TRL's "dapo" divides the summed per-token loss by the number
of completion tokens of the whole generation batch (`num_items_in_batch`, rescaled to the accumulation
window), which is exactly posttrain's token-mean over the mini-batch (global token count across all
micro-batches). "bnpo" divides each micro-batch by its own token count and averages the micro-batches: equal
only with one micro-batch, and it weights tokens of short micro-batches more. "grpo" is posttrain's
seq-mean-token-mean and "dr_grpo" its seq-mean-token-sum-norm.

Why posttrain runs with `trainer.backend=local` (one in-process worker) rather than Ray with one worker:
TRL runs in one process using all cores, and so does the local backend (same engine, FSDP2 at world size 1,
same rollout engine); Ray with n_workers=1 adds a driver<->worker hop (pickling each step's batch) and
several helper processes whose memory a per-process peak RSS would not see, so its figures would be neither
comparable nor complete. The Ray path is measured by the demo and bench/learning_curves.py.

Each framework runs in a fresh subprocess (its peak RSS is its own), alternating TRL / posttrain, once per
seed (`--seeds`, five by default: BENCHMARKS.md asks for five where two frameworks' learning is compared).
Speed and memory are medians over the seeds' runs with the min-max spread, each run's speed itself the median
over its steps (robust to bursts of other work on a shared machine; the mean is kept as
`seconds_per_step_mean`); learning figures are means with the spread and standard deviation. Step time excludes model loading and start-up: TRL's is timed by a
TrainerCallback from on_step_begin to on_step_end (generation, reward, forward/backward, optimizer step),
posttrain's is its own `timing/step` metric (generation, reward, log-prob pass, advantages, update, weight
sync). The first `--warmup-steps` steps of each run are left out of the throughput figures (first-call
allocations). Tokens counted per step: completion tokens (eos included, as both frameworks train on it) and
prompt tokens (each of the 8 samples counts its prompt). Rewards: the mean training reward of step 1 (same
weights and prompts in both: the check that the set-up matches) and of the last `--reward-window` steps.
Held-out accuracy: after each run its final weights (TRL's `save_model`, posttrain's last checkpoint) are
scored greedily on the task's test.parquet by `posttrain eval` in a fresh process: one evaluator for both,
the same one that scores the warm start (`heldout_accuracy_start`). Model FLOP/s is counted the same way for
both with posttrain.tracking.flops (generation with each prompt's prefill once per group, plus one training
pass over every sample's prompt and completion) and given as a fraction of this machine's fp32 matmul peak,
measured at the start and at the end (the larger is used). It is the same unit of work for both, not the
work done: posttrain's training pass runs each group's prompt once (model.share_prompt), so its fraction can
approach or pass 1.

    pip install -e '.[bench]'                        # TRL; the script installs nothing
    python bench/vs_trl.py                           # both cases on the ~1M preset, 5 seeds
    python bench/vs_trl.py --cases tiny:arithmetic --seeds 0 --steps 3 --out vs_trl_trial.json
    python bench/vs_trl.py --cases small:arithmetic --sft-set small:optim.lr=1e-3     # the ~10M preset
    python bench/vs_trl.py --frameworks posttrain --posttrain-set model.share_prompt=false   # a variant

The default run (arithmetic 100 steps and long_addition 60 steps, 5 seeds each) takes ~40 min on 2 cores
once the SFT warm starts are cached under --work, ~10 min more the first time.

Writes bench/results/vs_trl.json (BENCHMARKS.md format).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from common import RESULTS, machine_info, write_result

WORKERS_SCRIPT = Path(__file__).with_name("vs_trl_workers.py")
FRAMEWORKS = ("trl", "posttrain")
BASELINE = "trl_grpo_trainer"

# What cannot be made equal (also written to the JSON).
NOT_EQUAL = [
    "Generation engine: TRL on CPU generates with Hugging Face `generate` (its default path; vLLM needs a "
    "GPU build and is not installed, and `use_transformers_continuous_batching` is off by default); "
    "posttrain uses its built-in engine (continuous batching, slotted KV cache, one prefill per prompt for "
    "its 8 samples). This is a framework difference the benchmark measures, not a setting.",
    "Old log-probs: with one optimizer step per generation batch both frameworks skip the extra forward "
    "pass and use the detached current log-probs (posttrain: actor.reuse_log_probs_on_policy, its default; "
    "TRL: num_iterations=1 with steps_per_generation == gradient_accumulation_steps).",
    "posttrain runs the prompt of a group through the model once in training (model.share_prompt, its "
    "default: the n responses attend to one copy of the prompt; equal log-probs and gradients, tested) and "
    "packs sequences without padding (model.remove_padding); TRL pads every sample to the longest prompt "
    "and completion of its micro-batch and runs each sample's prompt. Framework differences, not settings.",
    "posttrain copies the new weights into its rollout engine after each update (`timing/sync`); TRL "
    "generates with the training model itself.",
    "Advantage normalisation: both divide by the group's unbiased std, plus 1e-6 in posttrain and 1e-4 in "
    "TRL (negligible for 0/1 rewards).",
    "Sampling random streams differ, so the two frameworks draw different samples from the same seed; "
    "rewards agree in distribution, not sample by sample. The first step (same weights, same prompts) is "
    "the check that both score the same model alike.",
    "Peak RSS is the whole process: it includes each framework's imports (posttrain imports Ray without "
    "starting it; TRL imports datasets, accelerate) and model loading.",
]


# ---- the driver ----------------------------------------------------------------------------------------------


def spawn(kind: str, spec: dict, log_path: Path) -> tuple[dict | None, str]:
    """Run one worker in a fresh process; (result, "") or (None, the tail of its log)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    result_path = log_path.with_suffix(".result.json")
    result_path.unlink(missing_ok=True)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "WANDB_MODE": "disabled",
    }
    command = [sys.executable, str(WORKERS_SCRIPT), "--worker", kind, "--spec", json.dumps(spec), "--result"]
    with log_path.open("w") as log:
        proc = subprocess.run([*command, str(result_path)], stdout=log, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0 or not result_path.exists():
        tail = log_path.read_text(errors="replace").strip().splitlines()[-25:]
        return None, f"exit code {proc.returncode}; log {log_path}:\n" + "\n".join(tail)
    return json.loads(result_path.read_text()), ""


def step_flops(model_config: dict, step: dict, n: int) -> float:
    """Model FLOPs of one step, the same count for both frameworks (posttrain.tracking.flops, as posttrain's
    own perf/mfu): generating the responses and one training pass over them, each prompt once per group of
    n and the head where a response token is predicted (the work the step needs, whatever either framework
    runs); posttrain's extra log-prob forward is not counted."""
    from posttrain.tracking.flops import generation_flops, train_flops

    prompts, responses = step["prompt_lens"], step["response_lens"]
    total = [p + r for p, r in zip(prompts, responses, strict=True)]
    training = train_flops(model_config, total, prompt_lens=prompts, samples_per_prompt=n)
    return generation_flops(model_config, prompts, responses, n) + training


def summarize_run(run: dict, warmup: int, window: int, model_config: dict, n: int) -> dict:
    """Speed over the steps after `warmup`, reward over the last `window` steps, first-step reward.

    Speed figures are medians over the timed steps (seconds per step, and each step's tokens and model FLOPs
    over its seconds): this machine is shared, and a burst of other work slows some steps several-fold; a
    median over steps ignores such bursts where a total over the run would carry them. Both frameworks see
    the same prompts at each step, so their steps' work is alike. Each step keeps its FLOP count
    (`model_flops`) in the raw results."""
    steps = run["steps"]
    for step in steps:
        if "model_flops" not in step:
            step["model_flops"] = step_flops(model_config, step, n)
    timed = steps[warmup:] if len(steps) > warmup else steps[-1:]
    last = steps[-window:]

    def per_second(*keys: str) -> float:
        return statistics.median(sum(s[k] for k in keys) / s["seconds"] for s in timed)

    return {
        "seconds_per_step": statistics.median(s["seconds"] for s in timed),
        "seconds_per_step_mean": sum(s["seconds"] for s in timed) / len(timed),
        "gen_tokens_per_s": per_second("completion_tokens"),
        "total_tokens_per_s": per_second("completion_tokens", "prompt_tokens"),
        "peak_rss_mb": run["peak_rss_mb"],
        "reward_last": sum(s["reward"] for s in last) / len(last),
        "reward_first_step": steps[0]["reward"],
        "mean_completion_tokens": sum(s["completion_tokens"] for s in steps)
        / sum(s["samples"] for s in steps),
        "model_flops_per_s": per_second("model_flops"),
        "steps_run": len(steps),
        "steps_timed": len(timed),
    }


@dataclass(frozen=True)
class Task:
    """A case's task and its default sizes (each overridable by a flag for every case)."""

    prompts: int  # prompts per step
    max_completion: int  # max completion tokens
    steps: int
    sft_steps: int | None  # None: the demo's
    lr: float


TASKS = {
    # the demo's 1-2 digit addition, answers of ~3-8 tokens
    "arithmetic": Task(prompts=32, max_completion=8, steps=100, sft_steps=None, lr=2e-4),
    # every column and carry written out, 5-9 digit operands: responses of ~40-110 tokens; fewer prompts so
    # TRL's HF `generate` fits the time budget
    # lr 5e-5: at 2e-4 (the arithmetic case's) GRPO lost the warm start in both frameworks (posttrain from
    # 39% greedy: sampled reward 0.22 -> 0.40 in 30 steps at 5e-5; from 94%: 0.83 -> 0.72 at 2e-4)
    "long_addition": Task(prompts=8, max_completion=160, steps=60, sft_steps=1500, lr=5e-5),
}

# (metric, higher is better, statistic over seeds): speed and memory as medians (timing noise is one-sided),
# learning as means (BENCHMARKS.md: a learning claim is a mean and spread over seeds)
METRICS = (
    ("seconds_per_step", False, "median"),
    ("gen_tokens_per_s", True, "median"),
    ("total_tokens_per_s", True, "median"),
    ("peak_rss_mb", False, "median"),
    ("model_flops_fraction_of_peak", True, "median"),
    ("reward_first_step", True, "mean"),
    ("reward_last", True, "mean"),
    ("heldout_accuracy", True, "mean"),
    ("heldout_accuracy_start", True, "mean"),
)


def evaluate(model: str, test_file: str, max_completion: int, threads: int, out: Path) -> dict:
    """Held-out greedy accuracy of a saved model with `posttrain eval` (the same evaluator for both
    frameworks' final weights: posttrain's rollout engine and the task's scorer), in a fresh process."""
    command = [
        sys.executable, "-m", "posttrain", "eval", model, "--data", test_file, "--out", str(out),
        "--temperature", "0", "--max-response-length", str(max_completion), "--max-prompt-length", "256",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with (out.parent / f"{out.name}.log").open("w") as log:
        proc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"posttrain eval of {model} failed (exit {proc.returncode}); log {out}.log")
    return json.loads((out / "results.json").read_text())


def stats(values: list[float], statistic: str) -> dict:
    centre = statistics.median(values) if statistic == "median" else statistics.fmean(values)
    return {
        "value": round(centre, 4),
        "spread": [round(min(values), 4), round(max(values), 4)],
        "std": round(statistics.stdev(values), 4) if len(values) > 1 else 0.0,
    }


def run_case(case: str, args: argparse.Namespace, frameworks: list[str], seeds: list[int]) -> dict:
    """One preset:task case: prepare, then for each seed TRL and posttrain (alternating), each run followed
    by the held-out evaluation of its final weights; returns the raw runs and per-run summaries."""
    preset, task_name = case.split(":")
    task = TASKS[task_name]
    prompts = args.prompts or task.prompts
    max_completion = args.max_completion or task.max_completion
    steps = args.steps or task.steps
    lr = args.lr or task.lr
    sft_steps = args.sft_steps if args.sft_steps is not None else task.sft_steps
    if sft_steps is None:
        from posttrain.demo import SFT_OVERRIDES

        sft_steps = next(
            int(o.split("=", 1)[1]) for o in SFT_OVERRIDES if o.startswith("trainer.total_steps=")
        )
    if (prompts * args.n) % args.micro_batch:
        sys.exit(f"{case}: --micro-batch {args.micro_batch} must divide prompts x n = {prompts * args.n}")
    work = Path(args.work)
    sft_overrides = [o.split(":", 1)[1] for o in args.sft_set if o.split(":", 1)[0] == preset]
    prep_spec = {
        "work": str(work), "preset": preset, "task": task_name, "sft_steps": sft_steps,
        "sft_overrides": sft_overrides,
    }  # fmt: skip
    case_dir = work / case.replace(":", "-")
    print(f"{case}: model, task and SFT warm start ({sft_steps} steps) ...", flush=True)
    prep, error = spawn("prepare", prep_spec, case_dir / "prepare.log")
    if prep is None:
        sys.exit(f"{case}: preparation failed: {error}")
    start_eval = evaluate(
        prep["model"], prep["test_file"], max_completion, args.threads, case_dir / "eval-start"
    )
    print(f"{case}: warm start held-out accuracy {start_eval['accuracy']:.3f}", flush=True)
    model_config = json.loads((Path(prep["model"]) / "config.json").read_text())
    spec = {
        "model": prep["model"], "train_file": prep["train_file"], "prompts": prompts, "n": args.n,
        "max_completion": max_completion, "micro_batch": args.micro_batch, "lr": lr, "steps": steps,
        "threads": args.threads, "posttrain_overrides": args.posttrain_set,
    }  # fmt: skip
    runs: dict[str, list[dict]] = {f: [] for f in FRAMEWORKS}
    summaries: dict[str, list[dict]] = {f: [] for f in FRAMEWORKS}
    failures = []
    for seed in seeds:
        for name in frameworks:  # alternate TRL, posttrain, TRL, posttrain ...
            run_dir = case_dir / "runs" / f"{name}-seed{seed}"
            shutil.rmtree(run_dir, ignore_errors=True)
            started_run = time.perf_counter()
            result, error = spawn(
                name, {**spec, "seed": seed, "run_dir": str(run_dir)}, run_dir.with_suffix(".log")
            )
            wall = time.perf_counter() - started_run
            if result is None or not result["steps"]:
                error = error or "no training step completed"
                failures.append({"case": case, "framework": name, "seed": seed, "error": error})
                print(f"{case} {name} seed {seed}: FAILED\n{error}", flush=True)
                continue
            result["wall_s"] = wall
            result["seed"] = seed
            heldout = evaluate(
                result["final_model"], prep["test_file"], max_completion, args.threads, run_dir / "eval"
            )
            result["heldout"] = {
                k: heldout[k] for k in ("accuracy", "mean_response_tokens", "truncated_share")
            }
            summary = summarize_run(result, args.warmup_steps, args.reward_window, model_config, args.n)
            summary["heldout_accuracy"] = heldout["accuracy"]
            summary["heldout_accuracy_start"] = start_eval["accuracy"]
            runs[name].append(result)
            summaries[name].append(summary)
            for step in result["steps"]:  # per-sample lengths: only for the FLOP count
                del step["prompt_lens"], step["response_lens"]
            s = summary
            print(
                f"{case} {name} seed {seed}: {s['seconds_per_step']:.2f} s/step, "
                f"{s['gen_tokens_per_s']:.0f} gen tok/s, {s['total_tokens_per_s']:.0f} tok/s, "
                f"{s['peak_rss_mb']:.0f} MB, reward first {s['reward_first_step']:.3f} "
                f"last{args.reward_window} {s['reward_last']:.3f}, held-out {heldout['accuracy']:.3f} "
                f"(start {start_eval['accuracy']:.3f}; wall {wall:.0f} s)",
                flush=True,
            )
    settings = {
        "preset": preset, "task": task_name, "prompts_per_step": prompts, "n": args.n,
        "max_completion_tokens": max_completion, "steps": steps, "sft_steps": sft_steps, "lr": lr,
        "sft_extra_overrides": sft_overrides, "heldout_problems": start_eval["n_prompts"],
    }  # fmt: skip
    return {
        "settings": settings,
        "sft_seconds": prep["sft_seconds"],
        "start_heldout": start_eval["accuracy"],
        "runs": runs,
        "summaries": summaries,
        "failures": failures,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases",
        default="tiny:arithmetic,tiny:long_addition",
        help="preset:task pairs (presets tiny ~1M, small ~10M; tasks " + ", ".join(TASKS) + ")",
    )
    parser.add_argument("--seeds", default="0,1,2,3,4", help="one run per framework per seed")
    parser.add_argument("--steps", type=int, default=0, help="GRPO steps per run (0: the task's default)")
    parser.add_argument("--prompts", type=int, default=0, help="prompts per step (0: the task's default)")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt (num_generations)")
    parser.add_argument("--max-completion", type=int, default=0, help="max completion tokens (0: the task's)")
    parser.add_argument("--micro-batch", type=int, default=64, help="samples per forward/backward")
    parser.add_argument("--lr", type=float, default=0.0, help="learning rate (0: the task's)")
    parser.add_argument(
        "--sft-steps", type=int, default=None, help="SFT warm-start steps (0 = none); default: the task's"
    )
    parser.add_argument(
        "--sft-set",
        action="append",
        default=[],
        metavar="PRESET:KEY=VALUE",
        help="extra SFT override for one preset, e.g. small:optim.lr=1e-3 (repeatable; cached separately)",
    )
    parser.add_argument("--warmup-steps", type=int, default=1, help="first steps left out of the timing")
    parser.add_argument("--reward-window", type=int, default=10, help="last steps the reward is averaged on")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--work", default="/tmp/posttrain-bench-vs-trl", help="models, data, run dirs")
    parser.add_argument("--out", default="vs_trl.json", help="file name under bench/results")
    parser.add_argument("--frameworks", default="trl,posttrain", help="which to run (both for ratios)")
    parser.add_argument(
        "--posttrain-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra posttrain override, e.g. model.share_prompt=false (repeatable; recorded in the JSON)",
    )
    args = parser.parse_args()

    missing = [m for m in ("trl", "datasets") if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(
            f"bench/vs_trl.py needs {' and '.join(missing)}, which are not installed: "
            "pip install -e '.[bench]'   (or pip install '.[bench]')"
        )
    cases = args.cases.split(",")
    bad = [c for c in cases if c.count(":") != 1 or c.split(":")[1] not in TASKS]
    if bad:
        sys.exit(f"--cases: expected preset:task with task one of {', '.join(TASKS)}; got {bad}")
    seeds = [int(x) for x in args.seeds.split(",")]
    frameworks = [f for f in FRAMEWORKS if f in args.frameworks.split(",")]

    import torch
    import transformers
    import trl

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    from posttrain.tracking.flops import measure_matmul_flops

    peaks = [
        measure_matmul_flops(seconds=3.0, threads=args.threads)
    ]  # measured again at the end; the larger is used (the machine is shared)
    print(f"fp32 matmul peak (2048^2, {args.threads} threads): {peaks[0] / 1e9:.1f} GFLOP/s", flush=True)
    raw = {case: run_case(case, args, frameworks, seeds) for case in cases}
    failures = [f for data in raw.values() for f in data.pop("failures")]
    warnings = []
    for case, data in raw.items():
        first = [r["reward_first_step"] for f in frameworks for r in data["summaries"][f]]
        if first and statistics.median(first) < 0.1:
            warnings.append(
                f"{case}: the SFT warm start scores {statistics.median(first):.3f} on step 1: most groups are "
                "all-wrong and GRPO gets little signal; consider a larger --sft-steps"
            )
            print(f"WARNING: {warnings[-1]}", flush=True)

    peaks.append(measure_matmul_flops(seconds=3.0, threads=args.threads))
    peak = max(peaks)
    print(f"fp32 matmul peak at the end: {peaks[1] / 1e9:.1f} GFLOP/s; using {peak / 1e9:.1f}", flush=True)
    rows, table = [], []
    for case, data in raw.items():
        summaries, st = data["summaries"], data["settings"]
        for runs in summaries.values():
            for summary in runs:
                summary["model_flops_fraction_of_peak"] = summary["model_flops_per_s"] / peak
        if not summaries["posttrain"]:
            continue
        label = (
            f"{st['preset']} {st['task']} {st['prompts_per_step']}x{args.n} t{st['max_completion_tokens']} "
            f"{st['steps']} steps"
        )
        values = {}
        for metric, higher, statistic in METRICS:
            ours = stats([r[metric] for r in summaries["posttrain"]], statistic)
            theirs = stats([r[metric] for r in summaries["trl"]], statistic) if summaries["trl"] else None
            base = theirs["value"] if theirs else None
            rows.append(
                {
                    "case": label, "metric": metric, "statistic": statistic, "value": ours["value"],
                    "baseline_name": BASELINE, "baseline_value": base,
                    "ratio": round(ours["value"] / base, 3) if base else None, "higher_is_better": higher,
                    "repeats": len(summaries["posttrain"]), "baseline_repeats": len(summaries["trl"]),
                    "spread": ours["spread"], "std": ours["std"],
                    "baseline_spread": theirs["spread"] if theirs else [],
                    "baseline_std": theirs["std"] if theirs else None,
                }
            )  # fmt: skip
            values[metric] = (ours, theirs)
        table.append((case, values))

    result = {
        "bench": "vs_trl",
        "machine": machine_info(args.threads),
        "command": "python " + " ".join(sys.argv),
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__},
        "matmul_peak_flops": peak,
        "matmul_peak_flops_start_end": peaks,
        "settings": {
            "seeds": seeds,
            "cases": {case: data["settings"] for case, data in raw.items()},
            "micro_batch": args.micro_batch,
            "sft_extra_overrides": args.sft_set,
            "posttrain_extra_overrides": args.posttrain_set,
            "warmup_steps_untimed": args.warmup_steps,
            "reward_window": args.reward_window,
            "threads": args.threads,
            "heldout": "posttrain eval, greedy, on the task's test.parquet, of each run's final weights",
            "posttrain": "trainer.backend=local n_workers_per_node=1, grpo, use_kl_loss=false, token-mean, "
            "mini_batch_size=0, ppo_epochs=1, fp32, rollout.name=native",
            "trl": "GRPOTrainer, beta=0, loss_type=dapo, scale_rewards=group, num_iterations=1, "
            "steps_per_generation=gradient_accumulation_steps, use_cpu, no vLLM, fp32, "
            "gradient_checkpointing=False, lr_scheduler constant",
        },
        "not_equal": NOT_EQUAL,
        "failures": failures,
        "warnings": warnings,
        "seconds": round(time.perf_counter() - started, 1),
        "rows": rows,
        "raw": raw,
    }
    write_result(args.out, result)
    print_table(table, args.reward_window)
    for warning in warnings:
        print(f"\nWARNING: {warning}")
    for failure in failures:
        print(
            f"\nFAILED: {failure['case']} {failure['framework']} seed {failure['seed']}: {failure['error']}"
        )
    print(f"wrote {RESULTS / args.out} ({result['seconds']} s)")


def print_table(table: list[tuple[str, dict]], window: int) -> None:
    labels = {
        "seconds_per_step": ("s/step", "{:.2f}"),
        "gen_tokens_per_s": ("gen tok/s", "{:.0f}"),
        "total_tokens_per_s": ("tok/s", "{:.0f}"),
        "peak_rss_mb": ("peak MB", "{:.0f}"),
        "model_flops_fraction_of_peak": ("FLOP/peak", "{:.4f}"),
        "reward_first_step": ("reward step 1", "{:.3f}"),
        "reward_last": (f"reward last {window}", "{:.3f}"),
        "heldout_accuracy": ("held-out acc", "{:.3f}"),
        "heldout_accuracy_start": ("held-out start", "{:.3f}"),
    }
    print(f"\n{'case':<22}{'metric':<18}{'posttrain':>22}{'TRL':>22}{'ratio':>8}")
    for case, values in table:
        for metric, (ours, theirs) in values.items():
            label, fmt = labels[metric]

            def cell(v: dict | None, fmt: str = fmt) -> str:
                if v is None:
                    return "-"
                return f"{fmt.format(v['value'])} ({fmt.format(v['spread'][0])}-{fmt.format(v['spread'][1])})"

            ratio = f"{ours['value'] / theirs['value']:.2f}" if theirs and theirs["value"] else "-"
            print(f"{case:<22}{label:<18}{cell(ours):>22}{cell(theirs):>22}{ratio:>8}")


if __name__ == "__main__":
    main()
