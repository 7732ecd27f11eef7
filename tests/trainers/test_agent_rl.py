"""`posttrain train` on an agent task: GRPO over multi-turn tool episodes, on the tiny model, in-process.

The tiny model is untrained, so its turns are mostly not calls; the test checks the plumbing that matters:
episodes run through the trainer's rollout group in waves, each episode is one training row whose
response mask covers only model tokens, the update runs on it, and validation runs episodes too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from posttrain.agents.tools import build_tools
from posttrain.config.load import load_config
from posttrain.config.schema import RLConfig
from posttrain.data import keys
from posttrain.data.tasks import write_tool_multiplication_dataset
from posttrain.errors import ConfigError
from posttrain.trainers.rl import RLTrainer


@pytest.fixture(scope="module")
def tool_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tools = [t.schema() for t in build_tools(["calculator"], None)]
    return write_tool_multiplication_dataset(tmp_path_factory.mktemp("tool_data"), tools, 32, 8, 4)


def agent_config(model: Path, data: dict, run_dir: Path, *extra: str) -> RLConfig:
    return load_config(
        RLConfig,
        "rl",
        [
            f"model.path={model}",
            f"data.train_files=[{data['train']}]",
            f"data.val_files=[{data['test']}]",
            f"trainer.run_dir={run_dir}",
            "trainer.backend=local",
            "data.train_batch_prompts=2",
            "data.max_response_length=12",
            "rollout.n=2",
            "actor.optim.lr=1e-3",
            "trainer.total_steps=2",
            "trainer.val_every=2",
            "trainer.val_before_train=false",
            "data.val_max_prompts=4",
            "trainer.loggers=[jsonl]",
            "agent.enable=true",
            "agent.tools=[calculator]",
            "agent.max_turns=3",
            "agent.max_total_tokens=1000",
            *extra,
        ],
    )


def test_grpo_on_tool_episodes_through_the_trainer(
    tiny_model_dir: Path, tool_data: dict, tmp_path: Path
) -> None:
    trainer = RLTrainer(agent_config(tiny_model_dir, tool_data, tmp_path / "run"))
    seen = []
    step = trainer.step

    def recording_step() -> dict[str, float]:
        metrics = step()
        seen.append(metrics)
        return metrics

    trainer.step = recording_step  # type: ignore[method-assign]
    history = trainer.fit()
    assert [h["step"] for h in history] == [2]
    assert 0.0 <= history[0]["val/acc"] <= 1.0
    assert "val/agent/turns_mean" in history[0]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "agent/turns_mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["agent/generate_waves"] >= 1
        assert 1.0 <= r["agent/turns_mean"] <= 3.0
        assert abs(sum(v for k, v in r.items() if k.startswith("agent/stop/")) - 1.0) < 1e-6
        assert r["actor/grad_norm"] >= 0.0
        assert r["rollout/logprob_diff_max"] < 1e-4 if "rollout/logprob_diff_max" in r else True


def test_agent_rows_mask_every_token_the_model_did_not_write(
    tiny_model_dir: Path, tool_data: dict, tmp_path: Path
) -> None:
    from posttrain.agents.types import Completion, Trajectory, Transition
    from posttrain.trainers.agent_generation import trajectories_batch

    obs1, a1 = [5, 6, 7], Completion([8, 9], [-0.1, -0.2], "stop")
    obs2, a2 = [5, 6, 7, 8, 9, 40, 41], Completion([10], [-0.3], "stop")
    t = Trajectory([Transition(obs1, a1, 0.0), Transition(obs2, a2, 1.0)], "completed", final_reward=0.5)
    item = {"data_source": "x", "ground_truth": "1", "extra_info": {}, "index": 0}
    batch = trajectories_batch([[t]], [item], ["u0"], pad_id=0)
    assert batch[keys.RESPONSES][0].tolist() == [8, 9, 40, 41, 10]
    assert batch[keys.RESPONSE_MASK][0].tolist() == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert torch.allclose(batch[keys.ROLLOUT_LOG_PROBS][0], torch.tensor([-0.1, -0.2, 0.0, 0.0, -0.3]))
    assert batch[keys.TOKEN_LEVEL_SCORES][0].tolist() == [0.0, 0.0, 0.0, 0.0, 1.5], (
        "reward on the last model token"
    )


@pytest.mark.parametrize(
    "extra, message",
    [
        (["algorithm.dynamic_sampling=true"], "dynamic_sampling"),
        (["agent.tool_parser=xml"], "xml"),
        (["agent.max_tool_calls=0"], "max_tool_calls"),
        (["agent.tools=[shell]"], "shell"),
    ],
)
def test_agent_settings_that_cannot_work_are_refused(
    tiny_model_dir: Path, tool_data: dict, tmp_path: Path, extra: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        RLTrainer(agent_config(tiny_model_dir, tool_data, tmp_path / "run", *extra))


def test_tools_without_agent_enable_are_refused(
    tiny_model_dir: Path, tool_data: dict, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match="agent.enable"):
        RLTrainer(agent_config(tiny_model_dir, tool_data, tmp_path / "run", "agent.enable=false"))
