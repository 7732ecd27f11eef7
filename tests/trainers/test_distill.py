"""`posttrain distill` (GKD) end to end on the ~1M preset: data responses, student samples, the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from posttrain.cli import main
from posttrain.config.load import YAML_DIR, load_config, to_dict
from posttrain.config.schema import DistillConfig
from posttrain.errors import ConfigError, DataError
from posttrain.models import load_causal_lm, make_tiny_model
from posttrain.trainers.distill import DistillTrainer


@pytest.fixture(scope="module")
def teacher_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        "tiny", tmp_path_factory.mktemp("gkd") / "t", [], seed=5, tokenizer_from=tiny_model_dir
    )


def overrides(student: Path, teacher: Path, data: dict, run: Path, *extra: str) -> list[str]:
    return [
        f"model.path={student}",
        f"distill.teacher_path={teacher}",
        f"data.train_files=[{data['train']}]",
        f"data.val_files=[{data['test']}]",
        f"trainer.run_dir={run}",
        "data.max_response_length=8",
        "data.val_max_prompts=16",
        "optim.batch_size=8",
        "optim.micro_batch_size=4",
        "optim.lr=3e-3",
        "trainer.threads_per_worker=1",
        "trainer.loggers=[jsonl]",
        "trainer.plots=false",
        *extra,
    ]


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_yaml_defaults_equal_the_schema() -> None:
    assert yaml.safe_load((YAML_DIR / "distill.yaml").read_text()) == to_dict(DistillConfig())


def test_data_responses_bring_the_student_closer_to_the_teacher(
    tiny_model_dir: Path, teacher_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    extra = ("trainer.total_steps=6", "trainer.val_every=3", "distill.beta=0.5")
    cfg = load_config(
        DistillConfig, "distill", overrides(tiny_model_dir, teacher_dir, arithmetic_data, run, *extra)
    )
    DistillTrainer(cfg).fit()
    logged = rows(run)
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5, 6]
    assert all(r["distill/on_policy"] == 0.0 and math.isfinite(r["distill/jsd"]) for r in logged)
    val = [r["val/kl_to_teacher"] for r in logged if "val/kl_to_teacher" in r]
    assert len(val) == 2 and val[1] < val[0]  # held-out KL to the teacher falls
    assert load_causal_lm(run / "hf") is not None


def test_the_teacher_of_itself_gives_zero(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    cfg = load_config(
        DistillConfig,
        "distill",
        overrides(tiny_model_dir, tiny_model_dir, arithmetic_data, tmp_path / "r", "trainer.total_steps=1"),
    )
    metrics = DistillTrainer(cfg).fit()
    assert abs(metrics["distill/jsd"]) < 1e-6  # before the update: student = teacher
    assert metrics["actor/grad_norm" if "actor/grad_norm" in metrics else "grad_norm"] < 1e-3  # zero gradient


def test_student_samples_with_lmbda_one(
    tiny_model_dir: Path, teacher_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    run = tmp_path / "onp"
    extra = ("trainer.total_steps=2", "distill.lmbda=1.0", "distill.beta=1.0", "data.val_files=[]")
    cfg = load_config(
        DistillConfig, "distill", overrides(tiny_model_dir, teacher_dir, arithmetic_data, run, *extra)
    )
    DistillTrainer(cfg).fit()
    logged = rows(run)
    assert [r["distill/on_policy"] for r in logged] == [1.0, 1.0]
    for r in logged:
        assert r["distill/loss_tokens"] > 0 and math.isfinite(r["distill/kl_to_teacher"])
        assert r["distill/jsd"] == pytest.approx(r["distill/kl_to_teacher"], rel=1e-5)  # beta = 1: reverse KL


def test_cli_distill(
    tiny_model_dir: Path, teacher_dir: Path, arithmetic_data: dict, tmp_path: Path, capsys
) -> None:
    run = tmp_path / "cli"
    args = overrides(
        tiny_model_dir, teacher_dir, arithmetic_data, run, "trainer.total_steps=2", "distill.lmbda=0.5"
    )
    assert main(["distill", *args]) == 0
    out = capsys.readouterr().out
    assert "held-out KL(student || teacher) per token" in out and f"wrote {run / 'hf'}" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("distill.beta=1.5",), "distill.beta must be in"),
        (("distill.lmbda=-0.1",), "distill.lmbda must be in"),
        (("model.remove_padding=true",), "model.remove_padding"),
        (("optim.max_token_len_per_worker=64",), "optim.max_token_len_per_worker"),
        (("distill.teacher_path=",), "distill.teacher_path is required"),
        (("data.max_pixels=3136",), "distill reads text rows only"),
        (("data.train_on=everything", "distill.lmbda=0.5"), "data.train_on=everything makes every token"),
        (
            ("data.val_max_prompts=1", "trainer.backend=ray", "trainer.n_workers_per_node=2"),
            "1 held-out rows",
        ),
    ],
)
def test_unsupported_settings_are_refused(
    tiny_model_dir: Path, teacher_dir: Path, arithmetic_data: dict, tmp_path: Path, extra: tuple, message: str
) -> None:
    cfg = load_config(
        DistillConfig, "distill", overrides(tiny_model_dir, teacher_dir, arithmetic_data, tmp_path, *extra)
    )
    with pytest.raises(ConfigError, match=message):
        DistillTrainer(cfg)


def test_text_rows_without_a_prompt_are_refused_at_the_start_when_the_student_samples(
    tiny_model_dir: Path, teacher_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    text = tmp_path / "text.jsonl"
    text.write_text("\n".join(json.dumps({"text": f"{i} + {i} = {2 * i}"}) for i in range(8)) + "\n")
    data = {**arithmetic_data, "train": text}
    cfg = load_config(
        DistillConfig,
        "distill",
        overrides(tiny_model_dir, teacher_dir, data, tmp_path / "r", "distill.lmbda=0.5"),
    )
    with pytest.raises(DataError, match=r"training row 0 has no prompt before its first loss token"):
        DistillTrainer(cfg)


def test_a_moe_students_router_loss_is_trained(
    tiny_moe_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    extra = ("trainer.total_steps=1", "model.router_aux_loss_coef=0.5", "data.val_files=[]")
    cfg = load_config(
        DistillConfig,
        "distill",
        overrides(tiny_moe_dir, tiny_moe_dir, arithmetic_data, tmp_path / "r", *extra),
    )
    metrics = DistillTrainer(cfg).fit()
    assert (
        abs(metrics["distill/jsd"]) < 1e-6
    )  # the teacher of itself: the gradient is the router loss's alone
    assert metrics["actor/router_aux_loss"] > 0
    assert metrics["actor/grad_norm" if "actor/grad_norm" in metrics else "grad_norm"] > 1e-4
