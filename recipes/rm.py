"""A reward model on the explicit API: the Bradley-Terry loss through `forward_backward_custom`, the LM head as score.

    python recipes/rm.py --out runs/recipes/rm                          # tiny model and pairs built there
    python recipes/rm.py --model runs/demo/sft/hf --steps 300 --out runs/recipes/rm

The explicit API trains language models, so the score is read off the LM head: after the chat-rendered prompt
and response (as `posttrain rm` renders a chat pair), r(x, y) = log p(YES | x, y) - log p(NO | x, y) for two
fixed tokens, which is logit(YES) - logit(NO) = (w_YES - w_NO) . h_last: a linear score head on the last hidden
state, as `posttrain rm`'s sequence classifier has, made of two rows of the unembedding. Each response is two
datums (target YES, then NO, after its last token); the custom loss is `algorithms.reward_model_loss.
bradley_terry_loss` (`posttrain rm`'s loss, with its centering) on each pair's two scores. Pairs are the
arithmetic task's (right vs wrong answer; posttrain/data/tasks/arithmetic_pairs.py). Held-out pairwise accuracy
with `forward` before training and every --eval-every steps. Writes <out>/curve.json.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from posttrain.algorithms.reward_model_loss import bradley_terry_loss
from posttrain.client import ServiceClient, types
from posttrain.data.preference_dataset import PreferenceDataset
from posttrain.data.tasks.arithmetic import corpus
from posttrain.data.tasks.arithmetic_pairs import write_arithmetic_pairs
from posttrain.models import load_tokenizer, make_tiny_model


def prepare(out: Path, model: Path | None, pairs: Path | None) -> tuple[Path, Path]:
    """The base model and the pairs: given, or built in `out` (the demo's model, its task's problems)."""
    if model is None and not (model := out / "model").joinpath("config.json").exists():
        make_tiny_model("tiny", model, corpus(20000, seed=0))
    if pairs is None and not (pairs := out / "pairs").joinpath("test.parquet").exists():
        write_arithmetic_pairs(pairs, n_train=2200, n_test=256)
    return model, pairs


def judge_tokens(tok, names: str) -> tuple[int, int]:  # noqa: ANN001
    ids = [tok.encode(name, add_special_tokens=False) for name in names.split(",")]
    if len(ids) != 2 or any(len(i) != 1 for i in ids) or ids[0] == ids[1]:
        raise SystemExit(f"--tokens {names!r}: give two different single-token strings, e.g. Y,N")
    return ids[0][0], ids[1][0]


def datums(ids: list[int], yes: int, no: int) -> list[types.Datum]:
    """The sequence, then YES / NO as the target after its last token (weight 1 there only)."""
    weights = [0.0] * (len(ids) - 1) + [1.0]
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(ids),
            loss_fn_inputs={"target_tokens": ids[1:] + [target], "weights": weights},
        )
        for target in (yes, no)
    ]


def encode(tok, path: Path, n: int, yes: int, no: int) -> list[list[types.Datum]]:  # noqa: ANN001
    """The first `n` pairs of `path`, tokenized as `posttrain rm` does; per pair [c_YES, c_NO, r_YES, r_NO]."""
    ds = PreferenceDataset(path, tok, 256)
    sides = ("chosen", "rejected")
    return [[d for side in sides for d in datums(ds[i][side], yes, no)] for i in range(min(n, len(ds)))]


def scores(lps: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) scores per pair from the log-probs of datums [c_YES, c_NO, r_YES, r_NO] per pair."""
    r = torch.stack([lps[i][-1] - lps[i + 1][-1] for i in range(0, len(lps), 2)]).double()
    return r[0::2], r[1::2]


def accuracy(tc, data: list[types.Datum]) -> float:  # noqa: ANN001
    out = tc.forward(data, "cross_entropy").result().loss_fn_outputs
    chosen, rejected = scores([o["logprobs"].to_torch() for o in out])
    return float((chosen > rejected).double().mean())


def run(args: argparse.Namespace, model: Path, pairs: Path) -> dict:
    tok = load_tokenizer(model)
    yes, no = judge_tokens(tok, args.tokens)
    train = encode(tok, pairs / "train.parquet", args.pairs, yes, no)
    test = encode(tok, pairs / "test.parquet", args.test_pairs, yes, no)
    flat_test = [d for pair in test for d in pair]
    curve: dict = {"train": [], "eval": []}
    with ServiceClient("local", root_dir=args.out / "api") as service:
        if args.lora_rank:
            tc = service.create_lora_training_client(str(model), rank=args.lora_rank, seed=args.seed)
        else:
            tc = service.create_training_client(str(model))
        curve["eval"].append({"step": 0, "accuracy": accuracy(tc, flat_test)})
        for step in range(1, args.steps + 1):
            batch = random.Random(args.seed * 1000 + step).sample(train, min(args.batch, len(train)))

            def bt_loss(data, lps):  # noqa: ANN001, ANN202
                losses, metrics = bradley_terry_loss(*scores(lps), center_coef=args.center)
                return losses.mean(), {k: float(v.mean()) for k, v in metrics.items()}

            fb = tc.forward_backward_custom([d for pair in batch for d in pair], bt_loss)
            tc.optim_step(types.AdamParams(learning_rate=args.lr, beta1=0.9, beta2=0.999, eps=1e-8))
            m = fb.result().metrics
            curve["train"].append(
                {"step": step, "loss": m["loss:sum"], "accuracy": m["accuracy"], "margin": m["margin"]}
            )
            print(f"step {step}: loss {m['loss:sum']:.4f} accuracy {m['accuracy']:.2f}", flush=True)
            if step % args.eval_every == 0 or step == args.steps:
                curve["eval"].append({"step": step, "accuracy": accuracy(tc, flat_test)})
                print(
                    f"step {step}: held-out pairwise accuracy {curve['eval'][-1]['accuracy']:.4f}", flush=True
                )
    return curve


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="base model (HF dir); default: a tiny one built in --out")
    p.add_argument("--pairs", dest="pair_dir", type=Path, help="dir with train/test.parquet of pairs")
    p.add_argument("--out", type=Path, default=Path("runs/recipes/rm"))
    p.add_argument("--tokens", default="Y,N", help="the two tokens whose logit difference is the score")
    p.add_argument("--n-pairs", dest="pairs", type=int, default=2200, help="training pairs used")
    p.add_argument("--test-pairs", type=int, default=256)
    p.add_argument("--batch", type=int, default=32, help="pairs per step")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--center", type=float, default=0.0, help="center_rewards_coefficient")
    p.add_argument("--lora-rank", type=int, default=0, help="0 = full weights")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model, pairs = prepare(args.out, args.model, args.pair_dir)
    curve = run(args, model, pairs)
    (args.out / "curve.json").write_text(json.dumps({"args": vars(args), **curve}, indent=1, default=str))


if __name__ == "__main__":
    main()
