"""Token samplers the agent loop runs on: the explicit API's `SamplingClient` (local, Ray or HTTP backend)
and a rollout engine in this process (its async API). Each takes an observation as the environment gave it, images included (`types.Observation`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import Any

from tinker import types

from posttrain.agents.observations import ObservationReader
from posttrain.agents.types import Completion, Observation
from posttrain.client.model_inputs import InputRow
from posttrain.rollout.base import GenerationRequest, SamplingParams


def client_model_input(observation: Observation, takes_rows: bool = False) -> types.ModelInput | InputRow:
    """The observation as a SamplingClient's prompt. Its images go as they came (ImageChunks, processed by
    the backend); an InputRow's already processed pixels go only to a client that `takes_rows` (the RL
    trainer's `BatchedSamplingClient`), elsewhere they are an error."""
    if isinstance(observation, types.ModelInput):
        return observation
    if isinstance(observation, InputRow):
        if takes_rows:
            return observation
        if observation.images:
            raise ValueError(
                "an InputRow observation with images cannot be sent to a SamplingClient (it takes images as "
                "png/jpeg ImageChunks in a ModelInput, agents.observations.chat_model_input); the RL trainer's "
                "sampler takes it"
            )
        return types.ModelInput.from_ints(observation.tokens)
    return types.ModelInput.from_ints(list(observation))


@dataclass
class ClientSampler:
    """Samples through a `SamplingClient`. Its `sample` calls that wait together are generated as one batch
    by the backend, so concurrent episodes share generation passes."""

    client: Any  # posttrain.client.SamplingClient or tinker.SamplingClient
    params: types.SamplingParams  # temperature, top_p, ...; max_tokens and stop are set per action

    async def sample(self, prompt: Observation, max_tokens: int, stop: list[int]) -> Completion:
        params = self.params.model_copy(update={"max_tokens": max_tokens, "stop": stop or None})
        takes_rows = bool(getattr(self.client, "accepts_input_rows", False))
        future = self.client.sample(client_model_input(prompt, takes_rows), 1, params)
        response = await future.result_async() if hasattr(future, "result_async") else await future
        sequence = response.sequences[0]
        return Completion(
            list(sequence.tokens), [float(x) for x in sequence.logprobs or []], sequence.stop_reason
        )


@dataclass
class EngineSampler:
    """Samples on a rollout engine of this process through its async API (`agenerate`, `submit`); `reader`
    reads observations with images (give the loop the same one, so each image is processed once)."""

    engine: Any  # posttrain.rollout.native.NativeRolloutEngine
    params: SamplingParams
    reader: ObservationReader = field(default_factory=ObservationReader)

    async def sample(self, prompt: Observation, max_tokens: int, stop: list[int]) -> Completion:
        sampling = replace(self.params, max_tokens=max_tokens, stop_token_ids=tuple(stop))
        row = self.reader.row(prompt)
        future = self.engine.submit(GenerationRequest(list(row.tokens), sampling, images=row.images or None))
        result = await asyncio.wrap_future(future)
        if result.error is not None:
            raise ValueError(f"sampling failed: {result.error}")
        return Completion(list(result.token_ids), list(result.log_probs), result.stop_reason)
