"""A token sampler that generates the actions waiting together as one batch (a wave).

The RL trainer's rollout group generates a whole Batch per call; the agent loop asks for one action at a
time, from many concurrent episodes. `WaveSampler` queues each request, lets the event loop settle (the
episodes whose environment step is instant come back with their next request), then generates everything
queued in one call, in a thread so that episodes waiting for tools keep running. Episodes still in a tool
call join a later wave: a slow tool delays only its own episode.

One wave is sampled with its largest token budget; a request with a smaller budget keeps the first
`max_tokens` tokens of its completion, which is exactly a sample with that budget (generation is
autoregressive, so a prefix does not depend on how long sampling would have gone on), and is marked
`length` when cut.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from posttrain.agents.types import Completion

# (prompts, max_tokens, stop token ids) -> one completion per prompt; blocking (it runs in a thread)
GenerateFn = Callable[[list[list[int]], int, list[int]], list[Completion]]


@dataclass
class _Request:
    prompt: list[int]
    max_tokens: int
    stop: tuple[int, ...]
    future: asyncio.Future[Completion]


@dataclass
class WaveSampler:
    """`TokenSampler` over a batch generator (see the module docstring); `waves` counts generate calls."""

    generate: GenerateFn
    settle_s: float = 0.002  # how long a wave waits for requests that are about to arrive
    waves: int = 0
    requests: int = 0
    _pending: list[_Request] = field(default_factory=list)
    _drainer: asyncio.Task[None] | None = None

    async def sample(self, prompt: list[int], max_tokens: int, stop: list[int]) -> Completion:
        future: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        self._pending.append(_Request(list(prompt), max_tokens, tuple(stop), future))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.ensure_future(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._pending:
            await asyncio.sleep(self.settle_s)
            wave, self._pending = self._pending, []
            by_stop: dict[tuple[int, ...], list[_Request]] = {}
            for request in wave:
                by_stop.setdefault(request.stop, []).append(request)
            for stop, requests in by_stop.items():
                await self._generate(requests, stop)

    async def _generate(self, requests: list[_Request], stop: tuple[int, ...]) -> None:
        budget = max(r.max_tokens for r in requests)
        self.waves += 1
        self.requests += len(requests)
        try:
            completions = await asyncio.to_thread(
                self.generate, [r.prompt for r in requests], budget, list(stop)
            )
            if len(completions) != len(requests):
                raise RuntimeError(
                    f"the generator returned {len(completions)} completions for {len(requests)}"
                )
        except BaseException as exc:
            for r in requests:
                if not r.future.done():
                    r.future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for r, c in zip(requests, completions, strict=True):
            if not r.future.done():
                r.future.set_result(_truncated(c, r.max_tokens))


def _truncated(completion: Completion, max_tokens: int) -> Completion:
    if len(completion.tokens) <= max_tokens:
        return completion
    return Completion(completion.tokens[:max_tokens], completion.logprobs[:max_tokens], "length")
