"""Post-training beyond PPO, measured on the built-in arithmetic task: DPO, a reward model, and GRPO whose only
reward is that reward model; several seeds each (issue 18, item 6).

Every policy starts from the demo's SFT warm start (the demo's tiny ~1M model, task and SFT recipe, stopped at
held-out NLL 0.7: ~25-38% greedy accuracy). The preference pairs are `posttrain data arithmetic_pairs` written
with the task's own problem split (four distinct wrong answers per problem), so the held-out pairs are the
held-out problems and no stage trains on a problem it is scored on.

- **dpo**: `posttrain dpo` (sigmoid + sft, the frozen warm start as the reference) on on-policy pairs (the
  warm start's own answers to the train problems: `posttrain data sampled_pairs`); held-out greedy accuracy
  before and after (`posttrain eval`, the rule scorer), and against a control trained on the same pairs with
  the sft term alone. Target: +10 points.
- **rm**: `posttrain rm` (Bradley-Terry) on the train pairs; held-out pairwise accuracy. Target: >= 85%. The
  reward model starts from the RM base: the same SFT recipe on the same train problems run to its end
  (`posttrain.demo.SFT_OVERRIDES`' total_steps, no early stop; the recorded runs used the earlier 800-step recipe) instead of the warm start (from the warm start: 84.4% after 2,000 steps, and GRPO on
  those reward models fell 37.9% -> 17.1%; they rank the right answer first among it and its 14 nearest slips
  on 11-17% of held-out problems, and GRPO converges to the slips they prefer).
- **grpo_rm**: `posttrain train` (GRPO, the demo's settings, 2 FSDP workers on Ray) from the warm start with
  `reward.model.path` = that seed's reward model and no rule reward; `val/acc` is the rule scorer's, which the
  run never sees. Target: +10 points (mean of the last three validations against the start).
- **grpo_rm_ensemble**: the same GRPO with the mean score of the rm stage's reward models (one per seed,
  `reward.model.ensemble`, Coste et al. 2024), the same ensemble for every GRPO seed: a policy cannot climb
  one model's errors alone. Also reports `near_slip_top1` per reward model (the share of held-out problems
  whose right answer it scores above its 14 nearest slips), what GRPO on it drifts towards.

Each stage runs the CLI in a child process (the commands are printed, so any run can be repeated by hand)
and caches its output in `--work` (the RM base, rm and grpo_rm runs with the settings they ran with: a run
with other settings runs again); `--fresh` starts over.

    python bench/post_training.py --threads 1           # all stages, 3 seeds
    python bench/post_training.py --stages rm,grpo_rm,grpo_rm_ensemble --seeds 3 --threads 1   # 200 GRPO steps
    python bench/post_training.py --stages dpo --seeds 1

Writes bench/results/post_training.json (BENCHMARKS.md format) and post_training.png (with matplotlib).
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from common import CODE_AT_START, POSTTRAIN, RESULTS, held_out_accuracy, machine_info, write_result
from common import run_posttrain as run

STAGES = ("dpo", "rm", "grpo_rm", "grpo_rm_ensemble")

# RPO-style DPO (Pang et al. 2024, "Iterative reasoning preference optimization"): the sigmoid DPO loss plus
# the NLL of the chosen answer; without the NLL term the chosen answers' log-probs fall with the rejected ones
# and held-out accuracy drops (24.2% -> 18.0% measured, one seed)
DPO_LOSS = "dpo.loss_type=[sigmoid,sft]"
CONTROL_LOSS = "dpo.loss_type=[sft]"  # the same pairs and steps, the chosen answers' NLL alone
DPO_OVERRIDES = [
    "dpo.beta=0.1",
    "optim.lr=2e-4",
    "optim.lr_schedule=cosine",
    "optim.warmup_steps=10",
    "optim.batch_size=32",
    "optim.micro_batch_size=32",
    "trainer.total_steps=150",
    "trainer.val_every=0",  # held-out pairs once, at the end (the claim is generation accuracy, below)
    "data.val_max_pairs=256",
]
SAMPLES_PER_PROMPT = 4  # the warm start's samples per train problem (temperature 1) for the on-policy pairs
# from the warm start (not the RM base), held-out pairwise accuracy of seed 0 (code 2853232, validation every 250
# steps): 600 steps at lr 5e-4 stopped at 69%; lr 1e-3 stayed at chance (47-50% up to step 1000); lr 2e-4 rose
# steadily (62% at 250, 80% at 1250). From the RM base on the 8,800 pairs alone (seed 0, 2,000 steps, run by
# hand): 86% at 500 steps, 92% at 1000, 97.4% at 2000. From the RM base on those pairs + every near slip
# (`near_slips`: the answer +-1..11 and +-20, 45,325 more) + the warm start's sampled pairs (2,184), 1,000 steps
# (seed 0): 91.8%, and it ranked a dropped carry (-10) above the right answer on average, so the script keeps
# the 8,800 pairs alone
RM_OVERRIDES = [
    "optim.lr=2e-4",
    "optim.lr_schedule=cosine",
    "optim.warmup_steps=20",
    "optim.batch_size=32",
    "optim.micro_batch_size=32",
    "trainer.total_steps=2000",
    "trainer.val_every=250",
    "data.val_max_pairs=1024",
]
GRPO_RM_STEPS = 200
ENSEMBLE_COMBINE = "mean"  # grpo_rm_ensemble: the reward models of the rm stage's seeds, their mean score
# the reward models' starting weights: the warm start's SFT recipe on the same train problems run to its end (its
# total_steps; 800 in the earlier recipe the recorded runs used) instead of stopping at held-out NLL 0.7 (validation only watches, every 100 steps). From the warm start,
# 2,000 steps reached 84.4% held-out pairwise accuracy (83.3 / 85.9 / 84.0) and GRPO on them fell 37.9% -> 17.1%
RM_BASE_OVERRIDES = ["trainer.stop_at_val_nll=0", "trainer.val_every=100"]  # after the demo's SFT_OVERRIDES
NEAR_SLIPS = (1, 2, 3, 9, 10, 11, 20)  # the answer +- these: the slips a policy's near misses make
REJECTED_PER_PROBLEM = 4  # pairs per problem (distinct wrong answers): 8,800 train / 1,024 held-out pairs


def cached(run_dir: Path, settings: dict[str, Any], done: Path) -> bool:
    """Whether `run_dir` holds a finished run (`done` exists) with these settings (else it is cleared)."""
    record = run_dir / "bench_settings.json"
    if done.exists() and record.exists() and json.loads(record.read_text()) == settings:
        return True
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    return False


def mark_done(run_dir: Path, settings: dict[str, Any]) -> None:
    (run_dir / "bench_settings.json").write_text(json.dumps(settings, indent=1))


def common_trainer(run_dir: Path, seed: int, threads: int) -> list[str]:
    return [
        f"trainer.run_dir={run_dir}",
        f"trainer.seed={seed}",
        f"trainer.threads_per_worker={threads}",
        "trainer.loggers=[jsonl]",
        "trainer.plots=false",
    ]


def warm_start(work: Path) -> dict[str, Path]:
    """The demo's tiny model, the task, its preference pairs (same split) and the SFT warm start (cached)."""
    from posttrain.config.load import load_config
    from posttrain.config.schema import SFTConfig
    from posttrain.data.tasks.arithmetic import corpus, write_arithmetic_dataset
    from posttrain.data.tasks.arithmetic_pairs import write_arithmetic_pairs
    from posttrain.demo import SFT_OVERRIDES, TASK
    from posttrain.models import make_tiny_model
    from posttrain.trainers.sft import SFTTrainer

    paths = {"model": work / "model", "data": work / "data", "pairs": work / "pairs", "sft": work / "sft"}
    if not (paths["model"] / "config.json").exists():
        make_tiny_model("tiny", paths["model"], corpus(20000, seed=0))
    if not (paths["data"] / "test.parquet").exists():
        write_arithmetic_dataset(paths["data"], **TASK)
    if not (paths["pairs"] / "test.parquet").exists():
        # same seed and sizes as the task: the same problems per split
        write_arithmetic_pairs(paths["pairs"], **TASK, rejected_per_problem=REJECTED_PER_PROBLEM)
    sft_settings = {"sft": SFT_OVERRIDES, "task": TASK}  # the warm start is re-made when its recipe changes
    if not cached(paths["sft"], sft_settings, paths["sft"] / "hf" / "config.json"):
        cfg = load_config(
            SFTConfig,
            "sft",
            [
                f"model.path={paths['model']}",
                f"data.train_files=[{paths['data'] / 'train.parquet'}]",
                f"data.val_files=[{paths['data'] / 'test.parquet'}]",
                f"trainer.run_dir={paths['sft']}",
                *SFT_OVERRIDES,
            ],
        )
        SFTTrainer(cfg).fit()
        mark_done(paths["sft"], sft_settings)
    return paths


