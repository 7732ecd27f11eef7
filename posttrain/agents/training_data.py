"""Trajectories as training sequences: the sampled ids exactly, a mask that trains only the model's tokens.

A trajectory's turns are merged into one sequence while each observation extends the previous
observation plus the action taken (a chat that grows turn by turn is one sequence); an observation that
does not (an environment that summarises its context) starts a new sequence. In every sequence, the
model's own tokens (actions) have mask 1 and their sampler log-probs; the first observation (the prompt)
and every later observation (tool results, the chat template's turn headers) have mask 0: they are
context, never trained as if the model wrote them.

Images shown in observations travel with their sequence: their image tokens sit in the observation's
tokens (mask 0: never trained), and the sequence's images, in order, are its row's `multi_modal_inputs`, so
the trainer's pass sees the tokens and the images that were sampled. An observation extends the sequence
only if its images start with the sequence's images too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tinker import types

from posttrain.agents.observations import is_prefix
from posttrain.agents.types import Trajectory
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.data.mm_dataset import MULTI_MODAL_INPUTS


@dataclass
class TokenSequence:
    tokens: list[int]
    prompt_length: int  # tokens before the first action
    mask: list[float] = field(default_factory=list)  # 1: sampled by the model; 0: prompt or observation
    logprobs: list[float] = field(default_factory=list)  # the sampler's, 0 where mask is 0
    images: dict[str, torch.Tensor] = field(
        default_factory=dict
    )  # the sequence's images, in order ({}: none)


def trajectory_sequences(trajectory: Trajectory) -> list[TokenSequence]:
    """The trajectory as sequences of token ids (see the module docstring)."""
    sequences: list[TokenSequence] = []
    current: TokenSequence | None = None
    for transition in trajectory.transitions:
        ob = transition.observation
        if (
            current is not None
            and ob[: len(current.tokens)] == current.tokens
            and is_prefix(current.images, transition.images)
        ):
            extra = ob[len(current.tokens) :]
            current.tokens += extra
            current.mask += [0.0] * len(extra)
            current.logprobs += [0.0] * len(extra)
            current.images = transition.images
        else:
            if current is not None:
                sequences.append(current)
            current = TokenSequence(list(ob), len(ob), [0.0] * len(ob), [0.0] * len(ob), transition.images)
        action = transition.action
        if len(action.logprobs) != len(action.tokens):
            raise ValueError(f"an action of {len(action.tokens)} tokens has {len(action.logprobs)} log-probs")
        current.tokens += action.tokens
        current.mask += [1.0] * len(action.tokens)
        current.logprobs += list(action.logprobs)
    if current is not None:
        sequences.append(current)
    return sequences


def sequence_datum(sequence: TokenSequence, advantage: float) -> types.Datum:
    """An explicit-API datum for the `importance_sampling`/`ppo` losses: input tokens[:-1], targets
    tokens[1:], the sampler's log-probs, and the advantage on the model's tokens only (0 on the rest, so
    neither the loss nor its gradient sees them). A sequence with images is refused: its pixels are already
    processed, and the explicit API takes images as ImageChunks (the RL trainer trains such sequences)."""
    if sequence.images:
        raise ValueError(
            "sequence_datum: the sequence has images; a Datum takes them as ImageChunks in its model_input, "
            "build it from the observations' ModelInputs"
        )
    tokens, mask = sequence.tokens, sequence.mask[1:]
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": sequence.logprobs[1:],
            "advantages": [advantage * m for m in mask],
        },
    )


def sequences_batch(sequences: list[TokenSequence], pad_id: int, images: bool | None = None) -> Batch:
    """The RL trainer's layout: left-padded prompts, right-padded responses, `response_mask` 1 on the
    model's tokens only, the sampler's log-probs as `rollout_log_probs`; with `images` (None: when a sequence
    has some) each row's images in the column `multi_modal_inputs` ({} for a row without)."""
    prompt_width = max(s.prompt_length for s in sequences)
    response_width = max(len(s.tokens) - s.prompt_length for s in sequences)
    rows = len(sequences)
    prompts = torch.full((rows, prompt_width), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((rows, prompt_width), dtype=torch.long)
    responses = torch.full((rows, response_width), pad_id, dtype=torch.long)
    attention = torch.zeros((rows, response_width), dtype=torch.long)
    response_mask = torch.zeros((rows, response_width), dtype=torch.float32)
    logprobs = torch.zeros((rows, response_width), dtype=torch.float32)
    for i, s in enumerate(sequences):
        p, r = s.prompt_length, len(s.tokens) - s.prompt_length
        prompts[i, prompt_width - p :] = torch.tensor(s.tokens[:p])
        prompt_mask[i, prompt_width - p :] = 1
        responses[i, :r] = torch.tensor(s.tokens[p:])
        attention[i, :r] = 1
        response_mask[i, :r] = torch.tensor(s.mask[p:])
        logprobs[i, :r] = torch.tensor(s.logprobs[p:])
    attention_mask = torch.cat([prompt_mask, attention], dim=1)
    with_images = any(s.images for s in sequences) if images is None else images
    return Batch.from_dict(
        {
            keys.PROMPTS: prompts,
            keys.RESPONSES: responses,
            keys.RESPONSE_MASK: response_mask,
            keys.ROLLOUT_LOG_PROBS: logprobs,
            keys.INPUT_IDS: torch.cat([prompts, responses], dim=1),
            keys.ATTENTION_MASK: attention_mask,
            keys.POSITION_IDS: (attention_mask.cumsum(-1) - 1).clamp(min=0),
        },
        {MULTI_MODAL_INPUTS: [s.images for s in sequences]} if with_images else None,
    )
