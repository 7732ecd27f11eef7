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
    """`val/acc` is the share of responses scoring >= 1 (a correct answer), per data source too.

    With `samples_dir`, the samples table of this validation: `val_step_<step>.jsonl` (prompt, response,
    reward, ground truth, ... per row) and `val_step_<step>.html` there. `collate`: the dataset's collate
    (`collate_multimodal_prompts` keeps each row's images with it).
    A validation in which every score failed raises a RewardError (rewards/health.py)."""
    count = min(limit or len(dataset), len(dataset))
    items = [dataset[i] for i in range(count)]
    batch = collate(items, pad_token_id=pad_id, uids=[f"val-{it['index']}" for it in items])
    out = sample_rows(rollout, batch, sampling)
    out = out.union(batch.select(tensor_keys=[]))
    result = rewards.score_texts(out)
    error_rate = rewards.check_validation(result)  # RewardError when every score failed
    scores = torch.tensor(result.scores)
    metrics = {
        "val/acc": float((scores >= CORRECT_SCORE).float().mean()),
        "val/reward": float(scores.mean()),
        "val/response_length": float(out[keys.RESPONSE_MASK].sum(-1).mean()),
        **error_rate,
    }
    sources = out[keys.DATA_SOURCE]
    for source in sorted(set(sources)):
        picked = torch.tensor(sources == source)
        metrics[f"val/acc/{source}"] = float((scores[picked] >= CORRECT_SCORE).float().mean())
    if samples_dir is not None:
        summary = f"step {step} · accuracy {metrics['val/acc']:.3f} · mean reward {metrics['val/reward']:.4g}"
        title = f"Validation samples, step {step}"
        write_samples(
            samples_table(out, result.scores, step), samples_dir, f"val_step_{step}", title, summary
        )
    return metrics


def _plain(value: Any) -> Any:
    """numpy scalars and arrays as Python values (the table is JSON)."""
    return value.tolist() if hasattr(value, "tolist") else value


def samples_table(out: Batch, scores: list[float], step: int) -> list[dict[str, Any]]:
    """One row per validation prompt: its text, the greedy response, the reward and the ground truth."""
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
        row.update(
            reward=float(score), correct=float(score) >= CORRECT_SCORE, response_tokens=int(lengths[i])
        )
        rows.append(row)
    return rows
