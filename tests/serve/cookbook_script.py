"""tinker-cookbook's own training loops against `posttrain serve`, unmodified: its supervised trainer
(`tinker_cookbook.supervised.train`) on a conversations file, then its RL trainer (`tinker_cookbook.rl.train`)
on its arithmetic environment from the supervised run's checkpoint, with a KL penalty against the base
model, then the RL run resumed from its log directory as the cookbook resumes. Configured, like any tinker
program, by TINKER_BASE_URL and TINKER_API_KEY only; the model name is the served base model's directory (so
the cookbook's `get_tokenizer(model_name)` loads it). Prints one JSON line: what the runs logged.

    python cookbook_script.py <served model name> <work dir>
"""

import asyncio
import json
import random
import sys
from pathlib import Path

from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
from tinker_cookbook.rl import train as rl_train
from tinker_cookbook.supervised import train as sl_train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

RENDERER = "qwen3_instruct"  # ChatML, which the tiny models' tokenizer speaks (<|im_start|>, <|im_end|>)
model, work = sys.argv[1], Path(sys.argv[2])


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


rng = random.Random(0)
conversations = work / "conversations.jsonl"
with conversations.open("w") as f:
    for _ in range(256):
        x, y = rng.randint(0, 100), rng.randint(0, 100)
        turns = [
            {"role": "user", "content": f"What is {x} + {y}?"},
            {"role": "assistant", "content": str(x + y)},
        ]
        f.write(json.dumps({"messages": turns}) + "\n")

common = ChatDatasetBuilderCommonConfig(
    model_name_for_tokenizer=model, renderer_name=RENDERER, max_length=128, batch_size=32
)
sl = sl_train.Config(
    log_path=str(work / "sl"),
    recipe_name="posttrain_cookbook_test",
    model_name=model,
    renderer_name=RENDERER,
    dataset_builder=FromConversationFileBuilder(
        common_config=common, file_path=str(conversations), test_size=32
    ),
    learning_rate=1e-3,
    lora_rank=8,
    num_epochs=2,
    save_every=4,
    eval_every=4,
)
asyncio.run(sl_train.main(sl))
sl_checkpoints = rows(work / "sl" / "checkpoints.jsonl")


def rl_config(n_batches: int) -> rl_train.Config:
    dataset = ArithmeticDatasetBuilder(
        batch_size=4,
        model_name_for_tokenizer=model,
        renderer_name=RENDERER,
        n_batches=n_batches,
        group_size=4,
    )
    return rl_train.Config(
        log_path=str(work / "rl"),
        recipe_name="posttrain_cookbook_test",
        model_name=model,
        renderer_name=RENDERER,
        dataset_builder=dataset,
        learning_rate=1e-4,
        max_tokens=8,
        lora_rank=8,
        load_checkpoint_path=sl_checkpoints[-1]["state_path"],
        save_every=2,
        eval_every=0,
        kl_penalty_coef=0.01,
        kl_reference_config=rl_train.KLReferenceConfig(base_model=model),
    )


asyncio.run(rl_train.main(rl_config(4)))
first_rl = rows(work / "rl" / "metrics.jsonl")
asyncio.run(rl_train.main(rl_config(6)))  # the same log directory: the cookbook resumes from its last save
print(
    json.dumps(
        {
            "sl_metrics": rows(work / "sl" / "metrics.jsonl"),
            "sl_checkpoints": sl_checkpoints,
            "rl_first_metrics": first_rl,
            "rl_metrics": rows(work / "rl" / "metrics.jsonl"),
            "rl_checkpoints": rows(work / "rl" / "checkpoints.jsonl"),
        }
    )
)