def rm_base(paths: dict[str, Path], work: Path, threads: int) -> Path:
    """The reward models' starting weights: the SFT recipe on the train problems without the early stop."""
    from posttrain.demo import SFT_OVERRIDES

    run_dir = work / "rm_base"
    settings = {"sft": SFT_OVERRIDES, "rm_base": RM_BASE_OVERRIDES}
    if not cached(run_dir, settings, run_dir / "hf" / "config.json"):
        run(
            [
                *POSTTRAIN,
                "sft",
                f"model.path={paths['model']}",
                f"data.train_files=[{paths['data'] / 'train.parquet'}]",
                f"data.val_files=[{paths['data'] / 'test.parquet'}]",
                *SFT_OVERRIDES,
                *RM_BASE_OVERRIDES,
                *common_trainer(run_dir, 0, threads),
            ],
            run_dir / "run.log",
        )
        mark_done(run_dir, settings)
    return run_dir / "hf"


def sampled_pairs(paths: dict[str, Path], work: Path) -> Path:
    """On-policy pairs: the warm start's own answers to the train problems (`posttrain eval --n`, temperature
    1), its most frequent wrong one rejected, a correct one (else the ground truth) chosen (cached)."""
    from posttrain.data.sampled_pairs import write_sampled_pairs

    out = work / "sampled_pairs" / "train.parquet"
    if not out.exists():
        samples = work / "sft-train-samples"
        samples.mkdir(parents=True, exist_ok=True)
        run(
            [
                *POSTTRAIN,
                "eval",
                str(paths["sft"] / "hf"),
                "--data",
                str(paths["data"] / "train.parquet"),
                "--out",
                str(samples),
                "--n",
                str(SAMPLES_PER_PROMPT),
                "--temperature",
                "1.0",
                "--max-prompt-length",
                "128",
                "--max-response-length",
                "8",
            ],
            samples / "eval.log",
        )
        print("  " + json.dumps(write_sampled_pairs(samples / "samples.jsonl", out)), flush=True)
    return out


