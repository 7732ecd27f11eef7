"""The agent loop: episodes run concurrently, each alternating sampling and environment steps.

    ob = env.initial_observation()
    repeat: action = sample(ob); result = env.step(action); ob = result.next_observation  until done

Every episode of every group is a coroutine; while one waits for a tool, the others sample, and the
sampler batches the requests that wait together (a `SamplingClient` generates all waiting `sample` calls as
one batch). Limits end an episode with a recorded reason: `max_turns`, `context_overflow` (no room left for
another action within `max_total_tokens`), `max_tokens` (an action hit its token budget without ending
its turn). The environment reports its own (tool timeouts, parse errors, too many tool calls).

Observations may carry images (`types.Observation`); the loop reads each one with an `ObservationReader`
(the model's processor: each image becomes its image tokens) to count its tokens against the limits and to
record the tokens and images sampled from, and hands the sampler the observation as the environment gave it.
"""

from __future__ import annotations

import asyncio
import collections
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from posttrain.agents.env import Env, EnvGroupBuilder
from posttrain.agents.observations import ObservationReader
from posttrain.agents.types import STOP_REASONS, Completion, Observation, StepResult, Trajectory, Transition
from posttrain.errors import ConfigError, PosttrainError


class TokenSampler(Protocol):
    """Samples one action: `max_tokens` at most, ending at an end-of-sequence id or one of `stop`. The prompt
    is the observation as the environment gave it (token ids for a text environment)."""

    async def sample(self, prompt: Observation, max_tokens: int, stop: list[int]) -> Completion: ...


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 8
    max_tokens_per_turn: int = 256
    max_total_tokens: int = 2048  # the whole context: first observation + every action and observation

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_tokens_per_turn", "max_total_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"agent limit {name} must be >= 1, got {getattr(self, name)}")


@dataclass
class EpisodeTimes:
    """Seconds spent sampling and in environment steps (tools), summed over episodes."""

    sampling: float = 0.0
    env: float = 0.0
    counts: collections.Counter[str] = field(default_factory=collections.Counter)


async def run_episode(
    env: Env,
    sampler: TokenSampler,
    limits: EpisodeLimits,
    times: EpisodeTimes | None = None,
    reader: ObservationReader | None = None,
) -> Trajectory:
    """One episode to its end (the environment's `done` or a limit). `reader` reads observations with images
    (None: text observations only)."""
    times = times if times is not None else EpisodeTimes()
    reader = reader if reader is not None else ObservationReader()
    observation = await env.initial_observation()
    transitions: list[Transition] = []
    stop = env.stop_tokens()
    for turn in range(limits.max_turns):
        row = reader.row(observation, f"observation {turn}")
        room = limits.max_total_tokens - len(row.tokens)
        if room < 1:
            return Trajectory(transitions, "context_overflow")
        start = time.perf_counter()
        action = await sampler.sample(observation, min(limits.max_tokens_per_turn, room), stop)
        times.sampling += time.perf_counter() - start
        start = time.perf_counter()
        try:
            result: StepResult = await env.step(action.tokens)
        except Exception as exc:
            raise PosttrainError(f"environment step {turn} failed: {type(exc).__name__}: {exc}") from exc
        times.env += time.perf_counter() - start
        transitions.append(Transition(row.tokens, action, result.reward, result.metrics, row.images))
        if result.done:  # a turn cut at its token limit that an env calls complete was still cut
            cut = action.stop_reason == "length" and result.stop_reason == "completed"
            return Trajectory(transitions, "max_tokens" if cut else result.stop_reason)
        if action.stop_reason == "length":
            return Trajectory(transitions, "max_tokens")
        observation = result.next_observation
    return Trajectory(transitions, "max_turns")


async def run_group(
    builder: EnvGroupBuilder,
    n: int,
    sampler: TokenSampler,
    limits: EpisodeLimits,
    times: EpisodeTimes,
    reader: ObservationReader | None = None,
) -> list[Trajectory]:
    """The `n` episodes of one task, concurrently; then the group's reward hook."""
    trajectories = list(
        await asyncio.gather(
            *(run_episode(env, sampler, limits, times, reader) for env in builder.make_envs(n))
        )
    )
    rewards = builder.group_rewards(trajectories)
    if len(rewards) != len(trajectories):
        raise PosttrainError(
            f"group_rewards returned {len(rewards)} rewards for {len(trajectories)} episodes"
        )
    for trajectory, reward in zip(trajectories, rewards, strict=True):
        trajectory.final_reward = float(reward)
    return trajectories


async def run_groups(
    builders: Sequence[EnvGroupBuilder],
    n: int,
    sampler: TokenSampler,
    limits: EpisodeLimits,
    reader: ObservationReader | None = None,
) -> tuple[list[list[Trajectory]], dict[str, float]]:
    """Every group's episodes at once; the groups and the step's agent metrics. `reader`: as `run_episode`'s
    (the sampler's own, so that each image is processed once)."""
    times = EpisodeTimes()
    start = time.perf_counter()
    groups = list(await asyncio.gather(*(run_group(b, n, sampler, limits, times, reader) for b in builders)))
    wall = time.perf_counter() - start
    return groups, agent_metrics(groups, times, wall)


def agent_metrics(
    groups: Sequence[Sequence[Trajectory]], times: EpisodeTimes, wall: float
) -> dict[str, float]:
    """turns per episode, the environment's counters (tool calls, tool errors...) per episode, the share of
    each stop reason, and the share of episode time spent in environment steps (tools)."""
    episodes = [t for group in groups for t in group]
    if not episodes:
        return {}
    out = {
        "agent/turns_mean": statistics.fmean(len(t.transitions) for t in episodes),
        "agent/turns_max": float(max(len(t.transitions) for t in episodes)),
        "agent/reward_mean": statistics.fmean(t.total_reward for t in episodes),
        "agent/wall_seconds": wall,
    }
    busy = times.sampling + times.env
    out["agent/env_time_share"] = times.env / busy if busy > 0 else 0.0
    reasons = collections.Counter(t.stop_reason for t in episodes)
    for reason in STOP_REASONS:
        out[f"agent/stop/{reason}"] = reasons[reason] / len(episodes)
    counters: collections.Counter[str] = collections.Counter()
    for t in episodes:
        for transition in t.transitions:
            counters.update(transition.metrics)
    for name, total in counters.items():
        out[f"agent/{name}_per_episode"] = total / len(episodes)
    return out
