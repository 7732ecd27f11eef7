"""verl rows pick their agent loop by `agent_name`; the default is the single-turn task, scored as the
trainer scores it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from posttrain.agents.registry import AgentSetup, agent_names, group_builder
from posttrain.agents.rollout import EpisodeLimits, run_groups
from posttrain.agents.samplers import EngineSampler
from posttrain.errors import DataError
from posttrain.models import load_tokenizer
from posttrain.rewards import default_compute_score
from posttrain.rollout.base import SamplingParams
from posttrain.rollout.native import NativeRolloutEngine


def test_dataset_rows_run_as_single_turn_episodes_scored_by_their_source(
    tiny_model_dir: Path, arithmetic_data: dict[str, Path]
) -> None:
    rows = pq.read_table(arithmetic_data["train"]).slice(0, 3).to_pylist()
    tok = load_tokenizer(tiny_model_dir)
    setup = AgentSetup(tok)
    builders = [group_builder(row, setup, i) for i, row in enumerate(rows)]
    engine = NativeRolloutEngine(str(tiny_model_dir), seed=0)
    sampler = EngineSampler(engine, SamplingParams(temperature=1.0))
    groups, metrics = asyncio.run(run_groups(builders, 2, sampler, EpisodeLimits(max_tokens_per_turn=8)))
    for row, group in zip(rows, groups, strict=True):
        for trajectory in group:
            (turn,) = trajectory.transitions
            text = tok.decode(turn.action.tokens, skip_special_tokens=True)
            truth = row["reward_model"]["ground_truth"]
            assert turn.reward == float(default_compute_score(row["data_source"], text, truth))
            cut = turn.action.stop_reason == "length"  # scored all the same, but recorded as cut
            assert trajectory.stop_reason == ("max_tokens" if cut else "completed")
    reasons = [t.stop_reason for g in groups for t in g]
    assert metrics["agent/stop/completed"] == reasons.count("completed") / len(reasons)
    assert "single_turn" in agent_names()


def test_bad_rows_name_the_row_and_the_problem(tiny_model_dir: Path) -> None:
    setup = AgentSetup(load_tokenizer(tiny_model_dir))
    good = {"prompt": [{"role": "user", "content": "1+1"}], "reward_model": {"ground_truth": "2"}}
    with pytest.raises(DataError, match=r"row 4: agent_name 'nope' is not registered; known: .*single_turn"):
        group_builder({**good, "agent_name": "nope"}, setup, 4)
    with pytest.raises(DataError, match=r"row 2 \(agent single_turn\): reward_model.ground_truth is missing"):
        group_builder({"prompt": good["prompt"]}, setup, 2)
    with pytest.raises(DataError, match="row 0 .*prompt must be a non-empty list"):
        group_builder({**good, "prompt": []}, setup, 0)
