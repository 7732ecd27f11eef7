"""Tool-using agents on the explicit API: SFT on demonstrations, then GRPO on multi-turn episodes.

    python recipes/agent_loop.py --out runs/recipes/agent                  # tiny model + task built there
    python recipes/agent_loop.py --sft-steps 0 --model runs/x/sft/hf --data runs/x/data --lora-rank 8

The task is the built-in `tool_multiplication` (a calculator is the only way to get 3-4 digit products
right). SFT: each demonstration (`sft.parquet`: messages + tools) is one `cross_entropy` datum whose weights
are the assistant tokens' mask (`data.chat_masks`, as `posttrain sft data.train_on=all_assistant`). GRPO:
per step, a sampler with the current weights; `--group` episodes per prompt of the same agent loop
`posttrain train agent.enable=true` runs (the `tool_agent` env, its tools, limits and parser), sampled
through the `SamplingClient`; advantages reward - group mean, divided by the step's model-token count (the
trainer's token-mean); one `importance_sampling` datum per episode with the advantage on the model's
tokens only. Held-out greedy accuracy and tool-use success every `--val-every` steps in <out>/curve.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path

from posttrain.agents.registry import AgentSetup, dataset_row, group_builder
from posttrain.agents.rollout import EpisodeLimits, run_groups
from posttrain.agents.samplers import ClientSampler
from posttrain.agents.tool_env import ToolEnvSettings
from posttrain.agents.tools import ToolRunner, build_tools, get_parser
from posttrain.agents.training_data import sequence_datum, trajectory_sequences
from posttrain.client import ServiceClient, types
from posttrain.data.chat_masks import conversation_tokens, parse_conversation
from posttrain.data.dataset import PromptDataset, iter_rows
from posttrain.data.tasks import arithmetic, tool_multiplication
from posttrain.models import load_tokenizer, make_tiny_model


def prepare(out: Path, model: Path | None, data: Path | None, tools: list[dict]) -> tuple[Path, Path]:
    if model is None and not (model := out / "model").joinpath("config.json").exists():
        texts = arithmetic.corpus(10000) + tool_multiplication.corpus(10000, tools=tools)
        make_tiny_model("tiny", model, texts)
    if data is None and not (data := out / "data").joinpath("sft.parquet").exists():
        tool_multiplication.write_tool_multiplication_dataset(data, tools, n_train=2000, n_test=64, n_sft=128)
    return model, data


def sft_datums(tok, path: Path) -> list[types.Datum]:  # noqa: ANN001
    datums = []
    for _, i, row in iter_rows([path]):
        messages = parse_conversation(row["messages"], f"row {i}")
        ids, mask = conversation_tokens(tok, messages, "all_assistant", f"row {i}", json.loads(row["tools"]))
        datums.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": [float(m) for m in mask[1:]]},
            )
        )
    return datums


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="HF dir (default: a tiny model built in --out)")
    p.add_argument("--data", type=Path, help="tool_multiplication dir (default: built in --out)")
    p.add_argument("--out", type=Path, default=Path("runs/recipes/agent"))
    p.add_argument("--sft-steps", type=int, default=60)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--sft-lr", type=float, default=3e-3)
    p.add_argument("--lora-rank", type=int, default=0)
    p.add_argument("--val-every", type=int, default=5)
    p.add_argument("--val-prompts", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tools = build_tools(["calculator"], None)
    model, data = prepare(args.out, args.model, args.data, [t.schema() for t in tools])
    tok = load_tokenizer(model)
    runner = ToolRunner(tools, max_concurrency=2, timeout_s=5.0)
    setup = AgentSetup(
        tok, tool_runner=runner, tool_parser=get_parser("hermes"), tool_settings=ToolEnvSettings()
    )
    limits = EpisodeLimits(max_turns=3, max_tokens_per_turn=40, max_total_tokens=900)
    train = PromptDataset(data / "train.parquet", tok, max_prompt_length=128)
    test = PromptDataset(data / "test.parquet", tok, max_prompt_length=128)
    loop = asyncio.new_event_loop()  # one loop: the tool pool lives in it
    curve: list[dict] = []

    def episodes(sampler, items: list[dict], n: int, temperature: float):  # noqa: ANN001, ANN202
        params = types.SamplingParams(temperature=temperature)
        builders = [group_builder(dataset_row(it), setup, it["index"]) for it in items]
        return loop.run_until_complete(run_groups(builders, n, ClientSampler(sampler, params), limits))

    def validate(sampler, step: int) -> None:  # noqa: ANN001
        groups, _ = episodes(sampler, [test[i] for i in range(min(args.val_prompts, len(test)))], 1, 0.0)
        flat = [t for g in groups for t in g]
        acc = statistics.fmean(t.answer_score >= 1 for t in flat)
        tool = statistics.fmean(t.made_successful_call for t in flat)
        curve.append({"step": step, "val_acc": acc, "tool_success": tool})
        print(f"step {step}: held-out accuracy {acc:.1%}, tool-use success {tool:.1%}", flush=True)

    with ServiceClient("local", root_dir=args.out / "api", seed=args.seed) as sc:
        if args.lora_rank:
            tc = sc.create_lora_training_client(str(model), rank=args.lora_rank, seed=args.seed)
        else:
            tc = sc.create_training_client(str(model))
        demos = sft_datums(tok, data / "sft.parquet") if args.sft_steps else []
        for step in range(args.sft_steps):
            batch = [demos[(step * 16 + k) % len(demos)] for k in range(16)]
            out = tc.forward_backward(batch, "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=args.sft_lr)).result()
            if step % 10 == 0:
                print(f"sft step {step}: loss {out.metrics.get('loss:sum', float('nan')):.3f}", flush=True)
        sampler = tc.save_weights_and_get_sampling_client()
        validate(sampler, 0)
        adam = types.AdamParams(learning_rate=args.lr, beta1=0.9, beta2=0.999, eps=1e-8, grad_clip_norm=1.0)
        for step in range(1, args.steps + 1):
            items = [train[(step * args.prompts + k) % len(train)] for k in range(args.prompts)]
            groups, metrics = episodes(sampler, items, args.group, 1.0)
            rows = []
            for group in groups:
                rewards = [t.total_reward for t in group]
                mean = statistics.fmean(rewards)
                rows += [
                    (s, r - mean)
                    for t, r in zip(group, rewards, strict=True)
                    for s in trajectory_sequences(t)
                ]
            n_tokens = sum(sum(s.mask) for s, _ in rows) or 1.0
            batch = [sequence_datum(s, a / n_tokens) for s, a in rows if a != 0]
            if batch:
                tc.forward_backward(batch, "importance_sampling").result()
                tc.optim_step(adam).result()
            sampler = tc.save_weights_and_get_sampling_client()
            print(
                f"step {step}: reward {metrics['agent/reward_mean']:.3f}, turns {metrics['agent/turns_mean']:.2f}"
            )
            if step % args.val_every == 0 or step == args.steps:
                validate(sampler, step)
    loop.run_until_complete(runner.close())
    (args.out / "curve.json").write_text(json.dumps(curve, indent=1))
    print(
        f"agent_loop: accuracy {curve[0]['val_acc']:.1%} -> {curve[-1]['val_acc']:.1%}, tool-use success "
        f"{curve[0]['tool_success']:.1%} -> {curve[-1]['tool_success']:.1%}; curve in {args.out / 'curve.json'}"
    )


if __name__ == "__main__":
    main()
