"""GRPO teaching the tiny model to use a calculator: held-out tool-use success and accuracy over steps.

The built-in agent task (posttrain/data/tasks/tool_multiplication.py) asks for products of 3-4 digit
numbers, which the ~1M model cannot compute: it succeeds only by calling the calculator with the right
expression and copying its result into the answer. An SFT warm start on tool-using chat demonstrations
(`sft.parquet`) teaches the format; GRPO on multi-turn episodes (the trainer's agent path,
`agent.enable=true`) is then meant to raise the share of held-out episodes with a successful call and the
accuracy. Repeated over seeds (the warm start is shared; each seed is a GRPO run).

Measured so far (issue 15, item 9), greedy held-out accuracy on 64 prompts never trained on:
- SFT alone, 500 steps on 2,000 demonstrations: well-formed calls (tool success 100%) with made-up operands
  and made-up answers, 0%. The model had not learned to copy digits.
- `--pretrain-steps 1500` (continued pre-training, plain `text` rows with loss on every token, 40,000 of the
  task's texts without the chat template, batch 64, lr 3e-3): greedy continuations of plain texts copy the
  tool's result 40/40 and both operands 15/40.
- That pre-training, then SFT on 8,000 chat demonstrations (batch 32, lr 1e-3 cosine): 150 steps 0%, 300
  steps 3.1%, 600 steps 100%. Copying appears as a jump between 300 and 600 steps, so there is no
  part-way warm start for GRPO to raise; from 3.1% (`--sft-steps 300`), 30 GRPO steps at lr 5e-5 stayed at
  1.6-3.1% over 3 seeds (train reward 0-3%, little signal; code 2aaa46f).
- From the 100% warm start, one GRPO step at lr 3e-4 dropped it to 3.1% (the tiny model does not survive
  Adam's first step at that rate, which moves every weight by about lr); at lr 5e-5 it stayed at 100%
  over 5 steps.
- The warm start GRPO can raise: the 600-step SFT above, then a second SFT stage of 100 steps
  (`--mix-steps 100`, lr 3e-4 cosine, warmup 10) on the same 8,000 demonstrations with half of them
  (`--no-tool-share 0.5`) answering at once without a call ("The answer is <product>.", the right product:
  the tiny model can only imitate its form). Greedy held-out, the warm start calls the tool on 20.3% of the
  problems and is right on the same share (20.3%). The first setting tried, no search over shares, steps or
  rates; one GRPO seed first (flags, the code of 1ca3a9a): 96.9% / 100% (accuracy / tool success) after
  5 steps, 100% / 100% from step 10; 3 seeds at 1ca3a9a ended as below.
- 3 seeds of GRPO from that warm start (the defaults until c1fb4d7) (lr 5e-5, 20 steps, 8 prompts x 8 episodes,
  `tool_use_bonus` 0.1; code 2dfefd8, `bench/results/agent_curve.json`): greedy held-out tool success
  20.3% -> 100% on every seed, accuracy 20.3% -> 100%, 100%, 98.4% (mean 99.5%). The greedy jump comes
  after the first update (the warm start's greedy choice sits near the margin: its sampled episodes call
  the tool 42-47% of the time); the sampled training episodes show the learning: tool calls per episode
  0.42-0.47 at step 1, >= 0.87 from step 5, 1.0 at step 20 on every seed, sampled accuracy 38-42% ->
  73-94% (copying at temperature 1 still errs). GRPO's gain is choosing the tool; copying operands and
  result was learned by SFT.
- The shuffled-reward control (`--control shuffled`; code c6910f2, `bench/results/agent_curve_control.json`
  and `.png`, `python bench/agent_curve.py --work /tmp/agentexp --control shuffled`): the same warm start,
  seeds and settings, each training episode paid the reward of a random episode of its group (a seeded
  uniform permutation per group: the group's rewards, mean and spread unchanged, an episode's expected
  advantage 0 whatever it did; accuracy is still scored on its own answer). Greedy held-out accuracy
  20.3% -> 0%, 53.1%, 12.5% (mean 21.9%; the real reward: 100%, 100%, 98.4%), tool success 20.3% -> 0%,
  100%, 100%; sampled training accuracy falls, 39-42% -> 14%, 36%, 11% (the real reward: -> 73-94%), tool
  calls per episode 0.42-0.47 -> 0.17, 0.70, 0.70 (the real reward: 1.0). The greedy held-out figures
  wander: seed 2 jumped to 92.2% accuracy after one update, as the real runs do, then fell to 12.5% while
  still calling the tool (copying decays with nothing paying for it); seed 0 stopped calling (0% from step
  2). So the jump after the first update is not by itself learning (any update can tip the warm start's
  choice, which sits at the margin); what the reward adds is the rise of the sampled episodes and held-out
  accuracy staying at 98-100% over the 20 steps.
- Few demonstrations (the defaults since then: `--n-sft 1000 --sft-batch 16`; code c1fb4d7,
  `bench/results/agent_curve.json` and `.png`, `python bench/agent_curve.py --work /tmp/agentexp --n-sft
  1000 --sft-batch 16`, the pre-training cached from above): the same two SFT stages on 1,000 of the
  8,000 demonstrations, in batches of 16 instead of 32. Why 16: 600 steps of 32 would be 19 passes over
  1,000 demonstrations, 600 of 16 are 9.6; copying appeared with the number of updates (300 -> 600 steps
  above), so the steps stay 600 (and a step took ~6 s on the shared machine). The only setting tried. SFT
  NLL at step 600: 0.022 (8,000 x 32: 0.0003). Greedy held-out, the warm start never calls the tool
  (tool success 0%, accuracy 0%); sampled, it calls in 41-47% of episodes and is right in 8-20%. GRPO (the
  defaults otherwise), 3 seeds: tool success 0% -> 100% on every seed, accuracy 0% -> 57.8%, 64.1%, 46.9%
  (mean 56.3%; 67-72% after the first update, then 34-73% over the steps); sampled tool calls per episode
  0.41-0.47 -> 0.97-1.0, sampled accuracy 8-20% -> 14-44%. Copying from 1,000 demonstrations is weaker
  than from 8,000 (99.5% there); the 8,000 warm start: `--n-sft 8000 --sft-batch 32`.
- The shuffled-reward control on that few-demonstration warm start (code c1fb4d7,
  `bench/results/agent_curve_control.json` and `.png`, `python bench/agent_curve.py --work /tmp/agentexp
  --n-sft 1000 --sft-batch 16 --control shuffled`): held-out accuracy 0% -> 0%, 3.1%, 0% (it wandered up
  to 23-56% on the way), sampled accuracy -> 0-1.6%; tool success 0% -> 1.6%, 100%, 100% and sampled tool
  calls 0.36-0.80. With no information in the reward, tool use can still drift up (2 of 3 seeds): the
  held-out accuracy is the measure the reward moves (57.8/64.1/46.9% against 0/3.1/0%).

    python bench/agent_curve.py                      # 3 seeds x 20 steps, SFT stages cached in --work
    python bench/agent_curve.py --n-sft 8000 --sft-batch 32   # the warm start on 8,000 demonstrations
    python bench/agent_curve.py --steps 10 --repeats 1
    python bench/agent_curve.py --control shuffled   # the same runs, each episode paid a groupmate's reward

Writes bench/results/agent_curve.json (BENCHMARKS.md format) and bench/results/agent_curve.png; with
`--control shuffled`, agent_curve_control.json and agent_curve_control.png.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from common import RESULTS, machine_info, write_result

from posttrain.agents.registry import AgentSetup, agent_names, register_agent
from posttrain.agents.tool_env import ToolChatGroup, tool_agent
from posttrain.agents.tools import build_tools
from posttrain.agents.types import Trajectory
from posttrain.config.load import load_config
from posttrain.config.schema import RLConfig, SFTConfig
from posttrain.data.tasks import arithmetic, tool_multiplication
from posttrain.errors import ConfigError
from posttrain.models import make_tiny_model
from posttrain.trainers.rl import RLTrainer
from posttrain.trainers.sft import SFTTrainer
from posttrain.workers.process import quiet_transformers

SFT_OVERRIDES = [
    "optim.lr=1e-3",
    "optim.lr_schedule=cosine",
    "optim.warmup_steps=20",
    "optim.batch_size=32",
    "data.train_on=all_assistant",
    "data.max_prompt_length=320",
    "data.max_response_length=64",
    "trainer.val_every=0",
    "trainer.loggers=[jsonl]",
]
RL_OVERRIDES = [
    "trainer.backend=local",
    "data.train_batch_prompts=8",
    "data.max_response_length=40",
    "rollout.n=8",
    "rollout.val_temperature=0.0",
    "agent.enable=true",
    "agent.tools=[calculator]",
    "agent.max_turns=3",
    "agent.max_total_tokens=900",
    "agent.tool_use_bonus=0.1",
    "trainer.val_every=1",
    "data.val_max_prompts=64",
    "trainer.save_every=0",
    "trainer.loggers=[jsonl]",
    "trainer.resume=false",
]


# ---- the shuffled-reward control ------------------------------------------------------------------------
SHUFFLED_AGENT = "tool_agent_shuffled_reward"  # the control's rows name this agent loop (agent_name)
GroupReward = Callable[[Sequence[Trajectory]], list[float]]  # a ToolChatGroup's group_reward


class ShuffledRewards:
    """The control's group reward hook: every episode of a group is paid the reward of the episode a seeded,
    uniformly random permutation of the group assigns it, so what an episode did says nothing about what it
    is paid. A uniform permutation (not a derangement, which would pay every episode another's reward): an
    episode's expected pay is then the group's mean whatever it did, so its expected GRPO advantage is 0; a
    derangement would pay (group sum - its own) / (n - 1), an advantage of minus its true one / (n - 1), a
    signal against the reward. The group's rewards, mean and spread are unchanged, so the update's size is
    the real runs'. `reseed` before each run (one random stream per run: groups draw in the order they
    finish, deterministic in a seeded run)."""

    def __init__(self) -> None:
        self.rng: random.Random | None = None

    def reseed(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def permutation(self, n: int) -> list[int]:
        if self.rng is None:
            raise ConfigError(f"agent {SHUFFLED_AGENT!r}: ShuffledRewards.reseed(seed) was not called")
        order = list(range(n))
        self.rng.shuffle(order)
        return order

    def hook(self, inner: GroupReward | None) -> GroupReward:
        """A group reward hook over `inner` (the group's own hook, None: none): the episodes' rewards
        (the environment's steps + `inner`'s), permuted; returned as what the hook adds to each episode."""

        def shuffled(trajectories: Sequence[Trajectory]) -> list[float]:
            added = list(inner(trajectories)) if inner is not None else [0.0] * len(trajectories)
            own = [sum(t.reward for t in tr.transitions) for tr in trajectories]
            total = [o + a for o, a in zip(own, added, strict=True)]
            order = self.permutation(len(trajectories))
            # the episode's total becomes total[order[i]]; answer_score (the accuracy) stays its own
            return [total[j] - o for j, o in zip(order, own, strict=True)]

        return shuffled


SHUFFLE = ShuffledRewards()


def shuffled_tool_agent(row: Mapping[str, Any], setup: AgentSetup) -> ToolChatGroup:
    """`tool_agent`'s episodes, paid through `SHUFFLE` (the registry's public hook: a row's agent_name)."""
    group = tool_agent(row, setup)
    group.group_reward = SHUFFLE.hook(group.group_reward)
    return group


def register_control() -> None:
    """Register the control's agent loop (once per process: the registry refuses a name twice)."""
    if SHUFFLED_AGENT not in agent_names():
        register_agent(SHUFFLED_AGENT)(shuffled_tool_agent)


def control_rows(train_file: Path, out: Path) -> Path:
    """`train_file`'s rows with agent_name `SHUFFLED_AGENT`: the same prompts, in the same order, run by the
    control's loop (validation rows keep `tool_agent`: one greedy episode each, nothing to shuffle)."""
    table = pq.read_table(train_file)
    names = pa.array([SHUFFLED_AGENT] * table.num_rows, type=pa.string())
    table = table.set_column(table.schema.get_field_index("agent_name"), "agent_name", names)
    pq.write_table(table, out)
    return out


def pretrain(work: Path, base: Path, steps: int) -> Path:
    """Continued pre-training (cached) on 40,000 of the task's plain texts: batch 64, lr 3e-3 cosine."""
    out = work / f"pretrain-{steps}"
    if steps == 0:
        return base
    if not (out / "hf" / "config.json").exists():
        texts = work / "pretrain_texts.parquet"
        rows = [{"text": t} for t in tool_multiplication.corpus(40000, seed=7)]
        pq.write_table(pa.Table.from_pylist(rows), texts)
        cfg = load_config(
            SFTConfig,
            "sft",
            [
                f"model.path={base}",
                f"data.train_files=[{texts}]",
                f"trainer.run_dir={out}",
                f"trainer.total_steps={steps}",
                "optim.lr=3e-3",
                "optim.lr_schedule=cosine",
                "optim.warmup_steps=50",
                "optim.batch_size=64",
                "data.train_on=everything",
                "trainer.val_every=0",
                "trainer.loggers=[jsonl]",
            ],
        )
        SFTTrainer(cfg).fit()
    return out / "hf"


def without_tool(sft_file: Path, out: Path, share: float) -> Path:
    """`sft_file` with a share of its demonstrations (chosen at random, seed 0) answering at once, without a
    call: the user's question, then the assistant's "The answer is <product>." (the tools still offered)."""
    rows = pq.read_table(sft_file).to_pylist()
    rng = random.Random(0)
    for i in rng.sample(range(len(rows)), round(share * len(rows))):
        messages = rows[i]["messages"]
        rows[i]["messages"] = [messages[0], messages[-1]]
    pq.write_table(pa.Table.from_pylist(rows), out)
    return out


def sft(model: Path, demos: Path, out: Path, steps: int, overrides: list[str]) -> Path:
    """SFT (cached in `out`) of `model` on `demos` for `steps` steps."""
    if not (out / "hf" / "config.json").exists():
        cfg = load_config(
            SFTConfig,
            "sft",
            [
                f"model.path={model}",
                f"data.train_files=[{demos}]",
                f"trainer.run_dir={out}",
                f"trainer.total_steps={steps}",
                *SFT_OVERRIDES,
                *overrides,
            ],
        )
        SFTTrainer(cfg).fit()
    return out / "hf"


def warm_start(
    work: Path,
    n_sft: int,
    sft_steps: int,
    pretrain_steps: int,
    no_tool_share: float = 0.0,
    mix_steps: int = 0,
    mix_lr: float = 3e-4,
    sft_batch: int = 32,
) -> tuple[Path, Path]:
    """The SFT warm start and the task's directory (train, test, demonstrations). The model (tokenizer
    trained with the tool format) is pre-trained on the task's texts, then SFT: `sft_steps` on the tool-using
    demonstrations, then (`mix_steps` > 0) on the same demonstrations with `no_tool_share` of them answering
    without the tool; both stages in batches of `sft_batch`."""
    tools = [t.schema() for t in build_tools(["calculator"], None)]
    model, data = work / "model", work / f"data-{n_sft}"
    if not (model / "config.json").exists():
        texts = arithmetic.corpus(10000, seed=0) + tool_multiplication.corpus(10000, seed=0, tools=tools)
        make_tiny_model("tiny", model, texts)
    model = pretrain(work, model, pretrain_steps)
    if not (data / "sft.parquet").exists():
        tool_multiplication.write_tool_multiplication_dataset(
            data, tools, n_train=2000, n_test=128, n_sft=n_sft
        )
    name = f"sft-p{pretrain_steps}-{n_sft}x{sft_steps}" + (f"-b{sft_batch}" if sft_batch != 32 else "")
    batch = [f"optim.batch_size={sft_batch}"]
    model = sft(model, data / "sft.parquet", work / name, sft_steps, batch)
    if mix_steps:
        mixed = without_tool(data / "sft.parquet", data / f"sft-nt{no_tool_share:g}.parquet", no_tool_share)
        out = work / f"{name}-nt{no_tool_share:g}x{mix_steps}-lr{mix_lr:g}"
        model = sft(model, mixed, out, mix_steps, [*batch, f"optim.lr={mix_lr}", "optim.warmup_steps=10"])
    return model, data


def task_files(data: Path, control: str) -> list[str]:
    """The GRPO run's train and validation files; the control trains on the same rows run by its loop."""
    train = data / "train.parquet"
    if control == "shuffled":
        register_control()
        train = control_rows(train, data / "train-shuffled-reward.parquet")
    return [f"data.train_files=[{train}]", f"data.val_files=[{data / 'test.parquet'}]"]


def run(
    seed: int,
    model: Path,
    files: list[str],
    run_dir: Path,
    steps: int,
    lr: float,
    extra: list[str],
    control: str = "none",
) -> list[dict]:
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run, not a resumed one
    if control == "shuffled":
        SHUFFLE.reseed(seed)  # this run's permutations
    cfg = load_config(
        RLConfig,
        "rl",
        [
            f"model.path={model}",
            *files,
            *RL_OVERRIDES,
            f"trainer.run_dir={run_dir}",
            f"trainer.total_steps={steps}",
            f"trainer.seed={seed}",
            f"actor.optim.lr={lr}",
            *extra,
        ],
    )
    RLTrainer(cfg).fit()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = []
    for r in rows:
        point: dict = {"step": r["step"]}
        if "val/acc" in r:  # greedy, held-out, after `step` updates
            point.update(
                val_acc=r["val/acc"],
                tool_success=r["val/agent/tool_success"],
                turns=r["val/agent/turns_mean"],
            )
        if "acc" in r:  # this step's sampled (temperature 1) training episodes, drawn before its update
            point.update(train_acc=r["acc"], train_tool_calls=r["agent/tool_calls_per_episode"])
        curve.append(point)
    return curve


CONTROL_CASE = "shuffled-reward control (each episode paid a random groupmate's reward): "


def summary_rows(curves: list[list[dict]], case: str) -> list[dict]:
    """One row per metric: its value at the warm start (baseline) and after the last step, over the seeds."""
    rows = []
    for metric, name in (
        ("val_acc", "held_out_val_acc"),
        ("tool_success", "held_out_tool_success"),
        # start: step 1's sampled episodes (the warm start's), end: the last step's
        ("train_acc", "sampled_train_acc"),
        ("train_tool_calls", "sampled_train_tool_calls_per_episode"),
    ):
        start = [next(c for c in curve if metric in c)[metric] for curve in curves]
        end = [curve[-1][metric] for curve in curves]
        rows.append(
            {
                "case": case,
                "metric": name,
                # a learning result: the mean over the seeds (BENCHMARKS.md), the median beside it
                "value": round(statistics.mean(end), 4),
                "baseline_name": "sft_warm_start",
                "baseline_value": round(statistics.mean(start), 4),
                # no ratio to a warm start at 0 (the gain in points says it: value - baseline_value)
                "ratio": round(statistics.mean(end) / statistics.mean(start), 4)
                if statistics.mean(start)
                else None,
                "median": round(statistics.median(end), 4),
                "higher_is_better": True,
                "repeats": len(end),
                "spread": [round(min(end), 4), round(max(end), 4)],
                "per_seed_start": start,
                "per_seed_end": end,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--n-sft", type=int, default=1000, help="tool-using demonstrations for the warm start"
    )
    parser.add_argument("--sft-steps", type=int, default=600)
    parser.add_argument("--sft-batch", type=int, default=16, help="demonstrations per SFT step (both stages)")
    parser.add_argument("--lr", type=float, default=5e-5, help="GRPO's learning rate")
    parser.add_argument(
        "--pretrain-steps",
        type=int,
        default=1500,
        help="continued pre-training on the task's texts; 0 = none",
    )
    parser.add_argument(
        "--no-tool-share",
        type=float,
        default=0.5,
        help="share of the second SFT stage's demonstrations that answer at once, without the tool",
    )
    parser.add_argument(
        "--mix-steps", type=int, default=100, help="second SFT stage's steps (0 = no second stage)"
    )
    parser.add_argument("--mix-lr", type=float, default=3e-4, help="second SFT stage's peak lr")
    parser.add_argument(
        "--control",
        choices=["none", "shuffled"],
        default="none",
        help="shuffled: the same GRPO runs (warm start, seeds) with each episode paid the reward of a "
        "random episode of its group (a seeded permutation per group); writes agent_curve_control.json/.png",
    )
    parser.add_argument(
        "--rl", nargs="*", default=[], help="further GRPO overrides (key=value), after the bench's own"
    )
    parser.add_argument("--work", default="/tmp/posttrain-bench-agent")
    args = parser.parse_args()
    quiet_transformers()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    model, data = warm_start(
        work,
        args.n_sft,
        args.sft_steps,
        args.pretrain_steps,
        args.no_tool_share,
        args.mix_steps,
        args.mix_lr,
        args.sft_batch,
    )
    files = task_files(data, args.control)
    runs = "grpo-shuffled-seed" if args.control == "shuffled" else "grpo-seed"
    curves = []
    for seed in range(args.repeats):
        curves.append(
            run(seed, model, files, work / f"{runs}{seed}", args.steps, args.lr, args.rl, args.control)
        )
        first, last = curves[-1][0], curves[-1][-1]  # step 0 and the last step are validated
        print(
            f"seed {seed}: tool success {first['tool_success']:.3f} -> {last['tool_success']:.3f}, "
            f"accuracy {first['val_acc']:.3f} -> {last['val_acc']:.3f}",
            flush=True,
        )
    warm = f"SFT {args.sft_steps} steps (batch {args.sft_batch}) on {args.n_sft} tool demos"
    if args.mix_steps:
        warm += (
            f", then {args.mix_steps} steps with {args.no_tool_share:g} of them answering without the tool"
        )
    case = f"tool_multiplication 3-4 digits, tiny, GRPO {args.steps} steps at lr {args.lr:g} from {warm}"
    name = "agent_curve_control" if args.control == "shuffled" else "agent_curve"
    if args.control == "shuffled":
        case = CONTROL_CASE + case
    rows = summary_rows(curves, case)
    result = {
        "bench": "agent_curve",
        "control": args.control,
        "machine": machine_info(torch.get_num_threads()),
        "command": "python " + " ".join(sys.argv),
        "seconds": round(time.perf_counter() - started, 1),
        "rows": rows,
        "curves": curves,
    }
    write_result(f"{name}.json", result)
    title = "tiny Qwen2 learning to use a calculator (GRPO on multi-turn episodes)"
    if args.control == "shuffled":
        title = "control: GRPO with each episode paid a random groupmate's reward"
    plot(curves, RESULTS / f"{name}.png", title)
    for row in rows:
        print(
            f"{row['metric']:<26} start {row['baseline_value']:.3f}  end median {row['value']:.3f} "
            f"[{row['spread'][0]:.3f}, {row['spread'][1]:.3f}] over {row['repeats']} seeds"
        )
    print(f"wrote {RESULTS / name}.json and {name}.png ({result['seconds']} s)")


def plot(curves: list[list[dict]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = (
        ("val_acc", "tab:blue", "-", "held-out accuracy (greedy)"),
        ("tool_success", "tab:orange", "-", "held-out tool-use success (greedy)"),
        ("train_acc", "tab:blue", ":", "training episodes' accuracy (sampled)"),
        ("train_tool_calls", "tab:orange", ":", "training episodes' tool calls (sampled)"),
    )
    for metric, color, style, label in series:
        for i, curve in enumerate(curves):
            # sampled episodes of step k come from the policy after k - 1 updates: plotted at k - 1
            shift = 1 if metric.startswith("train_") else 0
            points = [c for c in curve if metric in c]
            ax.plot(
                [c["step"] - shift for c in points],
                [c[metric] for c in points],
                color=color,
                linestyle=style,
                alpha=0.9 if i == 0 else 0.45,
                label=label if i == 0 else None,
                marker="o" if style == "-" else None,
                markersize=3,
            )
    ax.set_xlabel("GRPO updates")
    ax.set_ylabel("share of episodes / tool calls per episode")
    ax.set_title(title)
    ax.set_ylim(0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main()
