"""The two sides of bench/vs_trl.py, each run in a fresh process: preparation, TRL's GRPOTrainer, posttrain.

    python bench/vs_trl_workers.py --worker trl --spec '{...}' --result out.json   (vs_trl.py does this)

Each worker prints its framework's own log and writes its per-step figures as JSON to --result.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

from common import LONG_ADDITION_SFT, LONG_SFT_STOP_NLL, recipe_tag


def peak_rss_mb() -> float:
    """This process's peak RSS, or a child's if larger (ru_maxrss is in KiB on Linux)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) / 1024


def read_rows(path: str) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


# long_addition's SFT: cosine over 1500 steps, stopped once held-out NLL <= this. Measured: 500 steps score
# 0% held-out, 1500 score 94% (nothing left to teach); NLL 0.1 (~800 steps) 23% greedy but ~3% sampled at
# temperature 1, too few correct samples: GRPO at lr 2e-4 lost them in both frameworks (0-2% after 60 steps)


def prepare_worker(spec: dict) -> dict:
    """Tiny model, task files and SFT warm start under <work>/<preset>[-<task>] (kept between runs).

    arithmetic: the demo's model, task and SFT recipe. long_addition: a tokenizer trained on its worked
    solutions, 5-9 digit operands (responses of ~40-110 tokens), SFT on the solutions stopped early at a
    held-out NLL (below)."""
    from posttrain.config.load import load_config
    from posttrain.config.schema import SFTConfig
    from posttrain.data.tasks import arithmetic, long_addition
    from posttrain.demo import SFT_OVERRIDES, TASK
    from posttrain.models import make_tiny_model
    from posttrain.trainers.sft import SFTTrainer
    from posttrain.workers.process import quiet_transformers

    quiet_transformers()
    task = spec["task"]
    root = Path(spec["work"]) / (spec["preset"] if task == "arithmetic" else f"{spec['preset']}-{task}")
    extra = list(spec.get("sft_overrides", []))
    if task == "arithmetic":
        corpus = arithmetic.corpus(20000, seed=0)
        recipe = [o for o in SFT_OVERRIDES if not o.startswith("trainer.total_steps=")]
    else:
        corpus = long_addition.corpus(10000, seed=0)
        recipe = LONG_ADDITION_SFT
    # the warm start is named by its whole recipe (a changed one makes a new warm start, not a stale reuse)
    tag = "-" + recipe_tag(recipe, extra, LONG_SFT_STOP_NLL if task != "arithmetic" else None)
    model, data, sft = root / "model", root / "data", root / f"sft{spec['sft_steps']}{tag}"
    if not (model / "config.json").exists():
        make_tiny_model(spec["preset"], model, corpus)
    if not (data / "test.parquet").exists():
        if task == "arithmetic":
            arithmetic.write_arithmetic_dataset(data, **TASK)
        else:
            long_addition.write_long_addition_dataset(
                data, n_train=2000, n_test=128, min_digits=5, max_digits=9
            )
    hf = sft / "hf"
    started = time.perf_counter()
    if spec["sft_steps"] > 0 and not (hf / "config.json").exists():
        val = [f"data.val_files=[{data / 'test.parquet'}]"]
        cfg = load_config(
            SFTConfig,
            "sft",
            [
                f"model.path={model}",
                f"data.train_files=[{data / 'train.parquet'}]",
                *val,
                f"trainer.run_dir={sft}",
                f"trainer.total_steps={spec['sft_steps']}",
                *recipe,
                *extra,
            ],
        )
        SFTTrainer(cfg).fit()
    return {
        "model": str(hf if spec["sft_steps"] > 0 else model),
        "train_file": str(data / "train.parquet"),
        "test_file": str(data / "test.parquet"),
        "sft_seconds": round(time.perf_counter() - started, 1),
    }


