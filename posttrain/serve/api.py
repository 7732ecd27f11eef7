"""What every endpoint of `posttrain serve` does the same way: the tenant of the key, the body as the SDK's
request model, the request id handed out, and a training model's requests run in seq_id order."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import pydantic
from fastapi import HTTPException, Request
from starlette.concurrency import run_in_threadpool
from tinker import types

from posttrain.client.model_inputs import ModelInputReader
from posttrain.client.training import TrainingClient
from posttrain.serve.adapters import TrainingModel
from posttrain.serve.futures import Encoder
from posttrain.serve.schema import Bodies
from posttrain.serve.state import ServerState

MAX_SEQ_ID = 2**62  # seq_ids are journaled as SQLite integers


def as_json(model: Any) -> dict[str, Any]:
    return model.model_dump(mode="json", exclude_none=True)


@functools.lru_cache(maxsize=16)
def _reader(base_dir: str) -> ModelInputReader:
    """One reader per served model, so its image processor is loaded once."""
    return ModelInputReader(base_dir)


def _unsized_image(model_input: Any) -> bool:
    return any(isinstance(c, types.ImageChunk) and c.expected_tokens is None for c in model_input.chunks)


class Api:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.bodies = Bodies()

    async def tenant(self, request: Request) -> str:
        """The key's tenant (401 otherwise), admitted by its request rate (polling is never limited)."""
        tenant = self.state.keys.tenant(request.headers.get("x-api-key"))
        if request.url.path != "/api/v1/retrieve_future":  # polling is how results arrive: never limited
            self.state.meter.admit(tenant)
        return tenant

    async def body(self, request: Request, model: type[pydantic.BaseModel]) -> Any:
        try:
            return model.model_validate_json(await request.body())
        except pydantic.ValidationError as exc:
            raise HTTPException(400, f"{model.__name__}: {exc.errors(include_url=False)}") from None

    @staticmethod
    def length(model_input: Any) -> int:
        """Tokens in a ModelInput (400 when it cannot say: an image chunk without expected_tokens)."""
        try:
            return int(model_input.length)
        except ValueError as exc:
            raise HTTPException(400, f"model_input: {exc}") from None

    def base_dir(self, base_name: str) -> str:
        """The directory of a model's or sampler's base model (the first served one for a name it lacks: a
        model loaded from a checkpoint whose base is not found by name)."""
        return self.state.served.get(base_name) or next(iter(self.state.served.values()))

    async def input_tokens(self, inputs: Mapping[str, Any], base_dir: str) -> int:
        """Tokens in these ModelInputs (keyed by the name errors give them). An image chunk without
        expected_tokens (tinker calls it advisory, and its SDK sends none unless told) counts the tokens its
        size gives for the model in `base_dir`, read from the image's header in a worker thread, off the
        event loop; an input that cannot be counted is a 400 naming it."""
        if not any(_unsized_image(m) for m in inputs.values()):
            return sum(self.length(m) for m in inputs.values())
        reader = _reader(base_dir)
        try:
            return await run_in_threadpool(lambda: sum(reader.length(m, k) for k, m in inputs.items()))
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None

    def tokens(self, tenant: str, tokens: int) -> None:
        """A request's tokens against tokens_per_request (413) and the tenant's tokens_per_second (429)."""
        self.state.limits.check_tokens(tokens)
        self.state.meter.admit_tokens(tenant, tokens)

    def submitted(
        self, tenant: str, kind: str, future: Any, encode: Encoder, model_id: str | None = None, **extra: Any
    ) -> dict[str, Any]:
        self.state.limits.check_queued(self.state.queued(tenant))
        request_id = self.state.futures.add(tenant, kind, future, encode, model_id)
        return {"request_id": request_id, **({"model_id": model_id} if model_id else {}), **extra}

    def in_order(
        self,
        model: TrainingModel,
        seq_id: int | None,
        tenant: str,
        kind: str,
        start: Callable[[TrainingClient], Any],
        encode: Encoder,
    ) -> dict[str, Any]:
        """Run `start(client)` in the model's seq_id order, once its adapter is loaded; a seq_id seen
        before returns its first request id (a retry is applied once)."""
        if seq_id is None:
            raise HTTPException(400, f"{kind} needs a seq_id")
        if not 0 <= seq_id < MAX_SEQ_ID:
            raise HTTPException(400, f"seq_id {seq_id} is outside 0..2**62")
        state, model_id = self.state, model.model_id
        earlier = state.sequencer.seen(model_id, seq_id)
        if earlier is not None:
            return {"request_id": earlier, "model_id": model_id}
        state.adapters.check_slot(model)
        state.limits.check_queued(state.queued(tenant))
        # journaled (request and seq_id) before the work starts, not beside it (FutureStore.open)
        request = state.futures.open(tenant, kind, model_id)
        state.sequencer.remember(model_id, seq_id, request.request_id)
        future = state.sequencer.submit(model_id, seq_id, lambda: state.adapters.run(model, start))
        state.futures.attach(request, future, encode)
        return {"request_id": request.request_id, "model_id": model_id}
