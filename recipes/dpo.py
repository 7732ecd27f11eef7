"""DPO on the explicit API: `forward_backward_custom` with posttrain's preference losses on whole sequences.

    python recipes/dpo.py --out runs/recipes/dpo                      # tiny model and data built there
    python recipes/dpo.py --loss sigmoid,sft --weights 1,0.1 --lora-rank 8 --out runs/recipes/dpo

Pairs come from the arithmetic task: the prompt rendered with the chat template, then the right answer (chosen)
or a wrong one (rejected) and eos, as `posttrain dpo` tokenizes text pairs. Each completion is one datum; the
reference is the initial weights, whose log-probs are taken once with `forward` before any update (posttrain
dpo's `dpo.reference=precompute`). The custom loss sums each datum's target log-probs over its completion and
calls `algorithms.preference_losses.preference_loss`: the same loss as `posttrain dpo`. Writes
<out>/curve.json: loss, reward accuracy and margin per step.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from posttrain.algorithms.preference_losses import (
    PairLogps,
    PreferenceOptions,
    check_preference,
    preference_loss,
)
from posttrain.client import ServiceClient, types
from posttrain.data.dataset import iter_rows, parse_messages, render_prompt
from posttrain.data.tasks.arithmetic import corpus, write_arithmetic_dataset
from posttrain.demo import TASK
from posttrain.models import load_tokenizer, make_tiny_model


def prepare(out: Path, model: Path | None, data: Path | None) -> tuple[Path, Path]:
    """The base model and the task: given, or built in `out` as the demo builds them (as recipes/sl_loop.py)."""
    if model is None and not (model := out / "model").joinpath("config.json").exists():
        make_tiny_model("tiny", model, corpus(20000, seed=0))
    if data is None and not (data := out / "data").joinpath("test.parquet").exists():
        write_arithmetic_dataset(data, **TASK)
    return model, data


def make_pairs(tok, path: Path, n: int, seed: int) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt ids, chosen ids, rejected ids) per problem: the answer vs the answer off by 1-9."""
    rng, out = random.Random(seed), []
    for _, _, row in iter_rows([path]):
        _, prompt = render_prompt(tok, parse_messages(row, "row"))
        answer = int(row["reward_model"]["ground_truth"])
        wrong = answer + rng.choice([-1, 1]) * rng.randint(1, 9)
        encode = lambda text: list(tok.encode(text + tok.eos_token, add_special_tokens=False))  # noqa: E731
        out.append((prompt, encode(str(answer)), encode(str(wrong))))
        if len(out) == n:
            break
    return out


def datum(prompt: list[int], completion: list[int]) -> tuple[types.Datum, torch.Tensor]:
    """Position i predicts token i+1; the mask marks the targets that are completion tokens."""
    ids = prompt + completion
    mask = torch.tensor([0.0] * (len(prompt) - 1) + [1.0] * len(completion))
    weights = mask.tolist()
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": weights},
    ), mask


def run(args: argparse.Namespace, model: Path, data: Path) -> list[dict]:
    tok = load_tokenizer(model)
    losses, weights = (
        args.loss.split(","),
        [float(w) for w in args.weights.split(",")] if args.weights else [],
    )
    options = PreferenceOptions(beta=args.beta)
    check_preference(losses, weights, options)
    pairs = make_pairs(tok, data / "train.parquet", args.pairs, args.seed)
    with ServiceClient("local", root_dir=args.out / "api") as service:
        if args.lora_rank:
            tc = service.create_lora_training_client(str(model), rank=args.lora_rank, seed=args.seed)
        else:
            tc = service.create_training_client(str(model))
        encoded = [[datum(p, c), datum(p, r)] for p, c, r in pairs]  # rows 2i chosen, 2i+1 rejected
        flat = [d for pair in encoded for d, _ in pair]
        masks = [m for pair in encoded for _, m in pair]
        ref_out = tc.forward(flat, "cross_entropy").result().loss_fn_outputs  # the initial weights
        ref = torch.tensor(
            [float((o["logprobs"].to_torch() * m).sum()) for o, m in zip(ref_out, masks, strict=True)]
        )
        curve = []
        for step in range(1, args.steps + 1):
            rows = random.Random(args.seed * 1000 + step).sample(range(len(pairs)), args.batch)
            idx = [2 * i + side for i in rows for side in (0, 1)]
            batch_masks, batch_ref = [masks[i] for i in idx], ref[idx].double()

            def dpo_loss(data, lps, batch_masks=batch_masks, batch_ref=batch_ref):  # noqa: ANN001, ANN202
                sums = torch.stack([(lp.double() * m).sum() for lp, m in zip(lps, batch_masks, strict=True)])
                tokens = torch.stack([m.sum().double() for m in batch_masks])
                logps = PairLogps(
                    sums[0::2], sums[1::2], tokens[0::2], tokens[1::2], batch_ref[0::2], batch_ref[1::2]
                )
                per_pair, metrics = preference_loss(logps, losses, weights, options)
                return per_pair.mean(), {k: float(v.mean()) for k, v in metrics.items()}

            fb = tc.forward_backward_custom([flat[i] for i in idx], dpo_loss)
            tc.optim_step(
                types.AdamParams(learning_rate=args.lr, beta1=0.9, beta2=0.999, eps=1e-8, grad_clip_norm=1.0)
            )
            m = fb.result().metrics
            curve.append({"step": step, "loss": m["loss:sum"], "accuracy": m["rewards_accuracy"],
                          "margin": m["rewards_margin"]})  # fmt: skip
            print(f"step {step}: loss {m['loss:sum']:.4f} accuracy {m['rewards_accuracy']:.2f} "
                  f"margin {m['rewards_margin']:.3f}", flush=True)  # fmt: skip
    return curve


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="base model (HF dir); default: a tiny one built in --out")
    p.add_argument("--data", type=Path, help="dir with train/test.parquet; default: the demo's task in --out")
    p.add_argument("--out", type=Path, default=Path("runs/recipes/dpo"))
    p.add_argument(
        "--loss", default="sigmoid", help="comma-separated preference losses (posttrain dpo's names)"
    )
    p.add_argument("--weights", default="", help="one weight per loss; empty = all 1")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--pairs", type=int, default=256)
    p.add_argument("--batch", type=int, default=16, help="pairs per step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lora-rank", type=int, default=0, help="0 = full weights")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model, data = prepare(args.out, args.model, args.data)
    curve = run(args, model, data)
    (args.out / "curve.json").write_text(
        json.dumps({"args": vars(args), "curve": curve}, indent=1, default=str)
    )


if __name__ == "__main__":
    main()
