"""Driver-side generation stage: one step's rollouts, with DAPO dynamic sampling and ReMax baselines.

Dynamic sampling (Yu et al. 2025) keeps only prompt groups whose rewards differ (the others give zero
advantage) and generates more batches until the step has `train_batch_prompts` such groups or the round cap
is reached; then it fills the rest with zero-variance groups and warns, so the step keeps its shape.
"""

from __future__ import annotations

import logging

import torch

from posttrain.algorithms.reward_shaping import groups_with_reward_variance
from posttrain.config.schema import RLConfig
from posttrain.controller.roles import Rollout
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.data.dataloader import PromptDataLoader
from posttrain.rollout.base import SamplingParams
from posttrain.trainers.rewarding import RewardStage, filter_scores
from posttrain.workers.sampling import concat_padded

log = logging.getLogger(__name__)


def pad_rows(batch: Batch, multiple: int) -> Batch:
    """Repeat the last row until the length divides `multiple` (equal shards for every rank)."""
    extra = (-len(batch)) % multiple
    if extra == 0:
        return batch
    return Batch.concat([batch, batch.index([len(batch) - 1] * extra)])


def sample_rows(rollout: Rollout, rows: Batch, sampling: SamplingParams) -> Batch:
    """`rollout.sample` of any number of rows: padded to a multiple of the group's workers (`pad_rows`), the
    padding's responses dropped (a group splits a batch evenly, and a continuation or a greedy pass holds
    whatever number of rows it holds)."""
    return rollout.sample(pad_rows(rows, rollout.world_size), sampling).index(slice(0, len(rows)))


def sample_and_score(
    rollout: Rollout, prompts: Batch, sampling: SamplingParams, rewards: RewardStage
) -> Batch:
    """Generate one response per row of `prompts` (any number of rows: `sample_rows`) and score it; the
    prompt's columns are kept."""
    batch = sample_rows(rollout, prompts, sampling)
    batch = batch.union(prompts.select(tensor_keys=[]))
    return batch.union(rewards.score(batch))


def remax_baselines(
    rollout: Rollout, prompts: Batch, sampling: SamplingParams, rewards: RewardStage, n: int
) -> tuple[torch.Tensor, float]:
    """ReMax (Li et al. 2023): the reward of one greedy response per prompt, repeated for its n samples;
    also the number of tokens that greedy pass generated."""
    greedy = SamplingParams(
        max_tokens=sampling.max_tokens,
        temperature=0.0,
        stop=sampling.stop,
        stop_token_ids=sampling.stop_token_ids,
    )
    scored = sample_and_score(rollout, prompts, greedy, rewards)  # one row per prompt, whatever the workers
    baseline = scored[keys.TOKEN_LEVEL_SCORES].sum(-1)
    return baseline.repeat_interleave(n), float(scored[keys.RESPONSE_MASK].sum())


def generate_step_batch(
    cfg: RLConfig,
    rollout: Rollout,
    loader: PromptDataLoader,
    sampling: SamplingParams,
    rewards: RewardStage,
    pad_id: int,
) -> tuple[Batch, dict[str, float]]:
    """The step's scored rollouts: `train_batch_prompts` groups of `rollout.n` samples. With dynamic sampling
    the rounds' prompts were padded to each round's widest, so their rows are joined left-padded to the
    widest of all (`pad_id`).

    Ends with the reward stage's verdict on the step's failed scores (`RewardStage.end_step`): a RewardError
    stops the run here, before any update on those scores.
    """
    n, want = cfg.rollout.n, cfg.data.train_batch_prompts
    metrics: dict[str, float] = {}
    if not cfg.algorithm.dynamic_sampling:
        prompts = loader.next_batch()
        batch = sample_and_score(rollout, prompts.repeat(n, interleave=True), sampling, rewards)
        metrics["throughput/gen_tokens_total"] = float(batch[keys.RESPONSE_MASK].sum())
        if cfg.algorithm.adv_estimator == "remax":
            baselines, greedy_tokens = remax_baselines(rollout, prompts, sampling, rewards, n)
            batch.set(keys.REWARD_BASELINES, baselines)
            metrics["throughput/gen_tokens_total"] += greedy_tokens
        metrics.update(rewards.end_step())
        return batch, metrics

    kept: list[Batch] = []
    dropped: list[Batch] = []
    n_kept = rounds = 0
    generated = 0.0
    while n_kept < want and rounds < cfg.algorithm.max_gen_rounds:
        rounds += 1
        batch = sample_and_score(rollout, loader.next_batch().repeat(n, interleave=True), sampling, rewards)
        generated += float(batch[keys.RESPONSE_MASK].sum())
        varied = groups_with_reward_variance(batch[keys.UID], filter_scores(batch))
        kept.append(batch.index(varied))
        dropped.append(batch.index(~varied))
        n_kept += int(varied.sum()) // n
    metrics["dynamic_sampling/rounds"] = float(rounds)
    metrics["dynamic_sampling/kept_groups"] = float(n_kept)
    metrics["throughput/gen_tokens_total"] = generated
    pieces = [b for b in kept if len(b)]
    if n_kept < want:
        log.warning(
            "dynamic sampling: only %d of %d prompt groups had varied rewards after %d rounds "
            "(algorithm.max_gen_rounds); filling the step with zero-advantage groups",
            n_kept,
            want,
            rounds,
        )
        pieces += [b for b in dropped if len(b)]
    metrics.update(rewards.end_step())
    # whole groups stay together: rows are in group order and every round holds want * n rows
    return concat_padded(pieces, pad_id).index(slice(0, want * n)), metrics
