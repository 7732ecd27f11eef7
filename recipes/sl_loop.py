"""Supervised fine-tuning on the explicit API: cross-entropy on the arithmetic task's chat-templated answers.

    python recipes/sl_loop.py --out runs/recipes/sl                          # tiny model and data built there
    python recipes/sl_loop.py --backend ray --workers 2 --seed 0,1,2 --out runs/recipes/sl

Each datum is the prompt rendered with the tokenizer's chat template, then the answer and eos (as `posttrain
sft` renders it: posttrain/data/sft_dataset.py), with weight 0 on prompt tokens and 1 on the answer + eos.
tinker's losses SUM over tokens and datums, so the weights are divided by the batch's answer tokens: the
token-mean of `posttrain sft`. The learning-rate schedule (linear warm-up, cosine) is computed here and sent
with every `optim_step`, as tinker users do; AdamW betas 0.9/0.95, eps 1e-8, clip 1.0 are `posttrain sft`'s
defaults (tinker's differ). Writes <out>/curves.json: held-out NLL per answer token, every `--eval-every`.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from posttrain.client import ServiceClient, types
from posttrain.data.dataloader import PromptDataLoader
from posttrain.data.sft_dataset import SFTDataset
from posttrain.data.tasks.arithmetic import corpus, write_arithmetic_dataset
from posttrain.demo import TASK
from posttrain.models import load_tokenizer, make_tiny_model


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up over `warmup` steps, then constant or cosine decay to 0 (posttrain's lr_factor)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    if args.schedule == "constant":
        return args.lr
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def datum(item: dict, scale: float = 1.0) -> types.Datum:
    """Position i predicts token i+1; the weight is the next token's loss mask (1 on answer + eos)."""
    ids, mask = item["input_ids"], item["loss_mask"]
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [m * scale for m in mask[1:]]},
    )


def held_out_nll(tc, test: list[types.Datum]) -> float:  # noqa: ANN001
    """Mean negative log-likelihood per answer token (weights are 0/1 here, so loss:sum / their sum)."""
    out = tc.forward(test, "cross_entropy").result()
    tokens = sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in test)
    return out.metrics["loss:sum"] / tokens


def run(args: argparse.Namespace, seed: int, model: Path, data: Path) -> dict:
    tok = load_tokenizer(model)
    train = SFTDataset(data / "train.parquet", tok, max_length=96)
    test_set = SFTDataset(data / "test.parquet", tok, max_length=96)
    test = [datum(test_set[i]) for i in range(len(test_set))]
    loader = PromptDataLoader(train, args.batch, lambda items, uids: items, seed=seed)
    ray = {"n_workers": args.workers, "device": "cpu"} if args.backend == "ray" else {}
    curve, started = [], time.perf_counter()
    with ServiceClient(args.backend, root_dir=args.out / "api", **ray) as service:
        if args.lora_rank:
            tc = service.create_lora_training_client(str(model), rank=args.lora_rank, seed=seed)
        else:
            tc = service.create_training_client(str(model))
        curve.append({"step": 0, "nll": held_out_nll(tc, test)})
        for step in range(1, args.steps + 1):
            items = loader.next_batch()
            answer_tokens = sum(sum(it["loss_mask"]) for it in items)
            batch = [datum(it, 1.0 / answer_tokens) for it in items]  # token-mean over the batch
            adam = types.AdamParams(
                learning_rate=lr_at(step - 1, args), beta1=0.9, beta2=0.95, eps=1e-8, grad_clip_norm=1.0
            )
            fb, opt = tc.forward_backward(batch, "cross_entropy"), tc.optim_step(adam)
            train_nll, grad_norm = fb.result().metrics["loss:sum"], opt.result().metrics["grad_norm:mean"]
            if step % args.eval_every == 0 or step == args.steps:
                curve.append({"step": step, "nll": held_out_nll(tc, test), "train_nll": train_nll})
                print(
                    f"seed {seed} step {step}: train nll {train_nll:.3f}  held-out nll "
                    f"{curve[-1]['nll']:.3f}  grad norm {grad_norm:.2f}",
                    flush=True,
                )
    return {"seed": seed, "curve": curve, "seconds": round(time.perf_counter() - started, 1)}


def prepare(out: Path, model: Path | None, data: Path | None) -> tuple[Path, Path]:
    """The base model and the task: given, or built in `out` as the demo builds them (kept for the next run)."""
    if model is None and not (model := out / "model").joinpath("config.json").exists():
        make_tiny_model("tiny", model, corpus(20000, seed=0))
    if data is None and not (data := out / "data").joinpath("test.parquet").exists():
        write_arithmetic_dataset(data, **TASK)
    return model, data


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["local", "ray"], default="local")
    p.add_argument("--workers", type=int, default=2, help="ray: data-parallel workers")
    p.add_argument("--model", type=Path, help="base model (HF dir); default: a tiny one built in --out")
    p.add_argument("--data", type=Path, help="dir with train/test.parquet; default: the demo's task in --out")
    p.add_argument("--out", type=Path, default=Path("runs/recipes/sl"))
    p.add_argument("--seed", default="0", help="comma-separated: one run per seed")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--schedule", choices=["cosine", "constant"], default="cosine")
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--lora-rank", type=int, default=0, help="0 = full weights (as posttrain sft)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model, data = prepare(args.out, args.model, args.data)
    runs = [run(args, int(s), model, data) for s in args.seed.split(",")]
    finals = [r["curve"][-1]["nll"] for r in runs]
    mean = sum(finals) / len(finals)
    summary = {"args": vars(args) | {"model": model, "data": data}, "runs": runs}
    (args.out / "curves.json").write_text(json.dumps(summary, indent=1, default=str))
    print(
        f"sl_loop: {args.steps} steps, seeds {args.seed}: held-out NLL/token {mean:.3f} "
        f"(min {min(finals):.3f}, max {max(finals):.3f}); curves in {args.out / 'curves.json'}"
    )


if __name__ == "__main__":
    main()