def dpo(paths: dict[str, Path], work: Path, seed: int, threads: int, loss: str, name: str) -> dict[str, Any]:
    from posttrain.demo import SFT_OVERRIDES

    run_dir = work / f"{name}-seed{seed}"
    # everything the run depends on: a cached run made with other settings is run again
    settings = {"loss": loss, "overrides": DPO_OVERRIDES, "sft": SFT_OVERRIDES, "samples": SAMPLES_PER_PROMPT}
    ran = not cached(run_dir, settings, run_dir / "hf" / "config.json")
    if ran:
        run(
            [
                *POSTTRAIN,
                "dpo",
                f"model.path={paths['sft'] / 'hf'}",
                f"data.train_files=[{sampled_pairs(paths, work)}]",
                f"data.val_files=[{paths['pairs'] / 'test.parquet'}]",
                loss,
                *DPO_OVERRIDES,
                *common_trainer(run_dir, seed, threads),
            ],
            run_dir / "run.log",
        )
        mark_done(run_dir, settings)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    pref = [r["val/rewards_accuracy"] for r in rows if "val/rewards_accuracy" in r]
    return {
        "seed": seed,
        "ran": ran,
        "val_acc": held_out_accuracy(run_dir / "hf", paths["data"], run_dir / "eval"),
        "held_out_preference_accuracy": pref[-1] if pref else None,
    }


def rm_settings() -> dict[str, Any]:
    """What a reward model of this script depends on (its run, and the GRPO runs on it, are cached by it)."""
    from posttrain.demo import SFT_OVERRIDES

    return {"rm": RM_OVERRIDES, "base": {"sft": SFT_OVERRIDES, "overrides": RM_BASE_OVERRIDES}}


