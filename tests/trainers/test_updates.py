"""Mini-batch updates: each mini-batch is what the data-parallel ranks split, so `trainer.balance_batch`
balances each one (the whole batch's balanced order, cut into mini-batches, left them unbalanced)."""

from __future__ import annotations

import torch

from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.trainers.updates import balance_across_workers, minibatch_updates


def batch_of_lengths(lengths: list[int]) -> Batch:
    width = max(lengths)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return Batch.from_dict({keys.ATTENTION_MASK: mask, keys.RESPONSE_MASK: mask.float()})


def worst_rank_share(mb: Batch, workers: int) -> float:
    """The largest rank's tokens over the mean, as the group splits `mb` into consecutive equal chunks."""
    tokens = [float(chunk[keys.ATTENTION_MASK].sum()) for chunk in mb.split(len(mb) // workers)]
    return max(tokens) / (sum(tokens) / len(tokens))


def test_every_mini_batch_is_balanced_across_the_ranks() -> None:
    lengths = [100, 100, 100, 100, 1, 1, 1, 1] * 2  # long rows first: consecutive chunks are far apart
    batch = batch_of_lengths(lengths)
    whole, _ = balance_across_workers(batch, 2)  # the forward passes' order
    seen: list[Batch] = []

    def train(mb: Batch) -> dict[str, float]:
        seen.append(mb)
        return {"loss": float(mb[keys.ATTENTION_MASK].sum())}

    minibatch_updates(whole, 4, 1, "actor", train)
    assert max(worst_rank_share(mb, 2) for mb in seen) > 1.9  # the whole batch's order, cut in fours
    seen.clear()
    metrics = minibatch_updates(whole, 4, 2, "actor", train, balance_workers=2)
    assert len(seen) == 8 and max(worst_rank_share(mb, 2) for mb in seen) < 1.05
    assert metrics["actor/loss"] == sum(lengths) / 4  # the same rows, each trained once per epoch
