"""Validation: greedy accuracy, mean reward and response length on the held-out split."""

from __future__ import annotations

import torch

from posttrain.controller.roles import Rollout
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.data.dataset import PromptDataset, collate_prompts
from posttrain.rollout.base import SamplingParams
from posttrain.trainers.rewarding import RewardStage


def pad_rows(batch: Batch, multiple: int) -> Batch:
    """Repeat the last row until the length divides `multiple` (equal shards for every rank)."""
    extra = (-len(batch)) % multiple
    if extra == 0:
        return batch
    return Batch.concat([batch, batch.index([len(batch) - 1] * extra)])


def validate(
    rollout: Rollout,
    dataset: PromptDataset,
    pad_id: int,
    sampling: SamplingParams,
    rewards: RewardStage,
    limit: int,
) -> dict[str, float]:
    """`val/acc` is the share of responses scoring >= 1 (a correct answer), per data source too.

    A validation in which every score failed raises a RewardError (rewards/health.py)."""
    count = min(limit or len(dataset), len(dataset))
    items = [dataset[i] for i in range(count)]
    batch = collate_prompts(items, pad_token_id=pad_id, uids=[f"val-{it['index']}" for it in items])
    out = rollout.sample(pad_rows(batch, rollout.world_size), sampling).index(slice(0, len(batch)))
    out = out.union(batch.select(tensor_keys=[]))
    result = rewards.score_texts(out)
    error_rate = rewards.check_validation(result)  # RewardError when every score failed
    scores = torch.tensor(result.scores)
    metrics = {
        "val/acc": float((scores >= 1.0).float().mean()),
        "val/reward": float(scores.mean()),
        "val/response_length": float(out[keys.RESPONSE_MASK].sum(-1).mean()),
        **error_rate,
    }
    sources = out[keys.DATA_SOURCE]
    for source in sorted(set(sources)):
        picked = torch.tensor(sources == source)
        metrics[f"val/acc/{source}"] = float((scores[picked] >= 1.0).float().mean())
    return metrics