def rm(paths: dict[str, Path], work: Path, seed: int, threads: int) -> dict[str, Any]:
    run_dir = work / f"rm-seed{seed}"
    settings = rm_settings()
    ran = not cached(run_dir, settings, run_dir / "rm_eval.json")
    if ran:
        run(
            [
                *POSTTRAIN,
                "rm",
                f"model.path={rm_base(paths, work, threads)}",
                f"data.train_files=[{paths['pairs'] / 'train.parquet'}]",
                f"data.val_files=[{paths['pairs'] / 'test.parquet'}]",
                *RM_OVERRIDES,
                *common_trainer(run_dir, seed, threads),
            ],
            run_dir / "run.log",
        )
        mark_done(run_dir, settings)
    final = json.loads((run_dir / "rm_eval.json").read_text())
    return {
        "seed": seed,
        "ran": ran,
        "pairwise_accuracy": final["val/accuracy"],
        "pairs": final.get("val/pairs"),
        "near_slip_top1": near_slip_top1((run_dir / "hf",), paths["data"] / "test.parquet"),
    }


@functools.cache  # one value per set of reward models: the rm stage and every GRPO seed on them share it
def near_slip_top1(reward_models: tuple[Path, ...], test: Path) -> float:
    """Share of held-out problems whose right answer the reward model (several: their mean score, as
    `reward.model.combine=mean` scores) scores above all of its near slips (the answer +-1, 2, 3, 9, 10, 11,
    20 that are >= 0): what GRPO on the model drifts towards, which pairwise accuracy on random slips (mostly
    easy ones) does not show. Each response rendered as RL renders it for that model."""
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForSequenceClassification

    from posttrain.data.chat_masks import completion_tokens
    from posttrain.models import load_tokenizer

    models = [
        (load_tokenizer(str(path)), AutoModelForSequenceClassification.from_pretrained(path).eval())
        for path in reward_models
    ]
    first = 0
    rows = pq.read_table(test).to_pylist()
    for row in rows:
        answer = int(row["reward_model"]["ground_truth"])
        slips = [answer + sign * step for step in NEAR_SLIPS for sign in (1, -1)]
        candidates = [answer, *(c for c in slips if c >= 0)]
        scores = []
        for tokenizer, model in models:
            ids = [
                completion_tokens(
                    tokenizer, row["prompt"], [{"role": "assistant", "content": str(c)}], "near slip"
                )[0]
                for c in candidates
            ]
            width, pad = max(len(i) for i in ids), int(tokenizer.pad_token_id)
            input_ids = torch.tensor([i + [pad] * (width - len(i)) for i in ids])
            mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i in ids])
            with torch.no_grad():  # right padding: the score is read at each row's last token
                scores.append(model(input_ids=input_ids, attention_mask=mask).logits[:, 0])
        first += int(torch.stack(scores).mean(dim=0).argmax()) == 0
    return first / len(rows)


def trained_reward_model(work: Path, seed: int) -> Path:
    """The rm stage's reward model of `seed`, refused unless it was trained with the current settings."""
    reward_model = work / f"rm-seed{seed}" / "hf"
    record = work / f"rm-seed{seed}" / "bench_settings.json"
    if not record.exists() or json.loads(record.read_text()) != rm_settings():
        raise RuntimeError(
            f"the GRPO stages need the reward model {reward_model} of the current settings: run the rm stage "
            "first (with as many seeds)"
        )
    return reward_model


