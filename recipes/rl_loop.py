"""GRPO on the explicit API: the arithmetic task from the demo's SFT warm start, with `importance_sampling`.

    python recipes/rl_loop.py --out runs/recipes/rl             # builds the demo's warm start there (~1 min)
    python recipes/rl_loop.py --model runs/demo/sft/hf --data runs/demo/data --seed 0,1,2
    python recipes/rl_loop.py --backend ray --workers 2 --model runs/demo/sft/hf --data runs/demo/data

Per step: a sampler with the current weights; 8 samples for each of 32 prompts (temperature 1, up to 8
tokens, stopping at eos); the built-in scorer; group-relative advantages ((reward - group mean) / group std,
as GRPO); one `forward_backward` + `optim_step`. tinker's losses SUM over tokens and datums, `posttrain
train` takes the token-mean over the batch's response tokens: the advantages are divided by that count, so
the update is the trainer's (AdamW betas 0.9/0.999, eps 1e-8, clip 1.0: its defaults, not tinker's). No KL
term: compare with `posttrain train actor.use_kl_loss=false`. Prompts come in the trainer's order for a seed.
Held-out greedy accuracy every `--val-every` steps; curves in <out>/curves.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from posttrain.client import ServiceClient, types
from posttrain.config.load import load_config
from posttrain.config.schema import SFTConfig
from posttrain.data.dataloader import PromptDataLoader
from posttrain.data.dataset import PromptDataset
from posttrain.data.tasks.arithmetic import corpus, write_arithmetic_dataset
from posttrain.demo import SFT_OVERRIDES, TASK
from posttrain.models import load_tokenizer, make_tiny_model
from posttrain.rewards import default_compute_score
from posttrain.trainers.sft import SFTTrainer


def sample_all(sampler, prompts: list[dict], n: int, params: types.SamplingParams) -> list[list]:  # noqa: ANN001
    """Every prompt's n sequences; all requests are submitted before the first is awaited."""
    futures = [sampler.sample(types.ModelInput.from_ints(p["input_ids"]), n, params) for p in prompts]
    return [f.result().sequences for f in futures]


def score(tok, prompt: dict, seq) -> float:  # noqa: ANN001
    text = tok.decode(list(seq.tokens), skip_special_tokens=True)
    return float(default_compute_score(prompt["data_source"], text, prompt["ground_truth"]))


def rl_datum(prompt: list[int], seq, advantage: float) -> types.Datum:  # noqa: ANN001
    """Input prompt + response[:-1], targets shifted by one; the sampler's log-probs and the advantage on
    the positions that predict response tokens, 0 on those that predict prompt tokens."""
    tokens, pad = prompt + list(seq.tokens), [0.0] * (len(prompt) - 1)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": pad + [float(x) for x in seq.logprobs],
            "advantages": pad + [advantage] * len(seq.tokens),
        },
    )


