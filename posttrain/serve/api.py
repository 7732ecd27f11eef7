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

from posttrain.client.model_inputs import ModelInputReader, check_expected_tokens
from posttrain.client.training import TrainingClient
from posttrain.serve.adapters import TrainingModel
from posttrain.serve.futures import Encoder, in_thread
from posttrain.serve.schema import Bodies
from posttrain.serve.state import ServerState

MAX_SEQ_ID = 2**62  # seq_ids are journaled as SQLite integers
RETRIED_STATUSES = (408, 409, 429)  # what the SDK sends again, with the same seq_id (besides 5xx)


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

    async def raw_body(self, request: Request) -> bytes:
        """The request's body, at most `max_request_bytes` (413 otherwise): refused by its declared length
        before anything is read, or as soon as the bytes read pass the limit (a chunked body declares none)."""
        limits = self.state.limits
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit():
            limits.check_body_size(int(declared))
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            limits.check_body_size(size)
            chunks.append(chunk)
        return b"".join(chunks)

    async def body(self, request: Request, model: type[pydantic.BaseModel]) -> Any:
        try:
            return model.model_validate_json(await self.raw_body(request))
        except pydantic.ValidationError as exc:
            raise HTTPException(400, f"{model.__name__}: {exc.errors(include_url=False)}") from None

    @staticmethod
    def length(model_input: Any, what: str = "model_input") -> int:
        """Tokens in a ModelInput (400 when it cannot say: an image chunk without expected_tokens, or with a
        negative count)."""
        try:
            for j, chunk in enumerate(model_input.chunks):
                if isinstance(chunk, types.ImageChunk):
                    check_expected_tokens(chunk, f"{what}: chunk {j}")
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
            return sum(self.length(m, k) for k, m in inputs.items())
        reader = _reader(base_dir)
        try:
            return await run_in_threadpool(lambda: sum(reader.length(m, k) for k, m in inputs.items()))
        except ValueError as exc:
            raise HTTPException(400, str(exc)) from None

    def tokens(self, tenant: str, tokens: int) -> None:
        """A request's tokens against tokens_per_request (413) and the tenant's tokens_per_second (429)."""
        self.state.limits.check_tokens(tokens)
        self.state.meter.admit_tokens(tenant, tokens)

    def created(
        self, tenant: str, kind: str, model_id: str, create: Callable[[], Any], encode: Encoder
    ) -> dict[str, Any]:
        """Create training model `model_id` (`create` runs on a thread of its own), once: every check that can
        refuse (the tenant's queue, the adapter slots) runs before anything is held or started, so a refused
        request leaves nothing behind; a repeat of an accepted one (the SDK retries a lost answer with the same
        session and model_seq_id) gets the first one's request id, as a retried seq_id does."""
        state = self.state
        earlier = state.creations.get(model_id)
        if earlier is not None and earlier[0] == tenant:
            return {"request_id": earlier[1], "model_id": model_id}
        state.limits.check_queued(state.queued(tenant))
        state.hold_slot(model_id, tenant)
        request = state.futures.open(tenant, kind, model_id)  # journaled before the work starts
        state.creations[model_id] = (tenant, request.request_id)
        state.futures.attach(request, in_thread(create), encode)
        return {"request_id": request.request_id, "model_id": model_id}

    def repeat(self, model: TrainingModel, seq_id: int | None, kind: str) -> dict[str, Any] | None:
        """The answer to a seq_id the model has seen (a retry: its first request id), else None; a missing or
        out-of-range seq_id is a 400. Checked before anything is charged, so a retry costs no tokens."""
        if seq_id is None:
            raise HTTPException(400, f"{kind} needs a seq_id")
        earlier = self.seen(model.model_id, seq_id)
        return None if earlier is None else {"request_id": earlier, "model_id": model.model_id}

    def seen(self, key: str, seq_id: int) -> str | None:
        """The request id a training model's or sampling session's `seq_id` was first given (None: new); an
        out-of-range seq_id is a 400."""
        if not 0 <= seq_id < MAX_SEQ_ID:
            raise HTTPException(400, f"seq_id {seq_id} is outside 0..2**62")
        return self.state.sequencer.seen(key, seq_id)

    def refused_in_order(
        self, model: TrainingModel, seq_id: int | None, tenant: str, kind: str, refusal: HTTPException
    ) -> HTTPException:
        """The refusal to raise for a training request whose seq_id the client has already spent: the SDK
        takes a seq_id before sending and never sends it again after a 4xx it does not retry, so the seq_id
        is consumed here (journaled, its answer the refusal) and the model's later requests are not parked
        behind it forever. A refusal the SDK retries with the same seq_id (408, 409, 429) consumes nothing."""
        if refusal.status_code in RETRIED_STATUSES or seq_id is None or self.seen(model.model_id, seq_id):
            return refusal
        state, model_id = self.state, model.model_id
        request = state.futures.open(tenant, kind, model_id)
        state.sequencer.remember(model_id, seq_id, request.request_id)

        def refuse() -> Any:
            raise ValueError(f"{kind} refused ({refusal.status_code}): {refusal.detail}")

        state.futures.attach(request, state.sequencer.submit(model_id, seq_id, refuse), as_json)
        return refusal

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
        earlier = self.repeat(model, seq_id, kind)
        if earlier is not None:
            return earlier
        assert seq_id is not None
        state, model_id = self.state, model.model_id
        state.adapters.check_slot(model)
        if not state.sequencer.is_next(model_id, seq_id):  # the one it waits for is never refused: it
            state.limits.check_queued(state.queued(tenant))  # would leave the parked ones waiting forever
        # journaled (request and seq_id) before the work starts, not beside it (FutureStore.open)
        request = state.futures.open(tenant, kind, model_id)
        state.sequencer.remember(model_id, seq_id, request.request_id)
        future = state.sequencer.submit(model_id, seq_id, lambda: state.adapters.run(model, start))
        state.futures.attach(request, future, encode)
        return {"request_id": request.request_id, "model_id": model_id}