def grpo_rm(
    paths: dict[str, Path], work: Path, seed: int, steps: int, workers: int, ensemble: int = 0
) -> dict[str, Any]:
    """GRPO from the warm start whose only reward is seed `seed`'s reward model, or (`ensemble` = M) the mean
    of the reward models of seeds 0..M-1 (`reward.model.ensemble`, the same for every GRPO seed)."""
    from posttrain.demo import RL_OVERRIDES

    models = [trained_reward_model(work, s) for s in (range(ensemble) if ensemble else [seed])]
    name = f"grpo_rm_ensemble{ensemble}" if ensemble else "grpo_rm"
    run_dir = work / f"{name}-seed{seed}-steps{steps}"
    settings = {"reward_model": rm_settings(), "models": [str(m) for m in models], "steps": steps,
                "workers": workers, "rl": RL_OVERRIDES, "combine": ENSEMBLE_COMBINE}  # fmt: skip
    ran = not cached(run_dir, settings, run_dir / "done")
    if ran:
        overrides = [o for o in RL_OVERRIDES if not o.startswith(("trainer.loggers", "trainer.save_every"))]
        members = [f"reward.model.ensemble=[{','.join(map(str, models[1:]))}]",
                   f"reward.model.combine={ENSEMBLE_COMBINE}"]  # fmt: skip
        run(
            [
                *POSTTRAIN,
                "train",
                f"model.path={paths['sft'] / 'hf'}",
                f"data.train_files=[{paths['data'] / 'train.parquet'}]",
                f"data.val_files=[{paths['data'] / 'test.parquet'}]",
                f"reward.model.path={models[0]}",
                *(members if ensemble else []),
                "reward.model.with_rule_rewards=false",
                *overrides,
                f"trainer.total_steps={steps}",
                f"trainer.n_workers_per_node={workers}",
                "trainer.save_every=0",
                "trainer.resume=false",
                *common_trainer(run_dir, seed, 0)[:2],
                "trainer.loggers=[jsonl]",
            ],
            run_dir / "run.log",
        )
        (run_dir / "done").touch()
        mark_done(run_dir, settings)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = [{"step": r["step"], "val_acc": r["val/acc"]} for r in rows if "val/acc" in r]
    scores = [r["reward/model_score/mean"] for r in rows if "reward/model_score/mean" in r]
    return {
        "seed": seed,
        "ran": ran,
        "start_val_acc": curve[0]["val_acc"],
        "last3_val_acc": statistics.mean(c["val_acc"] for c in curve[-3:]),
        "curve": curve,
        "rm_score_first5": statistics.mean(scores[:5]) if scores else None,
        "rm_score_last5": statistics.mean(scores[-5:]) if scores else None,
        "reward_models_near_slip_top1": near_slip_top1(tuple(models), paths["data"] / "test.parquet"),
    }


def spread(values: list[float]) -> list[float]:
    return [round(min(values), 4), round(max(values), 4)]


def rows_for(stage: str, runs: list[dict[str, Any]], start: float) -> list[dict[str, Any]]:
    if stage == "dpo":
        accs = [r["val_acc"] for r in runs]
        control = [r["sft_control_val_acc"] for r in runs]
        case = "dpo (sigmoid + sft) on the warm start's own samples, arithmetic 1-2 digit, tiny"
        row = {"metric": "held_out_accuracy", "higher_is_better": True, "repeats": len(accs)}
        return [
            {
                **row,
                "case": case,
                "value": round(statistics.mean(accs), 4),
                "baseline_name": "SFT warm start",
                "baseline_value": round(start, 4),
                "ratio": round(statistics.mean(accs) / max(start, 1e-9), 4),
                "spread": spread(accs),
            },
            {
                **row,
                "case": case + ", against its sft term alone",
                "value": round(statistics.mean(accs), 4),
                "baseline_name": "the chosen answers' NLL alone (same pairs, steps, seeds)",
                "baseline_value": round(statistics.mean(control), 4),
                "ratio": round(statistics.mean(accs) / max(statistics.mean(control), 1e-9), 4),
                "spread": spread(accs),
            },
        ]
    if stage == "rm":
        case = "reward model (Bradley-Terry) on arithmetic pairs, tiny"
        rows = []
        for metric, key in [
            ("held_out_pairwise_accuracy", "pairwise_accuracy"),
            ("near_slip_top1", "near_slip_top1"),
        ]:
            values = [r[key] for r in runs if r.get(key) is not None]
            if values:
                rows.append({"case": case, "metric": metric, "value": round(statistics.mean(values), 4),
                             "higher_is_better": True, "repeats": len(values), "spread": spread(values)})  # fmt: skip
        return rows
    accs = [r["last3_val_acc"] for r in runs]
    starts = [r["start_val_acc"] for r in runs]
    rows = [
        {
            "case": (
                f"grpo with the mean of {runs[0].get('ensemble', 3)} reward models as its only reward"
                if stage == "grpo_rm_ensemble"
                else "grpo with the reward model as its only reward"
            )
            + f", tiny, {runs[0]['curve'][-1]['step']} steps, rule-scored held-out accuracy",
            "metric": "held_out_accuracy_last3",
            "value": round(statistics.mean(accs), 4),
            "baseline_name": "start (step 0 validation)",
            "baseline_value": round(statistics.mean(starts), 4),
            "ratio": round(statistics.mean(accs) / max(statistics.mean(starts), 1e-9), 4),
            "higher_is_better": True,
            "repeats": len(accs),
            "spread": spread(accs),
        }
    ]
    near = runs[0].get("reward_models_near_slip_top1")
    if stage == "grpo_rm_ensemble" and near is not None:  # one ensemble for every GRPO seed: one score
        rows.append({"case": f"the mean of {runs[0].get('ensemble')} reward models, tiny", "metric": "near_slip_top1",
                     "value": round(near, 4), "higher_is_better": True, "repeats": 1,
                     "spread": [round(near, 4)] * 2})  # fmt: skip
    return rows


