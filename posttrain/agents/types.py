"""What an agent episode is made of: observations and actions as token ids, step results, trajectories.

Everything is token ids from the sampler (tokens in, tokens out): a trajectory is never re-tokenised from
text, so what is trained is exactly what was sampled. An observation is the whole context the next action
is sampled from (tinker-cookbook's convention); when it extends the previous observation plus the action,
the turns are trained as one sequence (`training_data.py`).

An observation is token ids, or, to show the model images, one of the explicit API's two image-carrying
forms: a tinker `ModelInput` whose `ImageChunk`s hold png/jpeg bytes (what a `SamplingClient` takes, so an
environment written for the explicit API runs unchanged), or an `InputRow` (token ids with each image's
tokens already expanded, and the processed pixels: what a multimodal dataset row already holds). The agent
loop reads each observation once into an `InputRow` (`observations.py`) with the model's own processor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, TypeAlias

import torch
from tinker import types

from posttrain.client.model_inputs import InputRow

# The context of the next action: token ids, a ModelInput (ImageChunks allowed), or a read InputRow.
Observation: TypeAlias = list[int] | types.ModelInput | InputRow

# Why a trajectory ended. `completed`: the environment said done; the others are limits or failures.
StopReason = Literal[
    "completed",
    "max_turns",
    "max_tokens",
    "max_tool_calls",
    "context_overflow",
    "parse_error",
    "tool_timeout",
    "error",
]
STOP_REASONS: tuple[str, ...] = StopReason.__args__  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Completion:
    """One sampled action: its tokens, their log-probs under the sampler, and why sampling stopped
    (`stop`: an end-of-turn/stop token or string; `length`: the token budget)."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str


@dataclass(frozen=True)
class StepResult:
    """What the environment answers to an action.

    `next_observation`: the full context of the next action (unused when `done`; it may hold images, see
    `Observation`); `stop_reason`: why the episode ended (when `done`); `metrics`: numbers averaged into the
    step's metrics (e.g. tool calls)."""

    reward: float
    done: bool
    next_observation: Observation = field(default_factory=list)
    stop_reason: StopReason = "completed"
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Transition:
    """One turn: the observation sampled from (its token ids as sampled, each image as its image tokens), the
    action, and the environment's answer; `images`: the observation's images in order, as one
    `multi_modal_inputs` entry (`pixel_values`, `image_grid_thw`; {} for a text observation)."""

    observation: list[int]
    action: Completion
    reward: float
    metrics: dict[str, float] = field(default_factory=dict)
    images: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Trajectory:
    """One episode: its turns, why it ended, and the reward the group hook added at the end."""

    transitions: list[Transition]
    stop_reason: StopReason
    final_reward: float = 0.0  # from the group's reward hook (e.g. a scorer on the final answer)
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def total_reward(self) -> float:
        return sum(t.reward for t in self.transitions) + self.final_reward

    @property
    def answer_score(self) -> float:
        """The scorer's value of the final answer (0 when the episode ended without one)."""
        if self.stop_reason != "completed" or not self.transitions:
            return 0.0
        return float(self.transitions[-1].metrics.get("answer_score", self.total_reward))

    @property
    def made_successful_call(self) -> bool:
        """At least one tool call of the episode ran without an error."""
        return any(
            t.metrics.get("tool_calls", 0.0) > t.metrics.get("tool_errors", 0.0) for t in self.transitions
        )
