"""A reward model in RL (`reward.model.*`): the reward stage re-renders each response with the reward model's own
tokenizer and chat template and scores it with the `reward_model` worker group, alone or added to the rule
reward; settings that cannot work are refused; GRPO on 2 Ray workers with the reward-model group logs its
scores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from posttrain.config.load import load_config
from posttrain.config.schema import RLConfig
from posttrain.controller.roles import RewardModelGroup
from posttrain.controller.worker_group import LocalWorkerGroup
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.errors import ConfigError, RewardError
from posttrain.models import load_tokenizer
from posttrain.trainers.rewarding import RewardStage, filter_scores
from posttrain.trainers.rl import RLTrainer
from posttrain.trainers.rm_scoring import reward_model_spec
from posttrain.trainers.step_metrics import score_metrics
from posttrain.workers.reward_model import RewardModelWorker
from tests.trainers.test_rl_e2e import rl_overrides, rows


def rl_cfg(model: Path, *extra: str) -> RLConfig:
    return load_config(RLConfig, "rl", [f"model.path={model}", "trainer.backend=local", *extra])


def scored_batch() -> Batch:
    questions = [("3+4", "7", "7"), ("12+30", "42", "41"), ("5+5", "10", "The answer is 10")]
    width = 3
    return Batch.from_dict(
        {keys.RESPONSE_MASK: torch.ones(len(questions), width)},
        {
            keys.PROMPT_MESSAGES: [[{"role": "user", "content": f"What is {q}?"}] for q, _, _ in questions],
            keys.RESPONSE_TEXT: [r for _, _, r in questions],
            keys.GROUND_TRUTH: [a for _, a, _ in questions],
            keys.DATA_SOURCE: ["arithmetic"] * len(questions),
            keys.EXTRA_INFO: [{} for _ in questions],
            keys.INDEX: list(range(len(questions))),
        },
    )


def hf_scores(rm: Path, batch: Batch) -> list[float]:
    """The reward model's scores through Hugging Face alone: its chat template, one row at a time."""
    from transformers import AutoModelForSequenceClassification

    tok = load_tokenizer(rm)
    model = AutoModelForSequenceClassification.from_pretrained(rm).eval()
    out = []
    for messages, response in zip(batch[keys.PROMPT_MESSAGES], batch[keys.RESPONSE_TEXT], strict=True):
        conversation = [*messages, {"role": "assistant", "content": response}]
        text = tok.apply_chat_template(conversation, tokenize=False).removesuffix("\n")  # ends at <|im_end|>
        ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
        with torch.no_grad():
            out.append(float(model(input_ids=ids).logits[0, 0]))
    return out


@pytest.mark.parametrize("with_rules", [False, True])
def test_reward_stage_scores_with_the_reward_models_own_template(
    tiny_model_dir: Path, rm_dir: Path, with_rules: bool
) -> None:
    policy_tok, rm_tok = load_tokenizer(tiny_model_dir), load_tokenizer(rm_dir)
    assert policy_tok.encode("What is 12+30? 42") != rm_tok.encode("What is 12+30? 42"), "two tokenizers"
    cfg = rl_cfg(
        tiny_model_dir,
        f"reward.model.path={rm_dir}",
        "reward.model.weight=0.5",
        f"reward.model.with_rule_rewards={str(with_rules).lower()}",
        "reward.model.micro_batch_size=2",
    )
    stage = RewardStage(cfg)
    group = LocalWorkerGroup(RewardModelWorker, reward_model_spec(cfg, threads=1), role="reward_model")
    stage.attach_model(RewardModelGroup(group))
    batch = scored_batch()
    stage.begin_step(1)
    out = stage.score(batch)
    expected_model = hf_scores(rm_dir, batch)
    rules = [1.0, 0.0, 1.0] if with_rules else [0.0, 0.0, 0.0]
    expected = [r + 0.5 * m for r, m in zip(rules, expected_model, strict=True)]
    assert list(out[keys.SCORE]) == pytest.approx(expected, abs=1e-5)
    assert out[keys.TOKEN_LEVEL_SCORES][:, -1].tolist() == pytest.approx(expected, abs=1e-5)
    assert stage.end_step()["reward/errors"] == 0.0
    # the step's model and rule scores are the rows' (batch_metrics: the rows trained on, no baselines)
    metrics = score_metrics(out, torch.tensor(expected))
    assert metrics["reward/model_score/mean"] == pytest.approx(sum(expected_model) / 3, abs=1e-5)
    assert metrics["reward/model_score/max"] == pytest.approx(max(expected_model), abs=1e-5)
    assert ("reward/rule_score/mean" in metrics) == with_rules
    # acc is the rule scorer's (2 of 3 right), never the share of model-added scores >= 1
    assert metrics.get("acc") == (pytest.approx(2 / 3) if with_rules else None)
    # dynamic sampling keeps a group on the rule score when there is one (the model's continuous score would
    # give every group variance)
    assert filter_scores(out).tolist() == pytest.approx(rules if with_rules else expected, abs=1e-5)
    # validation: the reward trained on, and the rule scorer's accuracy (a run with the model alone never
    # trains on it, but the arithmetic rows have a right answer)
    val = stage.score_validation(batch, correct_score=1.0)
    assert val.rewards == pytest.approx(expected, abs=1e-5)
    assert val.correct == [True, False, True]
    assert val.metrics["val/model_score/mean"] == pytest.approx(sum(expected_model) / 3, abs=1e-5)
    # RLHF prompts (no rule scorer for their data source): with the model alone, no accuracy and no error;
    # with rule rewards on, the unknown data source is the error it is in training
    unscored = Batch.from_dict(
        {keys.RESPONSE_MASK: batch[keys.RESPONSE_MASK]},
        {**{k: list(v) for k, v in batch.non_tensors.items()}, keys.DATA_SOURCE: ["Anthropic/hh-rlhf"] * 3},
    )
    if with_rules:
        with pytest.raises(RewardError, match="Anthropic/hh-rlhf"):
            stage.score_validation(unscored, correct_score=1.0)
    else:
        val = stage.score_validation(unscored, correct_score=1.0)
        assert val.correct == [None, None, None]
        assert val.rewards == pytest.approx([0.5 * m for m in expected_model], abs=1e-5)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["reward.model.weight=2.0"], r"reward.model.weight=2.0 set but reward.model.path is empty"),
        (
            ["reward.model.with_rule_rewards=true"],
            r"with_rule_rewards=True set but reward.model.path is empty",
        ),
        (["reward.model.path={policy}"], r"holds Qwen2ForCausalLM, not a reward model .*`posttrain rm`"),
        (
            ["reward.model.path={rm}", "reward.model.weight=0"],
            r"reward.model.weight must be a finite number > 0",
        ),
        (["reward.model.path={rm}", "agent.enable=true"], r"reward.model with agent.enable"),
        (
            ["reward.model.path={rm}", "algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[a]"],
            r"gdpo_reward_keys are components of the rule reward",
        ),
    ],
)
def test_reward_model_settings_that_cannot_work(
    tiny_model_dir: Path, rm_dir: Path, extra: list[str], message: str
) -> None:
    cfg = rl_cfg(tiny_model_dir, *(e.format(policy=tiny_model_dir, rm=rm_dir) for e in extra))
    with pytest.raises(ConfigError, match=message):
        RewardStage(cfg)


