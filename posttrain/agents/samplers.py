"""Token samplers the agent loop runs on: the explicit API's `SamplingClient` (local, Ray or HTTP backend,
and the RL trainer's) and a rollout engine in this process (its async API)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Any

from tinker import types

from posttrain.agents.types import Completion
from posttrain.rollout.base import GenerationRequest, SamplingParams


@dataclass
class ClientSampler:
    """Samples through a `SamplingClient`. Its `sample` calls that wait together are generated as one batch
    by the backend, so concurrent episodes share generation passes."""

    client: Any  # posttrain.client.SamplingClient or tinker.SamplingClient
    params: types.SamplingParams  # temperature, top_p, ...; max_tokens and stop are set per action

    async def sample(self, prompt: list[int], max_tokens: int, stop: list[int]) -> Completion:
        params = self.params.model_copy(update={"max_tokens": max_tokens, "stop": stop or None})
        future = self.client.sample(types.ModelInput.from_ints(prompt), 1, params)
        response = await future.result_async() if hasattr(future, "result_async") else await future
        sequence = response.sequences[0]
        return Completion(
            list(sequence.tokens), [float(x) for x in sequence.logprobs or []], sequence.stop_reason
        )


@dataclass
class EngineSampler:
    """Samples on a rollout engine of this process through its async API (`agenerate`, `submit`)."""

    engine: Any  # posttrain.rollout.native.NativeRolloutEngine
    params: SamplingParams

    async def sample(self, prompt: list[int], max_tokens: int, stop: list[int]) -> Completion:
        sampling = replace(self.params, max_tokens=max_tokens, stop_token_ids=tuple(stop))
        future = self.engine.submit(GenerationRequest(list(prompt), sampling))
        result = await asyncio.wrap_future(future)
        if result.error is not None:
            raise ValueError(f"sampling failed: {result.error}")
        return Completion(list(result.token_ids), list(result.log_probs), result.stop_reason)
