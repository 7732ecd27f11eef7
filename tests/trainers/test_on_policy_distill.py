"""On-policy distillation in the RL trainer: a teacher on the student's tokenizer scores its samples."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from posttrain.config.load import load_config
from posttrain.config.schema import RLConfig
from posttrain.errors import ConfigError
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