def test_a_reward_model_without_chat_template_is_refused(
    tiny_model_dir: Path, rm_dir: Path, tmp_path: Path
) -> None:
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(rm_dir, bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ConfigError, match="its tokenizer has no chat template"):
        RewardStage(rl_cfg(tiny_model_dir, f"reward.model.path={bare}"))


def test_reward_model_pool_is_placed_or_refused(tiny_model_dir: Path, rm_dir: Path) -> None:
    from posttrain.controller.placement import check_placement

    with pytest.raises(ConfigError, match="reward.model.pool=gen but reward.model.path is empty"):
        check_placement(rl_cfg(tiny_model_dir, "trainer.backend=ray", "reward.model.pool=gen"))
    with pytest.raises(ConfigError, match="needs trainer.backend=ray"):
        check_placement(rl_cfg(tiny_model_dir, f"reward.model.path={rm_dir}", "reward.model.pool=gen"))
    with pytest.raises(ConfigError, match="reward.model.pool=gen: no such pool"):
        check_placement(
            rl_cfg(
                tiny_model_dir, "trainer.backend=ray", f"reward.model.path={rm_dir}", "reward.model.pool=gen"
            )
        )


def rm_rl_run(model: Path, data: dict, run: Path, *extra: str) -> list[dict]:
    overrides = rl_overrides(model, data, run, "trainer.total_steps=2", "trainer.backend=ray", *extra)
    RLTrainer(load_config(RLConfig, "rl", overrides)).fit()
    return rows(run)