def run(args: argparse.Namespace, seed: int, model: Path, data: Path) -> dict:
    tok = load_tokenizer(model)
    train = PromptDataset(data / "train.parquet", tok, max_prompt_length=64)
    test_set = PromptDataset(data / "test.parquet", tok, max_prompt_length=64)
    test = [test_set[i] for i in range(min(256, len(test_set)))]  # the trainer's data.val_max_prompts
    loader = PromptDataLoader(train, args.prompts, lambda items, uids: items, seed=seed)  # trainer's order
    greedy = types.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, stop=[tok.eos_token_id])
    # unseeded: drawn from the worker's stream (its seed below)
    sampling = greedy.model_copy(update={"temperature": 1.0})
    adam = types.AdamParams(learning_rate=args.lr, beta1=0.9, beta2=0.999, eps=1e-8, grad_clip_norm=1.0)
    ray = {"n_workers": args.workers, "device": "cpu"} if args.backend == "ray" else {}
    val, steps, started = [], [], time.perf_counter()

    def validate(sampler, step: int) -> None:  # noqa: ANN001
        seqs = sample_all(sampler, test, 1, greedy)
        correct = [score(tok, p, s[0]) >= 1 for p, s in zip(test, seqs, strict=True)]
        val.append({"step": step, "acc": statistics.fmean(correct)})
        print(f"seed {seed} step {step}: held-out accuracy {val[-1]['acc']:.1%}", flush=True)

    with ServiceClient(args.backend, root_dir=args.out / "api", seed=seed, **ray) as sc:
        if args.lora_rank:
            tc = sc.create_lora_training_client(str(model), rank=args.lora_rank, seed=seed)
        else:
            tc = sc.create_training_client(str(model))
        sampler = tc.save_weights_and_get_sampling_client()
        validate(sampler, 0)
        for step in range(1, args.steps + 1):
            t0, prompts = time.perf_counter(), loader.next_batch()
            groups = sample_all(sampler, prompts, args.group, sampling)
            batch, rewards, n_tokens = [], [], sum(len(s.tokens) for g in groups for s in g)
            for prompt, group in zip(prompts, groups, strict=True):
                r = [score(tok, prompt, s) for s in group]
                rewards += r
                mean, std = statistics.fmean(r), statistics.stdev(r)
                if std == 0 and not args.all_groups:
                    continue  # no signal; its tokens still count in n_tokens, as in the trainer's token-mean
                for s, reward in zip(group, r, strict=True):
                    advantage = (reward - mean) / (std + 1e-6) if args.std_norm else reward - mean
                    batch.append(rl_datum(prompt["input_ids"], s, advantage / n_tokens))
            row = {"step": step, "reward": statistics.fmean(rewards), "tokens": n_tokens}
            if batch:  # submitted back to back, then awaited
                fb, opt = tc.forward_backward(batch, "importance_sampling"), tc.optim_step(adam)
                fb.result()
                row["grad_norm"] = opt.result().metrics["grad_norm:mean"]  # before clipping at 1.0
            sampler = tc.save_weights_and_get_sampling_client()
            steps.append(row | {"s": round(time.perf_counter() - t0, 3)})
            if step % args.val_every == 0 or step == args.steps:
                validate(sampler, step)
    return {"seed": seed, "val": val, "train": steps, "seconds": round(time.perf_counter() - started, 1)}


def prepare(out: Path, model: Path | None, data: Path | None) -> tuple[Path, Path]:
    """The task and the SFT warm start: given, or built in `out` as the demo builds them (posttrain/demo.py:
    its problems, tiny model, and SFT stopped at held-out NLL 0.7); kept for the next run."""
    if data is None and not (data := out / "data").joinpath("test.parquet").exists():
        write_arithmetic_dataset(data, **TASK)
    if model is None and not (model := out / "sft" / "hf").joinpath("config.json").exists():
        if not (out / "model" / "config.json").exists():
            make_tiny_model("tiny", out / "model", corpus(20000, seed=0))
        files = [f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{data / 'test.parquet'}]"]
        overrides = [f"model.path={out / 'model'}", *files, f"trainer.run_dir={out / 'sft'}", *SFT_OVERRIDES]
        SFTTrainer(load_config(SFTConfig, "sft", overrides)).fit()
    return model, data


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["local", "ray"], default="local")
    p.add_argument("--workers", type=int, default=2, help="ray: data-parallel workers")
    p.add_argument("--model", type=Path, help="SFT warm start (HF dir); default: the demo's, built in --out")
    p.add_argument("--data", type=Path, help="dir with train/test.parquet; default: the demo's task")
    p.add_argument("--out", type=Path, default=Path("runs/recipes/rl"))
    p.add_argument("--seed", default="0", help="comma-separated: one run per seed")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--no-std-norm", dest="std_norm", action="store_false", help="A = r - mean (Dr. GRPO)")
    p.add_argument("--val-every", type=int, default=10)
    p.add_argument("--all-groups", action="store_true", help="train on groups with equal rewards too (A = 0)")
    p.add_argument("--lora-rank", type=int, default=0, help="0 = full weights (as posttrain train)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model, data = prepare(args.out, args.model, args.data)
    runs = [run(args, int(s), model, data) for s in args.seed.split(",")]
    finals = [r["val"][-1]["acc"] for r in runs]
    summary = {"args": vars(args) | {"model": model, "data": data}, "runs": runs}
    (args.out / "curves.json").write_text(json.dumps(summary, indent=1, default=str))
    print(
        f"rl_loop: {args.steps} steps, seeds {args.seed}: held-out accuracy {runs[0]['val'][0]['acc']:.1%} "
        f"-> {statistics.fmean(finals):.1%} (min {min(finals):.1%}, max {max(finals):.1%}); "
        f"curves in {args.out / 'curves.json'}"
    )


if __name__ == "__main__":
    main()
