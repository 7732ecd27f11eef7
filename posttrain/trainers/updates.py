"""The update phase of a step: epochs over mini-batches, each normalised by its global totals, and the
data-parallel balancing of a step's samples.

`minibatch_updates` is shared by the actor and the critic: `train(mb)` runs one role's forward/backward
and optimizer step on a mini-batch and returns its metrics; `actor_update` and `critic_update` are the two
roles' updates over it. The `*_KEYS` lists say which columns each verb sends to the workers.
"""

from __future__ import annotations

from collections.abc import Callable

from posttrain.config.schema import ActorConfig, CriticConfig
from posttrain.controller.roles import ActorGroup, CriticGroup
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.data.partition import balanced_partition
from posttrain.workers.losses import LossSpec

Metrics = dict[str, float]

# What each verb needs on the wire (the rest of the Batch stays on the driver).
FORWARD_KEYS = [keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS, keys.RESPONSES]
UPDATE_KEYS = [*FORWARD_KEYS, keys.RESPONSE_MASK, keys.OLD_LOG_PROBS, keys.ADVANTAGES, keys.ROLLOUT_LOG_PROBS]
CRITIC_KEYS = [*FORWARD_KEYS, keys.RESPONSE_MASK, keys.VALUES, keys.RETURNS]


def minibatch_updates(
    batch: Batch,
    mini_batch_size: int,
    epochs: int,
    prefix: str,
    train: Callable[[Batch], Metrics],
    balance_workers: int = 1,
) -> Metrics:
    """`epochs` passes over mini-batches of `mini_batch_size` samples (0 = the whole batch).

    Each mini-batch carries its global token and sequence counts in meta, so the loss is normalised over
    the mini-batch whatever the micro-batching and world size. With `balance_workers` > 1 (trainer.
    balance_batch) each mini-batch's rows are reordered so the group's `balance_workers` data-parallel ranks
    get near-equal tokens of it: a mini-batch is what a rank's share is cut from, so the whole batch's order
    (balanced for the forward passes) would not balance it. Metrics are averaged over the optimizer steps
    (`*_max` metrics: the maximum) and prefixed with the role unless already named.
    """
    mini = mini_batch_size or len(batch)
    sums: Metrics = {}
    maxima: Metrics = {}
    count = 0
    mini_batches = [
        balance_across_workers(mb, balance_workers)[0] if balance_workers > 1 else mb
        for mb in batch.split(mini)
    ]
    for _ in range(epochs):
        for mb in mini_batches:  # the role group counts its loss's totals over the whole mini-batch
            for k, v in train(mb).items():
                name = k if k.startswith((f"{prefix}/", "rollout/")) else f"{prefix}/{k}"
                if name.endswith("_max"):
                    maxima[name] = max(maxima.get(name, float("-inf")), v)
                else:
                    sums[name] = sums.get(name, 0.0) + v
            count += 1
    return {**{k: v / count for k, v in sums.items()}, **maxima}


def actor_update(
    actor: ActorGroup,
    batch: Batch,
    loss: LossSpec,
    actor_cfg: ActorConfig,
    temperature: float,
    balance: bool = False,
) -> Metrics:
    """The actor's update on `batch` (the columns it sends): `actor.ppo_epochs` passes over mini-batches of
    `actor.mini_batch_size` samples, one forward/backward with `loss` and one optimizer step each."""

    def train(mb: Batch) -> Metrics:
        return {**actor.forward_backward(mb, loss, temperature=temperature), **actor.optim_step()}

    workers = actor.data_parallel_size if balance else 1
    return minibatch_updates(batch, actor_cfg.mini_batch_size, actor_cfg.ppo_epochs, "actor", train, workers)


def critic_update(
    critic: CriticGroup, batch: Batch, loss: LossSpec, critic_cfg: CriticConfig, balance: bool = False
) -> Metrics:
    """The critic's update on `batch` (CRITIC_KEYS): its own epochs over its own mini-batches."""

    def train(mb: Batch) -> Metrics:
        return {**critic.forward_backward(mb, loss), **critic.optim_step()}

    workers = critic.data_parallel_size if balance else 1
    return minibatch_updates(
        batch, critic_cfg.mini_batch_size, critic_cfg.ppo_epochs, "critic", train, workers
    )


def balance_across_workers(batch: Batch, workers: int) -> tuple[Batch, Metrics]:
    """Reorder rows so the equal, consecutive chunks the worker group hands out carry near-equal tokens.

    Rows are independent samples (groups are found by uid, not position), so the order is free.
    """
    lengths = batch[keys.ATTENTION_MASK].sum(1).tolist()
    parts = balanced_partition(lengths, workers)
    tokens = [sum(lengths[i] for i in part) for part in parts]
    mean = sum(tokens) / workers
    return batch.index([i for part in parts for i in part]), {
        "balance/max_over_mean_tokens": max(tokens) / mean if mean else 1.0
    }
