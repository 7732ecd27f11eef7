"""Partial rollouts (`async_rl.partial_rollout`): responses generated in chunks, new weights between chunks.

The rollout pool runs one call at a time, so weights published while a batch generates would wait for the
whole batch. Here the batch is generated `async_rl.partial_chunk_tokens` tokens at a time: between two chunks
the trainer may load new weights, and the unfinished responses continue under them. A continuation is a new
request whose prompt is the original prompt plus the response so far; the engine prefills that prefix with
the weights it holds now, so every token is sampled by exactly one policy version (the keys/values of the
prefix are recomputed, never mixed across versions) and its behaviour log-prob is log pi_v(token | prefix),
what the trainer recomputes with the weights of version v.

Every response token is tagged with the version that sampled it (`rollout_versions`); a sample's staleness at
update time is the trainer's version minus the oldest of its tokens' versions.

Stop strings are refused with partial rollouts (a string split across two chunks would be missed); eos and
the length limit end a response as in one call. The cost is one prefill of prompt + prefix per chunk.
This module imports no Ray code: the chunk runner is handed in.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import torch

from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.rollout.base import GenerationResult, SamplingParams
from posttrain.workers.sampling import batch_prompts, results_batch

# runs one chunk: (the rows to continue, sampling) -> (their sampled Batch, the policy version that sampled it)
ChunkRunner = Callable[[Batch, SamplingParams], tuple[Batch, int]]


def continuation_batch(prompts: list[list[int]], pad_id: int) -> Batch:
    """Left-padded `input_ids` / `attention_mask` rows for token lists of different lengths."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, tokens in enumerate(prompts):
        input_ids[i, width - len(tokens) :] = torch.tensor(tokens, dtype=torch.long)
        attention_mask[i, width - len(tokens) :] = 1
    return Batch.from_dict({keys.INPUT_IDS: input_ids, keys.ATTENTION_MASK: attention_mask})


def sample_in_chunks(
    rows: Batch,
    sampling: SamplingParams,
    chunk_tokens: int,
    run_chunk: ChunkRunner,
    pad_id: int,
    decode: Callable[[list[int]], str],
) -> Batch:
    """One response per prompt row of `rows`, generated `chunk_tokens` at a time through `run_chunk`.

    Returns the Batch `Rollout.sample` returns, plus `rollout_versions` (B, R) long: the version of each
    response token (-1 on padding).
    """
    start = time.perf_counter()
    prompts = batch_prompts(rows)
    tokens: list[list[int]] = [[] for _ in prompts]
    log_probs: list[list[float]] = [[] for _ in prompts]
    versions: list[list[int]] = [[] for _ in prompts]
    stop_reasons = ["length"] * len(prompts)
    active = list(range(len(prompts)))
    while active:
        done = len(tokens[active[0]])  # every unfinished response has filled each chunk so far
        chunk = replace(sampling, max_tokens=min(chunk_tokens, sampling.max_tokens - done))
        out, version = run_chunk(continuation_batch([prompts[i] + tokens[i] for i in active], pad_id), chunk)
        still: list[int] = []
        mask, responses, lps = out[keys.RESPONSE_MASK], out[keys.RESPONSES], out[keys.ROLLOUT_LOG_PROBS]
        for j, i in enumerate(active):
            n = int(mask[j].sum())
            tokens[i] += responses[j, :n].tolist()
            log_probs[i] += lps[j, :n].tolist()
            versions[i] += [version] * n
            if out.non_tensors[keys.STOP_REASON][j] == "stop":
                stop_reasons[i] = "stop"
            elif len(tokens[i]) < sampling.max_tokens:
                still.append(i)
        active = still
    results = [
        GenerationResult(t, lp, decode(t), reason)
        for t, lp, reason in zip(tokens, log_probs, stop_reasons, strict=True)
    ]
    batch = results_batch(
        rows, results, pad_id, sampling.max_tokens, time.perf_counter() - start, sampling.temperature
    )
    tagged = torch.full((len(prompts), sampling.max_tokens), -1, dtype=torch.long)
    for i, v in enumerate(versions):
        tagged[i, : len(v)] = torch.tensor(v, dtype=torch.long)
    return batch.union(Batch.from_dict({keys.ROLLOUT_VERSIONS: tagged}))