def trl_worker(spec: dict) -> dict:
    """TRL GRPOTrainer on the spec's model and prompts; per-step times, tokens and rewards."""
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    from posttrain.rewards.manager import RewardManager

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    rows = read_rows(spec["train_file"])
    records = []
    for row in rows:
        messages = [{"role": m["role"], "content": m["content"]} for m in row["prompt"]]
        # the same call TRL makes on conversational prompts (and the same template posttrain renders)
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        records.append(
            {
                "prompt": messages,
                "data_source": row["data_source"],
                "ground_truth": str(row["reward_model"]["ground_truth"]),
                "prompt_tokens": len(ids),
            }
        )
    dataset = Dataset.from_list(records)
    manager = RewardManager()
    per_step: list[dict] = []

    def arithmetic_reward(completions, completion_ids, data_source, ground_truth, prompt_tokens, **_):
        """posttrain's scorer for the task (RewardManager: the built-in `arithmetic` scorer by data_source)."""
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        scores = manager.score(list(data_source), texts, list(ground_truth)).scores
        per_step.append(
            {
                "reward": sum(scores) / len(scores),
                "completion_tokens": sum(len(c) for c in completion_ids),
                "prompt_tokens": sum(prompt_tokens),
                "samples": len(scores),
                "prompt_lens": list(prompt_tokens),
                "response_lens": [len(c) for c in completion_ids],
            }
        )
        return scores

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.logs: list[dict] = []
            self._t0 = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self._t0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs or {}))

    samples = spec["prompts"] * spec["n"]
    micro = spec["micro_batch"]
    config = GRPOConfig(
        output_dir=spec["run_dir"],
        # one optimizer step per generation batch of prompts x n samples, in micro-batches of `micro`
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=samples // micro,
        steps_per_generation=samples // micro,
        num_iterations=1,
        num_generations=spec["n"],
        max_completion_length=spec["max_completion"],
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        loss_type="dapo",  # = posttrain token-mean: normalised by the token count of the whole batch
        epsilon=0.2,
        scale_rewards="group",
        mask_truncated_completions=False,
        learning_rate=spec["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        optim="adamw_torch",
        max_grad_norm=1.0,
        max_steps=spec["steps"],
        seed=spec["seed"],
        data_seed=spec["seed"],
        shuffle_dataset=False,  # step k sees the same prompts as posttrain's step k
        use_cpu=True,
        bf16=False,  # TRL's default is bf16 wherever supported, this CPU included; posttrain's is fp32
        fp16=False,
        gradient_checkpointing=False,  # TRL's default is True; posttrain's is off
        use_vllm=False,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        log_completions=False,
    )
    model = AutoModelForCausalLM.from_pretrained(
        spec["model"], dtype=torch.float32, attn_implementation="sdpa", local_files_only=True
    )
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=arithmetic_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.train()
    trainer.save_model(str(Path(spec["run_dir"]) / "final"))  # model and tokenizer, for the held-out eval
    steps = []
    for seconds, tokens in zip(timer.times, per_step, strict=False):
        steps.append({"seconds": seconds, **tokens})
    trl_logs = [log for log in timer.logs if "reward" in log]
    return {
        "steps": steps,
        "peak_rss_mb": peak_rss_mb(),
        "trl_logged_reward": [log["reward"] for log in trl_logs],
        "trl_logged_step_time": [log.get("step_time") for log in trl_logs],
        "trl_logged_num_tokens": [log.get("num_tokens") for log in trl_logs],
        "final_model": str(Path(spec["run_dir"]) / "final"),
    }


def posttrain_worker(spec: dict) -> dict:
    """posttrain GRPO (local backend, one worker) on the spec's model and prompts."""
    import torch

    torch.set_num_threads(spec["threads"])
    from posttrain.config.load import load_config
    from posttrain.config.schema import RLConfig
    from posttrain.trainers.rl import RLTrainer
    from posttrain.workers.process import quiet_transformers

    quiet_transformers()
    run_dir = Path(spec["run_dir"])
    overrides = [
        f"model.path={spec['model']}",
        f"data.train_files=[{spec['train_file']}]",
        "data.val_files=[]",
        f"data.train_batch_prompts={spec['prompts']}",
        f"data.max_response_length={spec['max_completion']}",
        "data.shuffle=false",  # step k sees the same prompts as TRL's step k
        f"rollout.n={spec['n']}",
        "rollout.temperature=1.0",
        "rollout.top_p=1.0",
        "rollout.top_k=0",
        "algorithm.adv_estimator=grpo",
        "algorithm.norm_adv_by_std_in_grpo=true",
        "actor.policy_loss=vanilla",
        "actor.use_kl_loss=false",
        "actor.loss_agg_mode=token-mean",
        "actor.clip_ratio_low=0.2",
        "actor.clip_ratio_high=0.2",
        f"actor.optim.lr={spec['lr']}",
        "actor.optim.weight_decay=0.0",
        "actor.optim.grad_clip=1.0",
        "actor.optim.warmup_steps=0",
        "actor.ppo_epochs=1",
        "actor.mini_batch_size=0",  # the whole step's batch: one optimizer step per generation batch
        f"actor.micro_batch_size={spec['micro_batch']}",
        "trainer.backend=local",
        "trainer.n_workers_per_node=1",
        f"trainer.threads_per_worker={spec['threads']}",
        "trainer.device=cpu",
        f"trainer.total_steps={spec['steps']}",
        f"trainer.seed={spec['seed']}",
        "trainer.val_every=0",
        "trainer.val_before_train=false",
        "trainer.save_every=0",  # fit() still saves once after the last step, outside the timed steps
        "trainer.resume=false",
        "trainer.loggers=[jsonl]",
        f"trainer.run_dir={run_dir}",
        *spec["posttrain_overrides"],
    ]
    cfg = load_config(RLConfig, "rl", overrides)
    trainer = RLTrainer(cfg)
    rows_in_file = len(read_rows(spec["train_file"]))
    if len(trainer.train_set) != rows_in_file:
        raise RuntimeError(
            f"posttrain filtered {rows_in_file - len(trainer.train_set)} prompts: the two frameworks would "
            "not see the same prompts per step"
        )
    lengths = [len(trainer.train_set[i]["input_ids"]) for i in range(len(trainer.train_set))]
    from posttrain.data import keys

    batch_lens: list[tuple[list[int], list[int]]] = []
    batch_metrics = trainer.batch_metrics

    def record_lengths(batch):  # per-sample prompt and response lengths of each step, for the FLOP count
        width = batch[keys.RESPONSE_MASK].shape[1]
        prompt_lens = batch[keys.ATTENTION_MASK][:, :-width].sum(-1).tolist()
        batch_lens.append((prompt_lens, batch[keys.RESPONSE_MASK].sum(-1).long().tolist()))
        return batch_metrics(batch)

    trainer.batch_metrics = record_lengths
    trainer.fit()
    metrics: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        metrics.setdefault(row["step"], {}).update(row)
    per_epoch = len(lengths) // spec["prompts"]  # drop_last, unshuffled: step k takes rows k*B .. k*B+B-1
    steps = []
    for step in sorted(metrics):
        m = metrics[step]
        if "timing/step" not in m:
            continue
        prompt_lens, response_lens = batch_lens[step - 1]
        k = (step - 1) % per_epoch
        prompt_tokens = sum(lengths[k * spec["prompts"] : (k + 1) * spec["prompts"]]) * spec["n"]
        steps.append(
            {
                "seconds": m["timing/step"],
                "reward": m["reward/mean"],
                "completion_tokens": m["throughput/gen_tokens"],
                "prompt_tokens": prompt_tokens,
                "samples": spec["prompts"] * spec["n"],
                "prompt_lens": prompt_lens,
                "response_lens": response_lens,
                "timing": {k: v for k, v in m.items() if k.startswith(("timing/", "perf/", "throughput/"))},
            }
        )
    return {"steps": steps, "peak_rss_mb": peak_rss_mb(), "final_model": str(run_dir)}  # its last checkpoint


WORKERS = {"prepare": prepare_worker, "trl": trl_worker, "posttrain": posttrain_worker}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=sorted(WORKERS), required=True)
    parser.add_argument("--spec", required=True, help="the worker's settings as JSON")
    parser.add_argument("--result", required=True, help="where to write the result JSON")
    args = parser.parse_args()
    result = WORKERS[args.worker](json.loads(args.spec))
    Path(args.result).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
