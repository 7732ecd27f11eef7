"""On-policy distillation in the RL trainer: a teacher on the student's tokenizer scores its samples."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from posttrain.config.load import load_config
from posttrain.config.schema import RLConfig
from posttrain.errors import ConfigError, ModelError
from posttrain.models import make_tiny_model
from posttrain.trainers.rl import RLTrainer
from tests.trainers.test_rl_e2e import rl_overrides


@pytest.fixture(scope="module")
def teacher_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another tiny model (other seed) on the student's tokenizer."""
    return make_tiny_model(
        "tiny", tmp_path_factory.mktemp("teacher") / "m", [], seed=7, tokenizer_from=tiny_model_dir
    )


def distill_config(student: Path, teacher: Path, data: dict, run: Path, *extra: str) -> RLConfig:
    overrides = rl_overrides(student, data, run, "trainer.backend=local", "trainer.threads_per_worker=1")
    overrides += [f"distill.teacher_path={teacher}", "trainer.val_before_train=false", "trainer.val_every=0"]
    return load_config(RLConfig, "rl", [*overrides, *extra])


def test_on_policy_distill_logs_a_finite_kl_to_the_teacher(
    tiny_model_dir: Path, teacher_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    cfg = distill_config(tiny_model_dir, teacher_dir, arithmetic_data, run, "trainer.total_steps=2")
    RLTrainer(cfg).fit()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "distill/kl_to_teacher" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert math.isfinite(r["distill/kl_to_teacher"])
        # two randomly initialised models (near-uniform): a small but clearly non-zero KL (~0.013)
        assert r["distill/kl_to_teacher"] > 1e-3
        assert r["actor/grad_norm"] > 0  # the reverse-KL advantage moves the student


def test_the_teacher_of_itself_has_zero_kl(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    run = tmp_path / "self"
    cfg = distill_config(tiny_model_dir, tiny_model_dir, arithmetic_data, run, "trainer.total_steps=1")
    RLTrainer(cfg).fit()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert abs(rows[-1]["distill/kl_to_teacher"]) < 1e-4


def test_a_teacher_with_another_tokenizer_is_refused(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    other = make_tiny_model("tiny", tmp_path / "other", ["Zebra crossing " * 9] * 50, seed=0)
    cfg = distill_config(tiny_model_dir, other, arithmetic_data, tmp_path / "run")
    with pytest.raises(ConfigError, match="teacher") as info:
        RLTrainer(cfg)
    assert str(tiny_model_dir) in str(info.value) and str(other) in str(info.value)


def test_distill_keys_without_a_teacher_are_refused(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    overrides = rl_overrides(
        tiny_model_dir, arithmetic_data, tmp_path, "trainer.backend=local", "distill.kl_coef=0.5"
    )
    with pytest.raises(ConfigError, match="distill.kl_coef=0.5 set but distill.teacher_path is empty"):
        RLTrainer(load_config(RLConfig, "rl", overrides))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        # the task advantage is multiplied by distill.task_reward_coef = 0: what only shapes it is refused
        (["algorithm.use_kl_in_reward=true"], "use_kl_in_reward=true .*task_reward_coef=0"),
        (["reward.overlong_buffer_len=2"], "overlong_buffer_len=2.*task_reward_coef=0"),
        (["algorithm.dynamic_sampling=true"], "dynamic_sampling=true .*task_reward_coef=0"),
        (["algorithm.adv_estimator=gae", "critic.enable=true"], "critic.enable=true .*task_reward_coef=0"),
        # asynchronous: the distillation advantage would take the stale sampler's log-probs as the student's
        (
            ["distill.task_reward_coef=1.0", "async_rl.staleness=1", "trainer.backend=ray", "resources.rollout=gen",
             "+resources.pools.gen.n_workers_per_node=1"],
            "async_rl.staleness >= 1: the distillation advantage would use the sampler's log-probs",
        ),
    ],
)  # fmt: skip
def test_distillation_refuses_what_it_would_ignore(
    tiny_model_dir: Path,
    teacher_dir: Path,
    arithmetic_data: dict,
    tmp_path: Path,
    extra: list[str],
    message: str,
) -> None:
    cfg = distill_config(tiny_model_dir, teacher_dir, arithmetic_data, tmp_path / "run", *extra)
    with pytest.raises(ConfigError, match=message):
        RLTrainer(cfg)


def test_pure_distillation_needs_no_group_of_samples(
    tiny_model_dir: Path, teacher_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    """With task_reward_coef 0 no group advantage is used: rollout.n=1 is not refused as grpo's would be."""
    from posttrain.trainers.checks import check_rl_config

    cfg = distill_config(tiny_model_dir, teacher_dir, arithmetic_data, tmp_path / "run", "rollout.n=1")
    check_rl_config(cfg)


def test_a_critic_of_another_model_is_checked_at_start(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    """The critic reads the policy's token ids: another tokenizer would score the wrong tokens, silently."""
    from posttrain.trainers.checks import check_rl_config

    other = make_tiny_model("tiny", tmp_path / "other", ["Zebra crossing " * 9] * 50, seed=0)
    base = rl_overrides(tiny_model_dir, arithmetic_data, tmp_path / "run", "trainer.backend=local")
    critic = [*base, "algorithm.adv_estimator=gae", "critic.enable=true"]
    with pytest.raises(ConfigError, match=r"critic \(critic.model_path\)"):
        check_rl_config(load_config(RLConfig, "rl", [*critic, f"critic.model_path={other}"]))
    with pytest.raises(ModelError, match="model directory not found"):
        check_rl_config(load_config(RLConfig, "rl", [*critic, f"critic.model_path={tmp_path / 'missing'}"]))
    check_rl_config(load_config(RLConfig, "rl", [*critic, f"critic.model_path={tiny_model_dir}"]))
