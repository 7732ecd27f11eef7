"""On-policy distillation against GRPO from the same start (issue 18, item 6): a ~10M teacher trained on the
task teaches a ~1M student that shares its tokenizer; which closes half of the gap between them in fewer
generated samples?

- **teacher**: the small preset (~10M), its tokenizer the student's (`make-model --tokenizer-from`), SFT on
  the demo's arithmetic task (1-2 digit sums) until held-out NLL `--teacher-nll` (greedy held-out accuracy
  by `posttrain eval`, the rule scorer).
- **student**: the demo's tiny model (~1M) and its SFT warm start (the demo's recipe, stopped at held-out
  NLL 0.7: roughly a third of the held-out sums right).
- **distill**: `posttrain train` with `distill.teacher_path` (the teacher scores the student's own samples;
  per token, -(log p_student - log p_teacher) is the advantage; no task reward in the update).
- **grpo**: `posttrain train`, the same settings with the rule reward (GRPO's group-normalised advantage).
- **gkd**: `posttrain distill` (GKD, Agarwal et al. 2024) on the student's own samples (`--gkd-lmbda 1`):
  the generalised Jensen-Shannon divergence (`--gkd-beta`) between the teacher's and the student's whole
  next-token distributions at every response position, `--gkd-batch` samples a step, constant lr. Its
  trainer validates NLL only, so each point of its curve (`--gkd-points`) is a run of its own to that many
  steps (cached), scored greedily by `posttrain eval` on the same held-out problems.

Both runs: the demo's RL settings (32 prompts x 8 samples a step, lr 2e-4, KL loss 0.001, responses up to 8
tokens), one worker (`trainer.backend=local`), `--steps` steps, greedy held-out accuracy every `--val-every`
steps (`val/acc`, the same 256 problems). Generated samples = steps x 256. Half the gap = start + (teacher -
start) / 2; per run, the samples generated before the first validation at or above it (none: not reached).
Several seeds each (`trainer.seed`); the teacher and the warm start are shared (cached in `--work`).

    python bench/distill.py                      # 3 seeds x (distill, grpo, gkd), 60 steps
    python bench/distill.py --kinds gkd          # GKD alone (the other kinds' runs are cached in --work)
    python bench/distill.py --seeds 1 --steps 20

Writes bench/results/distill.json (BENCHMARKS.md format) and distill.png (with matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from common import (
    CODE_AT_START,
    POSTTRAIN,
    RESULTS,
    held_out_accuracy,
    machine_info,
    recipe_tag,
    write_result,
)
from common import run_posttrain as run

SAMPLES_PER_STEP = 32 * 8  # the demo's data.train_batch_prompts x rollout.n
TEACHER_SFT = [  # the small preset's SFT (bench/vs_trl.py's 10M warm start uses lr 1e-3)
    "trainer.total_steps=3000",
    "optim.lr=1e-3",
    "optim.lr_schedule=cosine",
    "optim.warmup_steps=50",
    "optim.batch_size=64",
    "trainer.val_every=25",
    "trainer.loggers=[jsonl]",
]


def sft(model: Path, data: Path, run_dir: Path, overrides: list[str], threads: int) -> Path:
    """`posttrain sft` (cached): its exported model directory."""
    if not (run_dir / "hf" / "config.json").exists():
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        run(
            [
                *POSTTRAIN,
                "sft",
                f"model.path={model}",
                f"data.train_files=[{data / 'train.parquet'}]",
                f"data.val_files=[{data / 'test.parquet'}]",
                f"trainer.run_dir={run_dir}",
                f"trainer.threads_per_worker={threads}",
                "trainer.plots=false",
                *overrides,
            ],
            run_dir / "run.log",
        )
    return run_dir / "hf"


def prepare(work: Path, teacher_nll: float, threads: int) -> dict[str, Any]:
    """The student (tiny) and teacher (small, the student's tokenizer), the task, both SFT runs (cached)."""
    from posttrain.data.tasks.arithmetic import corpus, write_arithmetic_dataset
    from posttrain.demo import SFT_OVERRIDES, TASK
    from posttrain.models import make_tiny_model

    student, teacher, data = work / "student-model", work / "teacher-model", work / "data"
    if not (student / "config.json").exists():
        make_tiny_model("tiny", student, corpus(20000, seed=0))
    if not (teacher / "config.json").exists():
        make_tiny_model("small", teacher, [], tokenizer_from=student)
    if not (data / "test.parquet").exists():
        write_arithmetic_dataset(data, **TASK)
    overrides = [*TEACHER_SFT, f"trainer.stop_at_val_nll={teacher_nll}"]
    # each warm start is named by its whole recipe: a changed one makes a new warm start, not a stale reuse
    teacher_hf = sft(teacher, data, work / f"teacher-sft-{recipe_tag(overrides, TASK)}", overrides, threads)
    student_hf = sft(
        student, data, work / f"student-sft-{recipe_tag(SFT_OVERRIDES, TASK)}", list(SFT_OVERRIDES), threads
    )
    return {
        "data": data,
        "teacher": teacher_hf,
        "student": student_hf,
        "teacher_acc": held_out_accuracy(teacher_hf, data, teacher_hf.parent / "eval"),
        "student_acc": held_out_accuracy(student_hf, data, student_hf.parent / "eval"),
    }


def rl_run(
    kind: str, prep: dict[str, Any], work: Path, seed: int, steps: int, val_every: int, lr: float
) -> dict:
    """One `posttrain train` run from the student's warm start: its validation curve (cached)."""
    from posttrain.demo import RL_OVERRIDES

    run_dir = (
        work
        / f"{kind}-seed{seed}-steps{steps}-lr{lr:g}-{recipe_tag(RL_OVERRIDES, val_every, str(prep['student']), str(prep['teacher']) if kind == 'distill' else None)}"
    )
    if not (run_dir / "done").exists():
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        dropped = ("trainer.loggers", "trainer.save_every", "trainer.val", "actor.optim.lr")
        kept = [o for o in RL_OVERRIDES if not o.startswith(dropped)] + [f"actor.optim.lr={lr:g}"]
        teacher = [f"distill.teacher_path={prep['teacher']}"] if kind == "distill" else []
        run(
            [
                *POSTTRAIN, "train", f"model.path={prep['student']}",
                f"data.train_files=[{prep['data'] / 'train.parquet'}]",
                f"data.val_files=[{prep['data'] / 'test.parquet'}]",
                *kept, *teacher, f"trainer.total_steps={steps}", f"trainer.val_every={val_every}",
                "trainer.backend=local", "rollout.val_temperature=0", "trainer.save_every=0", "trainer.resume=false",
                f"trainer.run_dir={run_dir}", f"trainer.seed={seed}", "trainer.loggers=[jsonl]",
                "trainer.plots=false",
            ],
            run_dir / "run.log",
        )  # fmt: skip
        (run_dir / "done").touch()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = [
        {"step": r["step"], "samples": r["step"] * SAMPLES_PER_STEP, "val_acc": r["val/acc"]}
        for r in rows
        if "val/acc" in r
    ]
    kl = [r["distill/kl_to_teacher"] for r in rows if "distill/kl_to_teacher" in r]
    return {"seed": seed, "curve": curve, "kl_to_teacher_first_last": [kl[0], kl[-1]] if kl else None}


def gkd_run(prep: dict[str, Any], work: Path, seed: int, points: list[int], args: argparse.Namespace) -> dict:
    """`posttrain distill` (GKD) from the student's warm start, on the student's own samples
    (`distill.lmbda`; 1 = every batch), the whole next-token distribution matched to the teacher's at each
    response position. The SFT-style trainer validates NLL only, so each point of the curve is a run of its own
    (cached) to that many steps, its exported student scored by `posttrain eval`: the same seed and a constant
    learning rate, so a shorter run is the start of a longer one."""
    curve = [{"step": 0, "samples": 0, "val_acc": prep["student_acc"]}]
    for steps in points:
        tag = f"seed{seed}-steps{steps}-lr{args.gkd_lr:g}-lmbda{args.gkd_lmbda:g}-beta{args.gkd_beta:g}"
        tag += f"-{recipe_tag(str(prep['teacher']), str(prep['student']))}"  # the teacher distilled from
        run_dir = work / f"gkd-{tag}"
        if not (run_dir / "hf" / "config.json").exists():
            shutil.rmtree(run_dir, ignore_errors=True)
            run_dir.mkdir(parents=True)
            run(
                [
                    *POSTTRAIN, "distill", f"model.path={prep['student']}",
                    f"distill.teacher_path={prep['teacher']}", f"distill.lmbda={args.gkd_lmbda:g}",
                    f"distill.beta={args.gkd_beta:g}", f"data.train_files=[{prep['data'] / 'train.parquet'}]",
                    f"data.val_files=[{prep['data'] / 'test.parquet'}]", "data.max_response_length=8",
                    f"optim.lr={args.gkd_lr:g}", "optim.lr_schedule=constant", "optim.warmup_steps=0",
                    f"optim.batch_size={args.gkd_batch}", f"optim.micro_batch_size={args.gkd_batch}",
                    f"trainer.total_steps={steps}", f"trainer.seed={seed}", f"trainer.run_dir={run_dir}",
                    f"trainer.threads_per_worker={args.threads}", "trainer.loggers=[jsonl]", "trainer.plots=false",
                ],
                run_dir / "run.log",
            )  # fmt: skip
        acc = held_out_accuracy(run_dir / "hf", prep["data"], run_dir / "eval")
        # generated samples: the batches the student answered itself (all of them at lmbda=1)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        on_policy = sum(1 for r in rows if r.get("distill/on_policy", 0.0) > 0)
        curve.append({"step": steps, "samples": on_policy * args.gkd_batch, "val_acc": acc})
    return {"seed": seed, "curve": curve, "kl_to_teacher_first_last": None}


def samples_to(curve: list[dict[str, Any]], target: float) -> int | None:
    """Generated samples before the first validation at or above `target` (None: never within the run)."""
    return next((c["samples"] for c in curve if c["val_acc"] >= target), None)


def plot(runs: dict[str, list[dict]], prep: dict[str, Any], half: float, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {"distill": "tab:blue", "grpo": "tab:orange", "gkd": "tab:green"}
    for kind, kind_runs in runs.items():
        for i, r in enumerate(kind_runs):
            xs = [c["samples"] for c in r["curve"]]
            ys = [c["val_acc"] for c in r["curve"]]
            ax.plot(xs, ys, color=colors[kind], alpha=0.8, label=kind if i == 0 else None)
    ax.axhline(prep["teacher_acc"], color="gray", ls="--", label="teacher (~10M)")
    ax.axhline(half, color="gray", ls=":", label="half the gap")
    ax.set_xlabel("generated samples")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.set_title("student (~1M) from its SFT warm start: distillation (on-policy, GKD) vs GRPO")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--val-every", type=int, default=5)
    parser.add_argument(
        "--teacher-nll", type=float, default=0.15, help="the teacher's SFT stops at this val NLL"
    )
    parser.add_argument("--distill-lr", type=float, default=4e-4, help="the student's lr in distillation")
    parser.add_argument("--grpo-lr", type=float, default=2e-4, help="its lr in GRPO (the demo's)")
    parser.add_argument("--kinds", default="distill,grpo,gkd", help="a subset of distill, grpo, gkd")
    parser.add_argument(
        "--gkd-points", default="8,16,32,60,120", help="GKD's curve: the steps of each (cached) run"
    )
    parser.add_argument("--gkd-lr", type=float, default=4e-4, help="the student's lr in GKD (constant)")
    parser.add_argument("--gkd-batch", type=int, default=64, help="GKD's sequences per step")
    parser.add_argument("--gkd-lmbda", type=float, default=1.0, help="GKD: share of on-policy batches")
    parser.add_argument("--gkd-beta", type=float, default=0.5, help="GKD: the JSD's interpolation")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--work", default="/tmp/posttrain-bench-distill")
    parser.add_argument("--out", default="distill.json")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    code = CODE_AT_START
    prep = prepare(work, args.teacher_nll, args.threads)
    start, teacher = prep["student_acc"], prep["teacher_acc"]
    half = start + (teacher - start) / 2
    print(f"student warm start {start:.3f}, teacher {teacher:.3f}, half the gap at {half:.3f}", flush=True)
    kinds = args.kinds.split(",")
    if unknown := set(kinds) - {"distill", "grpo", "gkd"}:
        parser.error(f"--kinds: unknown {sorted(unknown)}; choose from distill, grpo, gkd")
    points = [int(p) for p in args.gkd_points.split(",")]
    runs: dict[str, list[dict]] = {kind: [] for kind in kinds}
    for seed in range(args.seeds):
        for kind in runs:  # alternating, so a slower stretch of the machine hits both
            if kind == "gkd":
                runs[kind].append(gkd_run(prep, work, seed, points, args))
            else:
                lr = args.distill_lr if kind == "distill" else args.grpo_lr
                runs[kind].append(rl_run(kind, prep, work, seed, args.steps, args.val_every, lr))
            r = runs[kind][-1]
            print(f"{kind} seed {seed}: {[c['val_acc'] for c in r['curve']]}", flush=True)
    rows = []
    reached = {kind: [samples_to(r["curve"], half) for r in kind_runs] for kind, kind_runs in runs.items()}
    for kind, kind_runs in runs.items():
        last3 = [statistics.mean(c["val_acc"] for c in r["curve"][-3:]) for r in kind_runs]
        length = (
            f"{points[-1]} steps of {args.gkd_batch} (lmbda {args.gkd_lmbda:g}, beta {args.gkd_beta:g}, "
            f"lr {args.gkd_lr:g})"
            if kind == "gkd"
            else f"{args.steps} steps"
        )
        rows.append(
            {
                "case": f"{kind} from the student's SFT warm start (tiny, arithmetic 1-2 digit), {length}",
                "metric": "held_out_accuracy_last3",
                "value": round(statistics.mean(last3), 4),
                "higher_is_better": True,
                "repeats": len(last3),
                "spread": [round(min(last3), 4), round(max(last3), 4)],
                "baseline_name": "student SFT warm start",
                "baseline_value": round(start, 4),
                "teacher_value": round(teacher, 4),
            }
        )
        got = [s for s in reached[kind] if s is not None]
        rows.append(
            {
                "case": f"{kind}: generated samples to close half the student-teacher gap (>= {half:.3f})",
                "metric": "samples_to_half_gap",
                "value": statistics.median(got) if len(got) == len(reached[kind]) else None,
                "higher_is_better": False,
                "repeats": len(reached[kind]),
                "per_seed": reached[kind],
                "note": "None: not reached within the run",
            }
        )
    result = {
        "bench": "distill",
        "machine": machine_info(args.threads),
        "command": "python " + " ".join(sys.argv),
        "code": code,
        "seconds": round(time.perf_counter() - started, 1),
        "student_warm_start_acc": start,
        "teacher_acc": teacher,
        "half_gap_target": round(half, 4),
        "rows": rows,
        "runs": runs,
    }
    path = write_result(args.out, result)
    plot(runs, prep, half, RESULTS / args.out.replace(".json", ".png"))
    print(json.dumps(rows, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