@pytest.mark.slow
def test_grpo_with_the_reward_model_group_on_two_ray_workers(
    tiny_model_dir: Path, rm_dir: Path, arithmetic_data: dict, tmp_path: Path, ray_cluster: None
) -> None:
    run = tmp_path / "run"
    metrics = rm_rl_run(
        tiny_model_dir,
        arithmetic_data,
        run,
        "trainer.n_workers_per_node=2",
        f"reward.model.path={rm_dir}",
        "reward.model.weight=3.0",
        "trainer.val_before_train=false",
    )
    placement = json.loads((run / "placement.json").read_text())
    assert len(placement["reward_model"]) == 2, "colocated: one reward-model rank per trainer worker"
    train = [r for r in metrics if "reward/mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        # the model alone: every reward is weight x its score
        assert r["reward/mean"] == pytest.approx(3.0 * r["reward/model_score/mean"], abs=1e-5)
        assert r["reward/model_score/std"] > 0 and r["reward/errors"] == 0.0
        assert "reward/rule_score/mean" not in r
        assert r["actor/grad_norm"] > 0
    assert "val/acc" in metrics[-1], "validation still reports the rule scorer's accuracy"

    # the reward model on a pool of its own (one worker) beside 2 trainer workers, added to the rule reward
    run = tmp_path / "own_pool"
    metrics = rm_rl_run(
        tiny_model_dir,
        arithmetic_data,
        run,
        "trainer.n_workers_per_node=2",
        f"reward.model.path={rm_dir}",
        "reward.model.with_rule_rewards=true",
        "reward.model.pool=rm",
        "+resources.pools.rm.n_workers_per_node=1",
        "trainer.val_before_train=false",
        "trainer.val_every=0",
    )
    placement = json.loads((run / "placement.json").read_text())
    assert len(placement["reward_model"]) == 1 and len(placement["actor_rollout_ref"]) == 2
    for r in (r for r in metrics if "reward/mean" in r):
        expected = r["reward/rule_score/mean"] + r["reward/model_score/mean"]
        assert r["reward/mean"] == pytest.approx(expected, abs=1e-5)


def test_a_rows_score_is_its_last_tokens_whatever_the_configs_pad_id(rm_dir: Path, tmp_path: Path) -> None:
    """Hugging Face pools at the last token that is not config.pad_token_id; rows are padded with the
    tokenizer's pad. With the two apart (a config naming a pad id of its own), a short row was scored on
    padding when batched with a longer one (2.763 alone, 1.94 batched)."""
    import shutil

    moved = tmp_path / "rm"
    shutil.copytree(rm_dir, moved)
    config = json.loads((moved / "config.json").read_text())
    assert load_tokenizer(moved).pad_token_id != 5
    (moved / "config.json").write_text(json.dumps({**config, "pad_token_id": 5}))
    cfg = rl_cfg(rm_dir, f"reward.model.path={moved}")

    def scores(responses: list[str]) -> list[float]:
        stage = RewardStage(cfg)
        group = LocalWorkerGroup(RewardModelWorker, reward_model_spec(cfg, threads=1), role="reward_model")
        stage.attach_model(RewardModelGroup(group))
        n = len(responses)
        batch = Batch.from_dict(
            {keys.RESPONSE_MASK: torch.ones(n, 4)},
            {
                keys.PROMPT_MESSAGES: [[{"role": "user", "content": "What is 3+4?"}]] * n,
                keys.RESPONSE_TEXT: responses,
                keys.GROUND_TRUTH: ["7"] * n,
                keys.DATA_SOURCE: ["arithmetic"] * n,
                keys.EXTRA_INFO: [{}] * n,
                keys.INDEX: list(range(n)),
            },
        )
        stage.begin_step(1)
        return list(stage.score(batch)[keys.SCORE])

    alone = scores(["7"])[0]
    batched = scores(["7", "7 is the answer to this one, written out at length"])
    assert batched[0] == pytest.approx(alone, abs=1e-5)
    assert batched[1] != pytest.approx(alone, abs=1e-3)


def test_an_input_longer_than_the_reward_model_takes_is_an_error_or_cut_from_the_left(
    tiny_model_dir: Path, rm_dir: Path
) -> None:
    """Nothing checked inputs against the reward model's context: a 16-position model silently scored rows of
    31-110 tokens. Now: a RewardError naming the row, or (truncation=left) its last max_length tokens, counted."""
    batch = scored_batch()
    limit = 12  # the rendered rows are longer: the template alone takes a dozen tokens

    def stage_with(*extra: str) -> RewardStage:
        cfg = rl_cfg(
            tiny_model_dir, f"reward.model.path={rm_dir}", f"reward.model.max_length={limit}", *extra
        )
        stage = RewardStage(cfg)
        group = LocalWorkerGroup(RewardModelWorker, reward_model_spec(cfg, threads=1), role="reward_model")
        stage.attach_model(RewardModelGroup(group))
        stage.begin_step(1)
        return stage

    with pytest.raises(RewardError, match=rf"reward model input of row 0 .* is \d+ tokens, over the {limit}"):
        stage_with().score(batch)
    stage = stage_with("reward.model.truncation=left")
    out = stage.score(batch)
    assert stage.end_step()["reward/model_truncated"] == 3.0
    # what was scored: each row's last `limit` tokens, as Hugging Face scores them alone
    from transformers import AutoModelForSequenceClassification

    tok = load_tokenizer(rm_dir)
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    inputs = stage.model.inputs(batch)  # type: ignore[union-attr]
    for row in range(3):
        ids = inputs[keys.INPUT_IDS][row][inputs[keys.ATTENTION_MASK][row].bool()]
        assert len(ids) == limit and ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")
        with torch.no_grad():
            expected = float(model(input_ids=ids[None]).logits[0, 0])
        assert out[keys.MODEL_SCORE][row] == pytest.approx(expected, abs=1e-4)
    with pytest.raises(ConfigError, match="over .* context of"):
        rl_cfg_stage = rl_cfg(tiny_model_dir, f"reward.model.path={rm_dir}", "reward.model.max_length=100000")
        RewardStage(rl_cfg_stage)
