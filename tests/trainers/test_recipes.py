"""Every ready config (`algorithm=<name>`) runs 2 steps end to end on the 1M model; PPO also on 2 Ray workers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from posttrain.config.load import load_config
from posttrain.config.schema import RLConfig
from posttrain.trainers.rl import RLTrainer

RECIPES = ["grpo", "dr_grpo", "dapo", "ppo", "rloo", "reinforce_plus_plus", "remax", "gspo"]

REWARD_FILE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str) % 2)  # varies within groups, so every estimator has signal
"""


def run(
    recipe: str, model: Path, data: dict, run_dir: Path, *extra: str, reward_source: str = REWARD_FILE
) -> list[dict]:
    reward = run_dir.parent / "reward.py"
    reward.write_text(reward_source)
    cfg = load_config(
        RLConfig,
        "rl",
        [
            f"algorithm={recipe}",
            f"model.path={model}",
            f"data.train_files=[{data['train']}]",
            f"data.val_files=[{data['test']}]",
            f"trainer.run_dir={run_dir}",
            f"reward.custom_function_path={reward}",
            "data.train_batch_prompts=4",
            "data.max_response_length=8",
            "rollout.n=4",
            "trainer.total_steps=2",
            "trainer.val_before_train=false",
            "trainer.val_every=0",
            "trainer.loggers=[jsonl]",
            *extra,
        ],
    )
    RLTrainer(cfg).fit()
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_runs_two_steps(
    recipe: str, tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    rows = run(recipe, tiny_model_dir, arithmetic_data, tmp_path / "run", "trainer.backend=local")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert all(math.isfinite(v) for v in r.values()), r
        assert r["actor/grad_norm"] > 0, "the policy received a gradient"
    if recipe == "ppo":
        assert all("critic/vf_loss" in r and r["critic/grad_norm"] > 0 for r in rows)
    if recipe == "dapo":
        assert all(r["dynamic_sampling/rounds"] >= 1 for r in rows)
    if recipe in ("rloo", "remax"):
        assert all("algorithm/kl_in_reward" in r for r in rows)
    assert (tmp_path / "run" / "latest").read_text() == "step_2"


def test_ppo_with_critic_on_two_ray_workers_resumes(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path, ray_cluster: None
) -> None:
    ray = ["trainer.backend=ray", "trainer.n_workers_per_node=2", "trainer.save_every=1"]
    run("ppo", tiny_model_dir, arithmetic_data, tmp_path / "run", *ray)
    assert (tmp_path / "run" / "step_2" / "critic").is_dir()
    rows = run("ppo", tiny_model_dir, arithmetic_data, tmp_path / "run", *ray, "trainer.total_steps=3")
    assert [r["step"] for r in rows if "critic/vf_loss" in r] == [1, 2, 3]


def test_critic_warmup_trains_only_the_critic_first(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    rows = run(
        "ppo",
        tiny_model_dir,
        arithmetic_data,
        tmp_path / "run",
        "trainer.backend=local",
        "algorithm.critic_warmup=1",
    )
    assert "critic/vf_loss" in rows[0] and "actor/grad_norm" not in rows[0]
    assert "actor/grad_norm" in rows[1]


def test_truncated_importance_sampling_runs(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    rows = run(
        "grpo",
        tiny_model_dir,
        arithmetic_data,
        tmp_path / "run",
        "trainer.backend=local",
        "actor.tis_cap=2.0",
    )
    assert all(r["actor/tis_weight_mean"] > 0 for r in rows)


def test_dynamic_sampling_cap_warns_and_fills(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    constant = (
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n"
    )
    with caplog.at_level("WARNING"):
        rows = run(
            "dapo",
            tiny_model_dir,
            arithmetic_data,
            tmp_path / "run",
            "trainer.backend=local",
            "algorithm.max_gen_rounds=2",
            reward_source=constant,
        )
    assert all(r["dynamic_sampling/rounds"] == 2 and r["dynamic_sampling/kept_groups"] == 0 for r in rows)
    assert "only 0 of 4 prompt groups had varied rewards after 2 rounds" in caplog.text


def test_entropy_bonus_is_applied_and_logged(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    rows = run(
        "grpo",
        tiny_model_dir,
        arithmetic_data,
        tmp_path / "run",
        "trainer.backend=local",
        "actor.entropy_coeff=0.01",
    )
    assert all(r["actor/entropy"] > 0 for r in rows)


def test_adaptive_kl_controller_in_the_reward(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    rows = run(
        "rloo",
        tiny_model_dir,
        arithmetic_data,
        tmp_path / "run",
        "trainer.backend=local",
        "algorithm.kl_ctrl_type=adaptive",
        "algorithm.kl_target=0.01",
        "algorithm.kl_horizon=100",
        "algorithm.kl_coef=0.1",
    )
    assert rows[0]["algorithm/kl_coef"] == 0.1
    assert rows[1]["algorithm/kl_coef"] != rows[0]["algorithm/kl_coef"], "the adaptive coefficient moved"