def plot(results: dict[str, list[dict[str, Any]]], out: Path) -> None:
    """One panel per stage measured: DPO against its sft-term control and the start, the reward models'
    held-out pairwise accuracy against the 85% target, GRPO-on-RM's held-out accuracy curves."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install -e .[bench])")
        return
    stages = [s for s in STAGES if results.get(s)]
    if not stages:
        return
    fig, axes = plt.subplots(1, len(stages), figsize=(5 * len(stages), 4), squeeze=False)
    for ax, stage in zip(axes[0], stages, strict=True):
        runs = results[stage]
        seeds = [r["seed"] for r in runs]
        if stage == "dpo":
            width = 0.27
            for k, (key, label) in enumerate(
                [("sft_start_val_acc", "SFT start"), ("val_acc", "DPO (sigmoid + sft)"),
                 ("sft_control_val_acc", "sft term alone (control)")]
            ):  # fmt: skip
                ax.bar([s + (k - 1) * width for s in seeds], [r[key] for r in runs], width, label=label)
            ax.set_ylabel("held-out accuracy (rule scorer, greedy)")
            ax.set_title("DPO from the SFT warm start")
            ax.set_ylim(0, 1)
        elif stage == "rm":
            ax.bar(seeds, [r["pairwise_accuracy"] for r in runs], 0.5, label="held-out pairwise accuracy")
            near = [r.get("near_slip_top1") for r in runs]
            if all(v is not None for v in near):
                ax.plot(seeds, near, "o", color="C3", label="right answer first among its near slips")
            ax.axhline(0.85, color="gray", ls="--", label="target 85%")
            ax.set_ylim(0, 1)
            ax.set_title("reward model (Bradley-Terry)")
        else:
            for r in runs:
                curve = r["curve"]
                ax.plot([c["step"] for c in curve], [c["val_acc"] for c in curve], label=f"seed {r['seed']}")
            start = runs[0]["start_val_acc"]
            ax.axhline(start + 0.10, color="gray", ls="--", label="target: start + 10 points")
            ax.set_xlabel("GRPO step (reward: the reward model(s) alone)")
            ax.set_ylabel("held-out accuracy (rule scorer, greedy)")
            ensemble = stage == "grpo_rm_ensemble"
            ax.set_title(
                "GRPO on the 3 reward models' mean" if ensemble else "GRPO on each seed's reward model"
            )
        if not stage.startswith("grpo"):
            ax.set_xticks(seeds, [f"seed {s}" for s in seeds])
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {STAGES}")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--grpo-steps", type=int, default=GRPO_RM_STEPS)
    parser.add_argument("--workers", type=int, default=2, help="FSDP workers of the GRPO runs")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the one-process runs")
    parser.add_argument("--work", default="/tmp/posttrain-bench-post")
    parser.add_argument("--fresh", action="store_true")
    args = parser.parse_args()
    stages = [s for s in args.stages.split(",") if s]
    if unknown := sorted(set(stages) - set(STAGES)):
        parser.error(f"unknown stages {unknown}; valid: {list(STAGES)}")
    work = Path(args.work)
    if args.fresh:
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    paths = warm_start(work)
    start = held_out_accuracy(paths["sft"] / "hf", paths["data"], work / "sft-eval")
    print(f"SFT warm start: held-out accuracy {start:.4f}", flush=True)

    previous = RESULTS / "post_training.json"
    results: dict[str, list[dict[str, Any]]] = {}
    if previous.exists():  # stages not re-run keep their last figures, each with its own warm start
        before = json.loads(previous.read_text())
        results = before.get("runs", {})
        for runs in results.values():
            for r in runs:
                r.setdefault("sft_start_val_acc", before.get("sft_start_val_acc"))
    code = CODE_AT_START  # the code this invocation runs (its runs' subprocesses import the working tree)
    from posttrain.demo import SFT_OVERRIDES

    settings = {  # what this invocation runs; each run keeps its own copy, as stages not re-run keep theirs
        "dpo": {"loss": DPO_LOSS, "overrides": DPO_OVERRIDES, "control": CONTROL_LOSS,
                "samples_per_prompt": SAMPLES_PER_PROMPT},
        "rm": {"overrides": RM_OVERRIDES, "base": {"sft": SFT_OVERRIDES, "overrides": RM_BASE_OVERRIDES}},
        "grpo_rm": {"steps": args.grpo_steps, "workers": args.workers},
        "grpo_rm_ensemble": {"steps": args.grpo_steps, "workers": args.workers, "ensemble": args.seeds,
                             "combine": ENSEMBLE_COMBINE},
    }  # fmt: skip
    for stage in stages:
        before_runs = {r["seed"]: r for r in results.get(stage, [])}
        results[stage] = []
        for seed in range(args.seeds):
            print(f"[{stage}] seed {seed}", flush=True)
            if stage == "dpo":
                out = dpo(paths, work, seed, args.threads, DPO_LOSS, "dpo")
                control = dpo(paths, work, seed, args.threads, CONTROL_LOSS, "sft_control")
                out["sft_control_val_acc"] = control["val_acc"]
                out["ran"] = out["ran"] or control["ran"]
            elif stage == "rm":
                out = rm(paths, work, seed, args.threads)
            else:
                ensemble = args.seeds if stage == "grpo_rm_ensemble" else 0
                out = grpo_rm(paths, work, seed, args.grpo_steps, args.workers, ensemble)
                out["ensemble"] = ensemble or None
            out["sft_start_val_acc"] = start
            earlier = before_runs.get(seed, {})
            if out.pop("ran", True):
                out["code"], out["settings"] = code, settings[stage]
            else:  # a cached run, made with these settings (`cached`): the code it ran with, never today's
                out["code"] = earlier.get("code", "unknown (a cached run of an earlier invocation)")
                out["settings"] = settings[stage]
            if stage == "rm":  # computed now, on the run's reward model
                out["near_slip_top1_code"] = code
            print("  " + json.dumps({k: v for k, v in out.items() if k != "curve"}), flush=True)
            results[stage].append(out)
    rows = [
        row
        for stage in STAGES
        if results.get(stage)
        for row in rows_for(stage, results[stage], results[stage][0]["sft_start_val_acc"])
    ]
    result = {
        "bench": "post_training",
        "machine": machine_info(args.threads),
        "command": "python " + " ".join(sys.argv),
        "sft_start_val_acc": start,
        "settings": {stage: settings[stage] for stage in stages},  # this invocation's; per run in "runs"
        "seconds": round(time.perf_counter() - started, 1),
        "code": {
            stage: sorted({r.get("code", "before the code field") for r in runs})
            for stage, runs in results.items()
        },
        "rows": rows,
        "runs": results,
    }
    path = write_result("post_training.json", result)
    plot(results, RESULTS / "post_training.png")
    print(f"\nstart (SFT warm start) held-out accuracy {start:.4f}")
    for row in rows:
        print(
            f"{row['case']}: {row['metric']} {row['value']} (spread {row.get('spread')}, n={row['repeats']})"
        )
    print(f"wrote {path} ({result['seconds']} s)")


if __name__ == "__main__":
    main()
