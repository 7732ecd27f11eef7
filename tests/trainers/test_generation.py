"""The synchronous step's generation with dynamic sampling: rounds whose prompts were padded to different widths
are joined (DAPO stopped at its first step needing two rounds of prompts of other lengths)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.data.dataloader import PromptDataLoader
from posttrain.data.dataset import collate_prompts
from posttrain.rollout.base import GenerationResult, SamplingParams
from posttrain.trainers.generation import generate_step_batch
from posttrain.workers.sampling import results_batch

PAD = 0


class TwoTokenRollout:
    """Answers every prompt with the same two tokens (the real results_batch builds the rows)."""

    world_size = 1

    def sample(self, rows: Batch, sampling: SamplingParams) -> Batch:
        results = [GenerationResult([5, 6], [-1.0, -1.0], "ab", "stop") for _ in range(len(rows))]
        return results_batch(rows, results, PAD, sampling.max_tokens, 0.0, sampling.temperature)


class RoundRewards:
    """Round 1: only the first group's rewards differ; round 2: every group's (two kept pieces to join)."""

    def __init__(self) -> None:
        self.calls = 0

    def score(self, batch: Batch) -> Batch:
        self.calls += 1
        scores = [float(i % 2) if self.calls > 1 or i < 2 else 0.0 for i in range(len(batch))]
        return Batch.from_dict({keys.TOKEN_LEVEL_SCORES: torch.zeros(len(batch), 4)}, {keys.SCORE: scores})

    def end_step(self) -> dict[str, float]:
        return {}


def test_dynamic_sampling_joins_rounds_of_different_prompt_widths() -> None:
    items = [
        {"input_ids": [1] * (3 if i < 2 else 5), "data_source": "x", "ground_truth": "1", "extra_info": {},
         "raw_prompt": "p", "messages": [], "index": i}
        for i in range(8)
    ]  # fmt: skip  # the loader's first batch holds 3-token prompts, its second 5-token ones
    loader = PromptDataLoader(items, 2, lambda it, uids: collate_prompts(it, PAD, uids), shuffle=False)
    cfg: Any = SimpleNamespace(
        rollout=SimpleNamespace(n=2),
        data=SimpleNamespace(train_batch_prompts=2),
        algorithm=SimpleNamespace(dynamic_sampling=True, max_gen_rounds=4, adv_estimator="grpo"),
    )
    batch, metrics = generate_step_batch(
        cfg, TwoTokenRollout(), loader, SamplingParams(max_tokens=4), RoundRewards(), PAD
    )  # type: ignore[arg-type]
    assert metrics["dynamic_sampling/rounds"] == 2 and len(batch) == 4
    mask = batch[keys.ATTENTION_MASK]
    assert mask.shape[1] == 5 + 4  # the widest prompt + the responses
    assert mask[:2, :5].sum(-1).tolist() == [3, 3]  # round 1's rows, left-padded to 5
    assert (batch[keys.INPUT_IDS][:2, :2] == PAD).all() and (batch[keys.INPUT_IDS][:2, 2:5] == 1).all()


class TwoWorkerRollout(TwoTokenRollout):
    """Splits a batch over 2 workers, as a worker group does: an odd row count is an error there."""

    world_size = 2

    def sample(self, rows: Batch, sampling: SamplingParams) -> Batch:
        assert len(rows) % 2 == 0, f"a batch of {len(rows)} rows cannot be split evenly across 2 workers"
        return super().sample(rows, sampling)


def test_a_greedy_pass_of_any_number_of_prompts_runs_on_two_rollout_workers() -> None:
    """ReMax's baseline samples one row per prompt (and a partial rollout's continuation only the unfinished
    rows): padded to the workers and the padding dropped, not an uneven split treated as a dead worker."""
    from posttrain.trainers.generation import remax_baselines

    items = [
        {"input_ids": [1, 2], "data_source": "x", "ground_truth": "1", "extra_info": {}, "raw_prompt": "p",
         "messages": [], "index": i}
        for i in range(3)
    ]  # fmt: skip
    prompts = collate_prompts(items, PAD, [str(i) for i in range(3)])
    baselines, tokens = remax_baselines(
        TwoWorkerRollout(), prompts, SamplingParams(max_tokens=4), RoundRewards(), 2
    )
    assert (
        baselines.shape == (6,) and tokens == 3 * 2
    )  # 3 greedy answers of 2 tokens each, none for the padding
