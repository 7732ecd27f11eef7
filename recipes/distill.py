"""On-policy distillation on the explicit API: the student samples, a teacher scores its tokens, and the
per-token reverse KL is the (negative) advantage of `importance_sampling` (tinker-cookbook's recipe; MiniLLM,
GKD). The teacher shares the student's tokenizer and is a sampler on its own weights (`compute_logprobs`).

    python recipes/distill.py --out runs/recipes/distill              # student, teacher and data built there
    python recipes/distill.py --student DIR --teacher DIR --steps 50

By default the student is the tiny preset and the teacher the small preset on the same tokenizer
(`make-model --tokenizer-from`), warmed up with `posttrain sft`. For token t of a sampled response,
reverse_kl_t = log p_student(x_t) - log p_teacher(x_t) (algorithms/distillation.py) and A_t = -coef *
reverse_kl_t; no reward is used. Writes <out>/curve.json: the per-token KL to the teacher and the held-out
accuracy (greedy) per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from posttrain.algorithms.distillation import reverse_kl_advantages
from posttrain.client import ServiceClient, types
from posttrain.config.load import load_config
from posttrain.config.schema import SFTConfig
from posttrain.data.dataloader import PromptDataLoader
from posttrain.data.dataset import PromptDataset
from posttrain.data.tasks.arithmetic import corpus, write_arithmetic_dataset
from posttrain.demo import SFT_OVERRIDES, TASK
from posttrain.models import load_tokenizer, make_tiny_model
from posttrain.models.shared_tokenizer import check_same_tokenizer
from posttrain.rewards import default_compute_score
from posttrain.trainers.sft import SFTTrainer


def prepare(args: argparse.Namespace) -> tuple[Path, Path, Path]:
    """Data, student and teacher: given, or built in --out (the teacher: small preset, SFT on the task)."""
    out = args.out
    if (data := args.data) is None and not (data := out / "data").joinpath("test.parquet").exists():
        write_arithmetic_dataset(data, **TASK)
    if (student := args.student) is None and not (student := out / "student").joinpath(
        "config.json"
    ).exists():
        make_tiny_model("tiny", student, corpus(20000, seed=0))
    if (teacher := args.teacher) is None and not (teacher := out / "teacher" / "hf").joinpath(
        "config.json"
    ).exists():
        make_tiny_model("small", out / "teacher" / "init", [], seed=1, tokenizer_from=student)
        files = [f"data.train_files=[{data / 'train.parquet'}]", f"data.val_files=[{data / 'test.parquet'}]"]
        overrides = [f"model.path={out / 'teacher' / 'init'}", *files, f"trainer.run_dir={out / 'teacher'}"]
        SFTTrainer(load_config(SFTConfig, "sft", [*overrides, *SFT_OVERRIDES])).fit()
    check_same_tokenizer(student, teacher)
    return data, student, teacher


def distill_datum(
    prompt: list[int], seq, teacher_lps: list[float], coef: float
) -> tuple[types.Datum, torch.Tensor]:  # noqa: ANN001
    """The datum of one sample (advantages -coef * reverse KL on its response positions) and its reverse KL."""
    student = torch.tensor([float(x) for x in seq.logprobs])
    teacher = torch.tensor(teacher_lps[len(prompt) :])
    advantages, reverse_kl = reverse_kl_advantages(student, teacher, torch.ones_like(student), coef)
    tokens, pad = prompt + list(seq.tokens), [0.0] * (len(prompt) - 1)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": pad + student.tolist(),
            "advantages": pad + advantages.tolist(),
        },
    )
    return datum, reverse_kl


def run(args: argparse.Namespace, data: Path, student: Path, teacher: Path) -> list[dict]:
    tok = load_tokenizer(student)
    train = PromptDataset(data / "train.parquet", tok, max_prompt_length=64)
    test_set = PromptDataset(data / "test.parquet", tok, max_prompt_length=64)
    test = [test_set[i] for i in range(min(args.val_prompts, len(test_set)))]
    loader = PromptDataLoader(train, args.prompts, lambda items, uids: items, seed=args.seed)
    greedy = types.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, stop=[tok.eos_token_id])
    sampling = greedy.model_copy(update={"temperature": 1.0})
    adam = types.AdamParams(learning_rate=args.lr, beta1=0.9, beta2=0.999, eps=1e-8, grad_clip_norm=1.0)
    curve: list[dict] = []
    with ServiceClient("local", root_dir=args.out / "api", seed=args.seed) as sc:
        tc = sc.create_training_client(str(student))
        scorer = sc.create_sampling_client(base_model=str(teacher))  # frozen: its weights never change

        def accuracy(sampler) -> float:  # noqa: ANN001
            futures = [sampler.sample(types.ModelInput.from_ints(p["input_ids"]), 1, greedy) for p in test]
            texts = [
                tok.decode(list(f.result().sequences[0].tokens), skip_special_tokens=True) for f in futures
            ]
            return statistics.fmean(
                default_compute_score(p["data_source"], t, p["ground_truth"]) >= 1
                for p, t in zip(test, texts, strict=True)
            )

        sampler = tc.save_weights_and_get_sampling_client()
        curve.append({"step": 0, "acc": accuracy(sampler)})
        for step in range(1, args.steps + 1):
            prompts = loader.next_batch()
            futures = [
                sampler.sample(types.ModelInput.from_ints(p["input_ids"]), args.group, sampling)
                for p in prompts
            ]
            samples = [
                (p["input_ids"], s)
                for p, f in zip(prompts, futures, strict=True)
                for s in f.result().sequences
            ]
            scored = [
                scorer.compute_logprobs(types.ModelInput.from_ints(p + list(s.tokens))) for p, s in samples
            ]
            n_tokens = sum(len(s.tokens) for _, s in samples)
            batch, kls = [], []
            for (prompt, seq), lps in zip(samples, scored, strict=True):
                datum, kl = distill_datum(prompt, seq, lps.result(), args.kl_coef / n_tokens)  # token-mean
                batch.append(datum)
                kls.append(kl)
            fb, opt = tc.forward_backward(batch, "importance_sampling"), tc.optim_step(adam)
            fb.result(), opt.result()
            sampler = tc.save_weights_and_get_sampling_client()
            row = {"step": step, "kl_to_teacher": float(torch.cat(kls).mean()), "tokens": n_tokens}
            if step % args.val_every == 0 or step == args.steps:
                row["acc"] = accuracy(sampler)
            curve.append(row)
            print(json.dumps(row), flush=True)
    return curve


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--student", type=Path, help="student (HF dir); default: the tiny preset built in --out")
    p.add_argument(
        "--teacher", type=Path, help="teacher with the student's tokenizer; default: built in --out"
    )
    p.add_argument("--data", type=Path, help="dir with train/test.parquet; default: the demo's task")
    p.add_argument("--out", type=Path, default=Path("runs/recipes/distill"))
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--kl-coef", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--val-every", type=int, default=10)
    p.add_argument("--val-prompts", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data, student, teacher = prepare(args)
    curve = run(args, data, student, teacher)
    (args.out / "curve.json").write_text(
        json.dumps({"args": vars(args), "curve": curve}, indent=1, default=str)
    )


if __name__ == "__main__":
    main()
