"""The `preference` loss on the actor worker: DPO and its relatives over pairs of rows in one micro-batch.

Importing this module registers the loss in `workers.losses.LOSSES`; `PreferenceWorker` is the actor worker
of a module that does, so a Ray worker process that builds it has the loss too. A micro-batch holds whole
pairs (row 2i chosen, row 2i+1 rejected; data/preference_dataset.py): the trainer splits by row count with
an even micro-batch size and never by a token budget, and the loss checks it.
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.algorithms.preference_losses import (
    PairLogps,
    PreferenceOptions,
    check_preference,
    preference_loss,
)
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.data.preference_dataset import PAIR_CHOSEN, PAIR_INDEX, REF_SEQ_LOG_PROB
from posttrain.engine.engine_config import LossFn
from posttrain.errors import ConfigError
from posttrain.workers.actor_rollout_ref import ActorRolloutRefWorker
from posttrain.workers.losses import register_loss

OPTIONS = ("loss_type", "loss_weights", "beta", "label_smoothing", "simpo_gamma")


def sequence_log_probs(log_probs: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the masked per-token log-probs per row, masked tokens per row), in float64."""
    mask = mask.to(torch.float64)
    return (log_probs.to(torch.float64) * mask).sum(-1), mask.sum(-1)


def check_pairs(mb: Batch) -> None:
    chosen, index = mb[PAIR_CHOSEN], mb[PAIR_INDEX]
    if (
        len(mb) % 2
        or not bool((chosen[0::2] == 1).all())
        or not bool((chosen[1::2] == 0).all())
        or not torch.equal(index[0::2], index[1::2])
    ):
        raise ConfigError(
            "the preference loss needs whole pairs in a micro-batch (chosen, rejected rows in turn): split by "
            "an even number of rows, never by a token budget"
        )


@register_loss("preference")
def preference(options: dict[str, Any], dp_size: int) -> LossFn:
    """sum_pairs loss / (pairs in the mini-batch) over `loss_type`'s losses (algorithms/preference_losses.py);
    meta `global_seqs` = pairs and `global_tokens` = chosen tokens of the whole mini-batch."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(
            f"loss 'preference' takes no option {', '.join(map(repr, unknown))}; valid: {', '.join(OPTIONS)}"
        )
    loss_types = tuple(options.get("loss_type", ("sigmoid",)))
    weights = tuple(float(w) for w in options.get("loss_weights", ()))
    settings = PreferenceOptions(**{k: float(options[k]) for k in OPTIONS[2:] if k in options})
    check_preference(loss_types, weights, settings)

    def loss_fn(log_probs: torch.Tensor, entropy: torch.Tensor | None, mb: Batch):
        check_pairs(mb)
        sums, tokens = sequence_log_probs(log_probs, mb[keys.LOSS_MASK])
        pairs = len(mb) // 2
        global_pairs = float(mb.meta.get(keys.GLOBAL_SEQS, pairs))
        chosen_tokens = float(mb.meta.get(keys.GLOBAL_TOKENS, float(tokens[0::2].sum())))
        ref = mb[REF_SEQ_LOG_PROB].to(torch.float64) if REF_SEQ_LOG_PROB in mb else None
        logps = PairLogps(
            chosen=sums[0::2],
            rejected=sums[1::2],
            chosen_tokens=tokens[0::2],
            rejected_tokens=tokens[1::2],
            ref_chosen=None if ref is None else ref[0::2],
            ref_rejected=None if ref is None else ref[1::2],
            tokens_per_pair=chosen_tokens / global_pairs,
        )
        losses, metrics = preference_loss(logps, loss_types, weights, settings)
        loss = losses.sum() * dp_size / global_pairs
        return loss.to(log_probs.dtype), {f"dpo/{k}": float(v.mean()) for k, v in metrics.items()}

    return loss_fn


class PreferenceWorker(ActorRolloutRefWorker):
    """The actor worker (training engine + optional frozen reference, LoRA adapter off as the reference);
    built from this module, so the `preference` loss is registered wherever it runs."""
