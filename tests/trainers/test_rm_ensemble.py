"""An ensemble of reward models in RL (`reward.model.ensemble`, `combine`, `uwo_coef`): every model scores each
response rendered with its own tokenizer and chat template, the scores are combined (mean, min, uwo), the
spread is logged; settings that cannot work are refused naming the key; a GRPO run trains on the combination."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.algorithms.reward_ensemble import combine_ensemble_scores
from posttrain.config.load import load_config
from posttrain.config.schema import RLConfig
from posttrain.controller.roles import RewardModelGroup
from posttrain.controller.worker_group import LocalWorkerGroup
from posttrain.data import keys
from posttrain.engine.reward_engine import load_reward_model
from posttrain.errors import ConfigError
from posttrain.models import load_tokenizer
from posttrain.trainers.rewarding import RewardStage
from posttrain.trainers.rl import RLTrainer
from posttrain.trainers.rm_scoring import reward_model_spec
from posttrain.workers.reward_model import RewardModelWorker
from tests.trainers.test_rl_e2e import rl_overrides, rows
from tests.trainers.test_rm_rl import hf_scores, rl_cfg, scored_batch


@pytest.fixture(scope="module")
def second_rm(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second reward model, on the policy's tokenizer (the first has its own): another score head."""
    torch.manual_seed(7)
    out = tmp_path_factory.mktemp("rm2") / "rm"
    load_reward_model(tiny_model_dir).save_pretrained(out)
    load_tokenizer(tiny_model_dir).save_pretrained(out)
    return out


@pytest.mark.parametrize(("combine", "coef"), [("mean", 0.0), ("min", 0.0), ("uwo", 0.5)])
def test_the_ensemble_scores_each_response_with_every_model_and_combines_them(
    tiny_model_dir: Path, rm_dir: Path, second_rm: Path, combine: str, coef: float
) -> None:
    cfg = rl_cfg(
        tiny_model_dir,
        f"reward.model.path={rm_dir}",
        f"reward.model.ensemble=[{second_rm}]",
        f"reward.model.combine={combine}",
        f"reward.model.uwo_coef={coef}",
        "reward.model.weight=2.0",
        "reward.model.micro_batch_size=2",
    )
    stage = RewardStage(cfg)
    group = LocalWorkerGroup(RewardModelWorker, reward_model_spec(cfg, threads=1), role="reward_model")
    stage.attach_model(RewardModelGroup(group))
    batch = scored_batch()
    per_model = torch.tensor([hf_scores(rm_dir, batch), hf_scores(second_rm, batch)], dtype=torch.float64)
    assert (per_model[0] - per_model[1]).abs().min() > 1e-4, "the two models score differently"
    expected = combine_ensemble_scores(per_model, combine, coef)
    stage.begin_step(1)
    out = stage.score(batch)
    assert list(out[keys.SCORE]) == pytest.approx((2.0 * expected).tolist(), abs=1e-5)
    assert list(out[keys.MODEL_SCORE]) == pytest.approx(expected.tolist(), abs=1e-5)
    metrics = stage.end_step()
    spread = per_model.std(dim=0, unbiased=False).mean()
    assert metrics["reward/model_score/ensemble_std"] == pytest.approx(float(spread), abs=1e-5)
    val = stage.score_validation(batch, correct_score=1.0)  # the combined score; the rule scorer's accuracy
    assert val.rewards == pytest.approx((2.0 * expected).tolist(), abs=1e-5)
    assert val.correct == [True, False, True]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["reward.model.ensemble=[{rm}]"],
            r"reward.model.ensemble=\[.*\] set but reward.model.path is empty",
        ),
        (
            ["reward.model.path={rm}", "reward.model.ensemble=[{policy}]"],
            r"reward.model.ensemble\[0\]=.* holds Qwen2ForCausalLM, not a reward model",
        ),
        (["reward.model.path={rm}", "reward.model.ensemble=[{rm}]"], r"name .* more than once"),
        (
            ["reward.model.path={rm}", "reward.model.combine=min"],
            r"combine=min set but reward.model.ensemble is empty",
        ),
        (
            ["reward.model.path={rm}", "reward.model.ensemble=[{rm2}]", "reward.model.combine=uwo"],
            r"combine=uwo needs reward.model.uwo_coef > 0",
        ),
        (
            ["reward.model.path={rm}", "reward.model.ensemble=[{rm2}]", "reward.model.uwo_coef=0.1"],
            r"uwo_coef=0.1 is used by combine=uwo only",
        ),
    ],
)
def test_ensemble_settings_that_cannot_work(
    tiny_model_dir: Path, rm_dir: Path, second_rm: Path, extra: list[str], message: str
) -> None:
    values = {"policy": tiny_model_dir, "rm": rm_dir, "rm2": second_rm}
    cfg = rl_cfg(tiny_model_dir, *(e.format(**values) for e in extra))
    with pytest.raises(ConfigError, match=message):
        RewardStage(cfg)


def test_an_unknown_combine_lists_the_valid_ones(tiny_model_dir: Path, rm_dir: Path) -> None:
    with pytest.raises(ConfigError, match="combine.*mean.*min.*uwo"):
        rl_cfg(tiny_model_dir, f"reward.model.path={rm_dir}", "reward.model.combine=max")


def ensemble_grpo(model: Path, reward_models: list[Path], data: dict, run: Path, *extra: str) -> list[dict]:
    """2 GRPO steps whose only reward is the ensemble of `reward_models`: the steps' metric rows."""
    overrides = rl_overrides(
        model,
        data,
        run,
        "trainer.total_steps=2",
        "trainer.val_before_train=false",
        "trainer.val_every=0",
        "trainer.save_every=0",
        f"reward.model.path={reward_models[0]}",
        f"reward.model.ensemble=[{','.join(map(str, reward_models[1:]))}]",
        *extra,
    )
    RLTrainer(load_config(RLConfig, "rl", overrides)).fit()
    train = [r for r in rows(run) if "reward/mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    return train


def test_grpo_trains_on_the_ensembles_combined_score(
    tiny_model_dir: Path, rm_dir: Path, second_rm: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    models = [rm_dir, second_rm]
    train = ensemble_grpo(
        tiny_model_dir,
        models,
        arithmetic_data,
        tmp_path / "run",
        "trainer.backend=local",
        "reward.model.combine=min",
    )
    for r in train:
        assert r["reward/mean"] == pytest.approx(r["reward/model_score/mean"], abs=1e-5)
        assert r["reward/model_score/ensemble_std"] > 0
        assert r["actor/grad_norm"] > 0


@pytest.mark.slow
def test_an_ensemble_on_two_ray_workers_trains_on_the_uwo_combination(
    tiny_model_dir: Path,
    rm_dir: Path,
    second_rm: Path,
    arithmetic_data: dict,
    tmp_path: Path,
    ray_cluster: None,
) -> None:
    extra = ["trainer.backend=ray", "trainer.n_workers_per_node=2", "reward.model.combine=uwo",
             "reward.model.uwo_coef=0.5", "reward.model.weight=2.0"]  # fmt: skip
    train = ensemble_grpo(tiny_model_dir, [rm_dir, second_rm], arithmetic_data, tmp_path / "run", *extra)
    for r in train:  # each rank holds both models; the reward is weight x the combined score
        assert r["reward/mean"] == pytest.approx(2.0 * r["reward/model_score/mean"], abs=1e-5)
        assert r["reward/model_score/ensemble_std"] > 0 and r["reward/errors"] == 0.0
        assert r["actor/grad_norm"] > 0
