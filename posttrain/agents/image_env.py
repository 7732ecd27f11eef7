"""A built-in environment whose observations show the model images: look at an image, answer; the next image.

    ob 0 = the row's chat + user turn [image 0, question 0] + assistant header       (a ModelInput)
    turn k: the model answers question k; the next observation is ob k + the sampled tokens + the template's
            suffix with user turn [image k+1, question k+1] + assistant header
    end:   after the last question; each answer is scored by the row's scorer (the shapes task's)

The images are the shapes task's (posttrain/data/tasks/shapes.py), drawn from the row's `extra_info.seed`, so a
row is a few numbers and the episode's images are the same on every rank and every run. Each image is an
`ImageChunk` of PNG bytes inside a `ModelInput` built from the vision-language chat template's rendering
(`observations.chat_model_input`): the same observation samples on the explicit API (a SamplingClient) and in
the RL trainer, which reads it with the model's own processor. Each observation extends the previous one plus
the action, so an episode trains as one row: its images in order, their tokens never trained.

Reward: each answer's score divided by the number of questions (an episode's total is the share answered
right); `answer_score` (what `val/acc` counts) is that share too, so only an episode that answers every
question counts as correct. A turn ends at a stop token (`stop_tokens()`: the end of turn); an answer cut by
the token budget ends the episode (`max_tokens`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tinker import types

from posttrain.agents.chat_render import ChatRenderer, Message
from posttrain.agents.env import Env, Scorer
from posttrain.agents.observations import chat_model_input
from posttrain.agents.registry import AgentSetup, chat_messages, register_agent
from posttrain.agents.types import StepResult, Trajectory
from posttrain.data.tasks.shapes import DATA_SOURCE, KINDS, make_problem, png_bytes
from posttrain.errors import DataError

LOOK_AND_ANSWER = "look_and_answer"
IMAGE_TOKEN = "<|image_pad|>"  # what the Qwen2-VL chat template renders for an image part
INSTRUCTION = "Answer each question about an image with one word or number."


@dataclass(frozen=True)
class ImageQuestion:
    """One turn's image (PNG bytes), question and the answer its score is computed against."""

    image: bytes
    question: str
    answer: str


def user_turn(question: ImageQuestion) -> Message:
    """A user message with the image first, then the question (the shapes task's prompt layout)."""
    return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question.question}]}


def shapes_questions(seed: int, turns: int, kind: str = "count", size: int = 56) -> list[ImageQuestion]:
    """`turns` shapes-task problems drawn from `seed` (the same seed gives the same images)."""
    if kind not in KINDS:
        raise DataError(f"{LOOK_AND_ANSWER}: kind {kind!r} is not one of {', '.join(KINDS)}")
    if turns < 1:
        raise DataError(f"{LOOK_AND_ANSWER}: turns must be >= 1, got {turns}")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(turns):
        image, question, answer = make_problem(rng, kind, size=size)
        out.append(ImageQuestion(png_bytes(image), f"{question} Answer with one word or number.", answer))
    return out


@dataclass
class LookAndAnswerEnv:
    """One episode (see the module docstring)."""

    messages: list[Message]  # the chat before the first image (e.g. an instruction)
    questions: Sequence[ImageQuestion]
    renderer: ChatRenderer
    scorer: Scorer
    image_token: str = IMAGE_TOKEN
    history: list[Message] = field(default_factory=list)
    context: types.ModelInput = field(default_factory=lambda: types.ModelInput(chunks=[]))
    scores: list[float] = field(default_factory=list)

    async def initial_observation(self) -> types.ModelInput:
        self.history = [*self.messages, user_turn(self.questions[0])]
        text = self.renderer.render(self.history, generation_prompt=True)
        self.context = chat_model_input(
            text, [self.questions[0].image], self.renderer.tokenizer, self.image_token
        )
        self.scores = []
        return self.context

    def stop_tokens(self) -> list[int]:
        return [self.renderer.end_of_turn_id]

    async def step(self, action: list[int]) -> StepResult:
        turn = len(self.scores)
        finished = bool(action) and action[-1] in self.stop_tokens()  # else cut by the token budget
        text = self.renderer.tokenizer.decode(action, skip_special_tokens=True)
        score = float(self.scorer(text, self.questions[turn].answer))
        self.scores.append(score)
        reward = score / len(self.questions)
        metrics = {"images_seen": 1.0}
        if not finished:
            return StepResult(reward, True, stop_reason="max_tokens", metrics=metrics)
        if turn + 1 == len(self.questions):
            metrics["answer_score"] = sum(self.scores) / len(self.questions)
            return StepResult(reward, True, stop_reason="completed", metrics=metrics)
        following = self.questions[turn + 1]
        answered = [*self.history, {"role": "assistant", "content": text}]
        suffix = self.renderer.suffix_text(answered, [user_turn(following)])
        shown = chat_model_input(suffix, [following.image], self.renderer.tokenizer, self.image_token)
        self.history = [*answered, user_turn(following)]
        # the sampled tokens as sampled, never re-tokenised from `text`
        self.context = types.ModelInput(
            chunks=[*self.context.chunks, types.EncodedTextChunk(tokens=list(action)), *shown.chunks]
        )
        return StepResult(reward, False, next_observation=self.context, metrics=metrics)


@dataclass
class LookAndAnswerGroup:
    """The `n` episodes of one row: the same images and questions; no group reward."""

    messages: list[Message]
    questions: Sequence[ImageQuestion]
    renderer: ChatRenderer
    scorer: Scorer

    def make_envs(self, n: int) -> list[Env]:
        return [LookAndAnswerEnv(self.messages, self.questions, self.renderer, self.scorer) for _ in range(n)]

    def group_rewards(self, trajectories: Sequence[Trajectory]) -> list[float]:
        return [0.0] * len(trajectories)


@register_agent(LOOK_AND_ANSWER)
def look_and_answer(row: Mapping[str, Any], setup: AgentSetup) -> LookAndAnswerGroup:
    """A row's image questions: `extra_info` holds `seed`, `turns` (default 2), `kind` (`count` or `color`)
    and `size` (pixels, default 56); the row's prompt is the chat before the first image."""
    info = row.get("extra_info") or {}
    if not isinstance(info, Mapping) or "seed" not in info:
        raise DataError(f"{LOOK_AND_ANSWER}: extra_info.seed is missing (it draws the row's images)")
    questions = shapes_questions(
        int(info["seed"]),
        int(info.get("turns", 2)),
        str(info.get("kind", "count")),
        int(info.get("size", 56)),
    )
    return LookAndAnswerGroup(chat_messages(row), questions, setup.renderer(), setup.row_scorer(row))


def look_and_answer_rows(n: int, seed: int = 0, turns: int = 2, kind: str = "count") -> list[dict[str, Any]]:
    """`n` verl rows of this environment (write them with pyarrow to parquet or as JSON lines); the ground
    truth lists the answers for a reader (the environment scores each turn against its own drawing)."""
    rows = []
    for i in range(n):
        row_seed = seed * 1_000_003 + i
        answers = [q.answer for q in shapes_questions(row_seed, turns, kind)]
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "agent_name": LOOK_AND_ANSWER,
                "prompt": [{"role": "system", "content": INSTRUCTION}],
                "reward_model": {"style": "rule", "ground_truth": "|".join(answers)},
                "extra_info": {"index": i, "seed": row_seed, "turns": turns, "kind": kind},
            }
        )
    return rows
