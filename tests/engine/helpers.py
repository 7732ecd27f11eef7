"""A synthetic RL batch for engine tests: random prompts and responses with ragged lengths."""

from __future__ import annotations

import torch

from posttrain.data import keys
from posttrain.data.batch import Batch


def synthetic_rl_batch(
    rows: int = 8, prompt_width: int = 6, response_width: int = 5, vocab: int = 200, seed: int = 0
) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(2, prompt_width + 1, (rows,), generator=gen)
    response_lens = torch.randint(1, response_width + 1, (rows,), generator=gen)
    prompts = torch.zeros((rows, prompt_width), dtype=torch.long)
    prompt_mask = torch.zeros((rows, prompt_width), dtype=torch.long)
    responses = torch.zeros((rows, response_width), dtype=torch.long)
    response_mask = torch.zeros((rows, response_width))
    for i in range(rows):
        p, r = int(prompt_lens[i]), int(response_lens[i])
        prompts[i, prompt_width - p :] = torch.randint(3, vocab, (p,), generator=gen)
        prompt_mask[i, prompt_width - p :] = 1
        responses[i, :r] = torch.randint(3, vocab, (r,), generator=gen)
        response_mask[i, :r] = 1
    attention_mask = torch.cat([prompt_mask, response_mask.long()], 1)
    return Batch.from_dict(
        {
            keys.INPUT_IDS: torch.cat([prompts, responses], 1),
            keys.ATTENTION_MASK: attention_mask,
            keys.POSITION_IDS: (attention_mask.cumsum(-1) - 1).clamp(min=0),
            keys.RESPONSES: responses,
            keys.RESPONSE_MASK: response_mask,
            keys.ADVANTAGES: torch.randn((rows, response_width), generator=gen) * response_mask,
        }
    )


def grouped_rl_batch(
    prompts: int, n: int, prompt_width: int = 9, response_width: int = 7, vocab: int = 1000, seed: int = 0
) -> Batch:
    """`prompts` x `n` rows where the n rows of a prompt share it (as a GRPO rollout), in shuffled order."""
    batch = synthetic_rl_batch(prompts * n, prompt_width, response_width, vocab, seed)
    ids, mask = batch[keys.INPUT_IDS].clone(), batch[keys.ATTENTION_MASK].clone()
    for i in range(prompts * n):
        source = (i // n) * n
        ids[i, :prompt_width], mask[i, :prompt_width] = (
            ids[source, :prompt_width],
            mask[source, :prompt_width],
        )
    batch.set(keys.INPUT_IDS, ids)
    batch.set(keys.ATTENTION_MASK, mask)
    batch.set(keys.POSITION_IDS, (mask.cumsum(-1) - 1).clamp(min=0))
    order = torch.randperm(prompts * n, generator=torch.Generator().manual_seed(seed)).tolist()
    return batch.index(order)


def with_global_totals(batch: Batch) -> Batch:
    batch.meta[keys.GLOBAL_TOKENS] = float(batch[keys.RESPONSE_MASK].sum())
    batch.meta[keys.GLOBAL_SEQS] = len(batch)
    return batch
