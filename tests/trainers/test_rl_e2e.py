"""End to end: GRPO with 2 Ray workers on the 1M model, checkpoint, stop, resume, continue."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.config.load import load_config
from posttrain.config.schema import RLConfig
from posttrain.trainers.rl import RLTrainer


def rl_overrides(model: Path, data: dict, run_dir: Path, *extra: str) -> list[str]:
    """The small GRPO job of these tests as `posttrain train` overrides."""
    return [
        f"model.path={model}",
        f"data.train_files=[{data['train']}]",
        f"data.val_files=[{data['test']}]",
        f"trainer.run_dir={run_dir}",
        "data.train_batch_prompts=4",
        "data.max_response_length=6",
        "rollout.n=4",
        "actor.optim.lr=1e-3",
        "trainer.save_every=1",
        "trainer.val_every=2",
        "data.val_max_prompts=8",
        "trainer.loggers=[jsonl,tensorboard]",
        *extra,
    ]


def rl_config(model: Path, data: dict, run_dir: Path, *extra: str) -> RLConfig:
    return load_config(RLConfig, "rl", rl_overrides(model, data, run_dir, *extra))


REWARD_FILE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["index"] % 2 == 0:
        raise ValueError("a scorer bug")  # counted as reward 0, never a crash
    return float(len(solution_str) % 2)  # varies across samples, so advantages and gradients are non-zero
"""


def reward_file(tmp_path: Path) -> str:
    path = tmp_path / "my_reward.py"
    path.write_text(REWARD_FILE)
    return f"reward.custom_function_path={path}"


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # the default suite's time on 2 cores (CI runs it with -m slow)
def test_grpo_two_ray_workers_checkpoint_and_resume(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path, ray_cluster: None
) -> None:
    run = tmp_path / "run"
    ray = ["trainer.backend=ray", "trainer.n_workers_per_node=2", reward_file(tmp_path)]
    history = RLTrainer(rl_config(tiny_model_dir, arithmetic_data, run, "trainer.total_steps=2", *ray)).fit()
    assert [h["step"] for h in history] == [0, 2]
    assert (run / "latest").read_text() == "step_2"
    assert (run / "step_2" / "trainer_state.pt").exists()
    first = rows(run)
    train_rows = [r for r in first if "reward/mean" in r]
    assert [r["step"] for r in train_rows] == [1, 2]
    for r in train_rows:
        assert r["rollout/logprob_diff_max"] < 1e-4  # sampler and trainer agree on log-probs
        assert r["actor/grad_norm"] > 0
        assert 0.0 <= r["reward/mean"] <= 1.0
        assert 1 <= r["response_length/min"] <= r["response_length/mean"] <= r["response_length/max"] <= 6
        assert r["batch/samples"] == 4 * 4, "the samples trained (data.train_batch_prompts x rollout.n)"
    assert sum(r["reward/errors"] for r in train_rows) > 0, "the raising scorer was counted"
    assert list((run / "tensorboard").iterdir()), "tensorboard events written"

    # "stopped" after step 2; a new run of the same job resumes at step 2 and continues with step 3
    trainer = RLTrainer(rl_config(tiny_model_dir, arithmetic_data, run, "trainer.total_steps=3", *ray))
    trainer.fit()
    assert trainer.step_count == 3
    assert trainer.loader.state_dict() == {"epoch": 0, "position": 3}
    steps = [r["step"] for r in rows(run) if "reward/mean" in r]
    assert steps == [1, 2, 3], "resumed run continues from step 3, it does not redo steps 1-2"
    assert (run / "latest").read_text() == "step_3"


def test_resume_reproduces_the_uninterrupted_run_in_process(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    """Same seed: steps after a resume see the same batches and give the same rewards as a straight run."""
    local = ["trainer.backend=local", "trainer.val_every=0", "trainer.val_before_train=false"]
    straight = tmp_path / "straight"
    RLTrainer(rl_config(tiny_model_dir, arithmetic_data, straight, "trainer.total_steps=3", *local)).fit()
    split = tmp_path / "split"
    RLTrainer(rl_config(tiny_model_dir, arithmetic_data, split, "trainer.total_steps=2", *local)).fit()
    RLTrainer(rl_config(tiny_model_dir, arithmetic_data, split, "trainer.total_steps=3", *local)).fit()
    a = {r["step"]: r for r in rows(straight)}
    b = {r["step"]: r for r in rows(split)}
    for key in ("reward/mean", "response_length/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert a[3][key] == b[3][key], key  # bit for bit (tests/trainers/test_fault.py: after a SIGKILL too)
