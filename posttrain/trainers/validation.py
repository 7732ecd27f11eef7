"""Validation: greedy accuracy, mean reward and response length on the held-out split, and its samples table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from posttrain.controller.roles import Rollout
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.data.dataloader import CollateFn, IndexedDataset
from posttrain.data.dataset import collate_prompts
from posttrain.rollout.base import SamplingParams
from posttrain.tracking.samples import write_samples
from posttrain.trainers.generation import sample_rows
from posttrain.trainers.rewarding import RewardStage

CORRECT_SCORE = 1.0  # a response scoring at least this is a correct answer (val/acc)
SAMPLES_DIR = "samples"  # in the run directory: each validation's val_step_<N>.jsonl and .html


def validate(
    rollout: Rollout,
    dataset: IndexedDataset,
    pad_id: int,
    sampling: SamplingParams,
    rewards: RewardStage,
    limit: int,
    samples_dir: Path | None = None,
    step: int = 0,
    collate: CollateFn = collate_prompts,
) -> dict[str, float]:
    """`val/acc` is the share of responses whose rule score is >= 1 (a correct answer), per data source too,
    over the rows that have a rule scorer (none with a reward model alone on RLHF data: no `val/acc` then);
    `val/reward` the mean reward the run trains on (with a reward model: its weighted score, and
    `val/model_score/mean`).

    With `samples_dir`, the samples table of this validation: `val_step_<step>.jsonl` (prompt, response,
    reward, ground truth, ... per row) and `val_step_<step>.html` there. `collate`: the dataset's collate
    (`collate_multimodal_prompts` keeps each row's images with it).
    A validation in which every score failed raises a RewardError (rewards/health.py)."""
    count = min(limit or len(dataset), len(dataset))
    items = [dataset[i] for i in range(count)]
    batch = collate(items, pad_token_id=pad_id, uids=[f"val-{it['index']}" for it in items])
    out = sample_rows(rollout, batch, sampling)
    out = out.union(batch.select(tensor_keys=[]))
    scored = rewards.score_validation(out, CORRECT_SCORE)  # RewardError when every rule score failed
    metrics: dict[str, float] = {}
    judged = [c for c in scored.correct if c is not None]
    if judged:
        metrics["val/acc"] = sum(judged) / len(judged)
    metrics["val/reward"] = float(torch.tensor(scored.rewards).mean())
    metrics["val/response_length"] = float(out[keys.RESPONSE_MASK].sum(-1).mean())
    metrics.update(scored.metrics)
    sources = list(out[keys.DATA_SOURCE])
    for source in sorted(set(sources)):
        mine = [c for c, s in zip(scored.correct, sources, strict=True) if s == source and c is not None]
        if mine:
            metrics[f"val/acc/{source}"] = sum(mine) / len(mine)
    if samples_dir is not None:
        accuracy = f"accuracy {metrics['val/acc']:.3f} · " if "val/acc" in metrics else ""
        summary = f"step {step} · {accuracy}mean reward {metrics['val/reward']:.4g}"
        title = f"Validation samples, step {step}"
        write_samples(
            samples_table(out, scored.rewards, scored.correct, step),
            samples_dir,
            f"val_step_{step}",
            title,
            summary,
        )
    return metrics


def _plain(value: Any) -> Any:
    """numpy scalars and arrays as Python values (the table is JSON)."""
    return value.tolist() if hasattr(value, "tolist") else value


def samples_table(
    out: Batch, scores: list[float], correct: list[bool | None], step: int
) -> list[dict[str, Any]]:
    """One row per validation prompt: its text, the greedy response, the reward, whether it is correct (None
    without a rule scorer) and the ground truth."""
    lengths = out[keys.RESPONSE_MASK].sum(-1).tolist()
    columns = {
        name: list(out[key]) if key in out else [None] * len(out)
        for name, key in (
            ("index", keys.INDEX),
            ("data_source", keys.DATA_SOURCE),
            ("prompt", keys.RAW_PROMPT),
            ("response", keys.RESPONSE_TEXT),
            ("ground_truth", keys.GROUND_TRUTH),
            ("stop_reason", keys.STOP_REASON),
        )
    }
    rows = []
    for i, score in enumerate(scores):
        row: dict[str, Any] = {"step": step}
        row.update({name: _plain(values[i]) for name, values in columns.items()})
        row.update(reward=float(score), correct=correct[i], response_tokens=int(lengths[i]))
        rows.append(row)
    return rows
