"""Every ready config (`algorithm=<name>`) runs 2 steps end to end on the 1M model; PPO also on 2 Ray workers.
And the options each config hands its policy loss: unset ones are the loss's own defaults."""

from __future__ import annotations

import functools
import inspect
import json
import math
from pathlib import Path

import pytest
import torch

from posttrain.algorithms.policy_loss import own_options
from posttrain.algorithms.registry import POLICY_LOSSES, get_policy_loss
from posttrain.config.load import load_config
from posttrain.config.schema import RLConfig
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.errors import ConfigError
from posttrain.trainers.rl import RLTrainer
from posttrain.workers.losses import build_loss

RECIPES = ["grpo", "dr_grpo", "dapo", "ppo", "rloo", "reinforce_plus_plus", "remax", "gspo"]

REWARD_FILE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str) % 2)  # varies within groups, so every estimator has signal
"""


def recipe_config(
    recipe: str, model: Path, data: dict, run_dir: Path, *extra: str, reward_source: str = REWARD_FILE
) -> RLConfig:
    """The config `posttrain train algorithm=<recipe> ...` runs: Hydra composition of rl.yaml + overrides."""
    reward = run_dir.parent / "reward.py"
    reward.write_text(reward_source)
    return load_config(
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


def run(
    recipe: str, model: Path, data: dict, run_dir: Path, *extra: str, reward_source: str = REWARD_FILE
) -> list[dict]:
    RLTrainer(recipe_config(recipe, model, data, run_dir, *extra, reward_source=reward_source)).fit()
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


@pytest.mark.slow  # ~95 s: PPO with a critic on Ray, checkpoint and resume
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


def test_rollout_correction_runs_decoupled_and_in_bypass_mode(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    rc = "algorithm.rollout_correction"
    rows = run(
        "grpo",
        tiny_model_dir,
        arithmetic_data,
        tmp_path / "decoupled",
        "trainer.backend=local",
        f"{rc}.rollout_is=token",
        f"{rc}.rollout_rs=seq_mean_k1",
        f"{rc}.rollout_rs_threshold=0.5_2.0",
    )
    # the built-in engine's log-probs match the trainer's: weights ~1, nothing rejected
    assert all(r["actor/rollout_is_mean"] == pytest.approx(1.0, abs=1e-3) for r in rows)
    assert all(r["actor/rollout_rs_masked_fraction"] == 0.0 for r in rows)
    rows = run(
        "grpo",
        tiny_model_dir,
        arithmetic_data,
        tmp_path / "bypass",
        "trainer.backend=local",
        "actor.policy_loss=gpg",
        "actor.mini_batch_size=8",  # two updates per step, both against the rollout log-probs
        f"{rc}.bypass_mode=true",
        f"{rc}.loss_type=reinforce",
        f"{rc}.rollout_is=sequence",
    )
    assert all(r["actor/grad_norm"] > 0 and "timing/old_log_prob" not in r for r in rows)
    assert all(r["actor/rollout_is_mean"] > 0 for r in rows)


def test_gdpo_normalises_the_reward_functions_components(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    components = (
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    length = float(len(solution_str) % 2)\n"
        "    digit = float(any(c.isdigit() for c in solution_str))\n"
        "    return {'score': length + digit, 'length': length, 'digit': digit}\n"
    )
    rows = run(
        "grpo",
        tiny_model_dir,
        arithmetic_data,
        tmp_path / "run",
        "trainer.backend=local",
        "algorithm.adv_estimator=gdpo",
        "algorithm.gdpo_reward_keys=[length,digit]",
        "algorithm.gdpo_reward_weights=[1.0,0.5]",
        reward_source=components,
    )
    assert [r["step"] for r in rows] == [1, 2] and all(r["actor/grad_norm"] > 0 for r in rows)


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


# --- loss options: unset = the loss's own default, all the way from `posttrain train` to the loss -----------


def options_the_loss_receives(
    monkeypatch: pytest.MonkeyPatch, model: Path, data: dict, run_dir: Path, recipe: str, *extra: str
) -> dict[str, float]:
    """Build the trainer of `posttrain train algorithm=<recipe> <extra>`, run its actor loss the way a worker
    does, and return the options the registered policy loss ran with (its defaults filled in)."""
    cfg = recipe_config(recipe, model, data, run_dir, *extra)
    real = get_policy_loss(cfg.actor.policy_loss)
    received: dict[str, float] = {}

    @functools.wraps(real)
    def spy(*args, **kwargs):
        bound = inspect.signature(real).bind(*args, **kwargs)
        bound.apply_defaults()
        received.update({k: v for k, v in bound.arguments.items() if k in own_options(real)})
        return real(*args, **kwargs)

    monkeypatch.setitem(POLICY_LOSSES._entries, cfg.actor.policy_loss, spy)
    loss_fn = build_loss(RLTrainer(cfg).loss, dp_size=1)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    mb = Batch.from_dict(
        {
            keys.RESPONSE_MASK: mask,
            keys.ADVANTAGES: torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]]),
            keys.OLD_LOG_PROBS: torch.full((2, 3), -1.0),
            keys.REF_LOG_PROB: torch.full((2, 3), -1.0),
        }
    )
    loss, _ = loss_fn(torch.full((2, 3), -0.9, requires_grad=True), None, mb)
    assert torch.isfinite(loss)
    return received


@pytest.mark.parametrize(
    ("recipe", "extra", "expected"),
    [
        # CISPO: no lower bound, upper bound 1 + 3 (tinker's thresholds 0 and 4), not the PPO 0.2 / 0.2
        ("grpo", ["actor.policy_loss=cispo"], {"clip_ratio_low": 1.0, "clip_ratio_high": 3.0}),
        (
            "grpo",
            ["actor.policy_loss=cispo", "actor.clip_ratio_high=0.28"],
            {"clip_ratio_low": 1.0, "clip_ratio_high": 0.28},
        ),
        # GSPO: the paper's sequence-ratio range, from the recipe and from the loss name alone
        ("gspo", [], {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}),
        ("grpo", ["actor.policy_loss=gspo"], {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}),
        ("gspo", ["actor.clip_ratio_low=0.001"], {"clip_ratio_low": 1e-3, "clip_ratio_high": 4e-4}),
        # SAPO: the paper's (and verl's) temperatures, each settable under verl's name
        ("grpo", ["actor.policy_loss=sapo"], {"tau_pos": 1.0, "tau_neg": 1.05}),
        ("grpo", ["actor.policy_loss=sapo", "actor.tau_neg=2.0"], {"tau_pos": 1.0, "tau_neg": 2.0}),
        # GMPO: the paper's log-space range; DPPO: verl's example divergence bounds, truncation 20
        ("grpo", ["actor.policy_loss=geo_mean"], {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4}),
        (
            "grpo",
            ["actor.policy_loss=dppo_tv"],
            {"clip_ratio_low": 0.15, "clip_ratio_high": 0.15, "clip_ratio_c": 20.0},
        ),
        (
            "grpo",
            ["actor.policy_loss=dppo_kl", "actor.clip_ratio_c=1e4"],
            {"clip_ratio_low": 0.05, "clip_ratio_high": 0.05, "clip_ratio_c": 1e4},
        ),
        # KL-Cov: verl's configured coefficient 0.1
        ("grpo", ["actor.policy_loss=kl_cov"], {"kl_cov_ratio": 2e-4, "ppo_kl_coef": 0.1}),
        # PPO: its own 0.2 / 0.2 / 3.0, and DAPO's clip-higher from its recipe
        ("grpo", [], {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}),
        ("dapo", [], {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0}),
    ],
)
def test_unset_loss_options_are_the_loss_defaults(
    recipe: str,
    extra: list[str],
    expected: dict[str, float],
    monkeypatch: pytest.MonkeyPatch,
    tiny_model_dir: Path,
    arithmetic_data: dict,
    tmp_path: Path,
) -> None:
    received = options_the_loss_receives(
        monkeypatch,
        tiny_model_dir,
        arithmetic_data,
        tmp_path / "run",
        recipe,
        "trainer.backend=local",
        *extra,
    )
    assert received == pytest.approx(expected)


def test_a_loss_option_the_loss_does_not_take_is_refused(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    cfg = recipe_config("gspo", tiny_model_dir, arithmetic_data, tmp_path / "run", "actor.tau_pos=2.0")
    with pytest.raises(
        ConfigError, match=r"actor\.tau_pos=2\.0 is set, but actor\.policy_loss=gspo does not use it"
    ):
        RLTrainer(cfg)
