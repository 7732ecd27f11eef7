"""The `http` backend's `SamplingClient`: samples and prompt log-probs from a sampler of the server, with the
local client's methods and return types (see posttrain/client/http.py), and the helpers both modules use."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from tinker import types
from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture
from tinker.proto.response_conv import deserialize_sample_response
from tinker.types._pydantic_types.tensor_data import TensorData as TensorDataModel

from posttrain.client.backend import ResolvedFuture
from posttrain.client.http_transport import Connection
from posttrain.client.model_inputs import declared_length
from posttrain.client.prompt_scores import prompt_options
from posttrain.client.sampling import check_sample_options

T = TypeVar("T")


def dump(model: Any) -> dict[str, Any]:
    """A request model as the SDK sends it: JSON, unset optional fields left out."""
    return dict(model.model_dump(mode="json", exclude_none=True))


def load_tokenizer_named(tokenizer_id: str) -> Any:
    """The tokenizer a server names: its directory when it exists here, else a Hugging Face hub id."""
    if Path(tokenizer_id).is_dir():
        from posttrain.models import load_tokenizer

        return load_tokenizer(tokenizer_id)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_id)


def resolved(value: T) -> concurrent.futures.Future[T]:
    future: concurrent.futures.Future[T] = concurrent.futures.Future()
    future.set_result(value)
    return future


def then(future: concurrent.futures.Future[Any], fn: Callable[[Any], T]) -> concurrent.futures.Future[T]:
    """A concurrent future of `fn(result)` of `future` (its exception passed on)."""
    out: concurrent.futures.Future[T] = concurrent.futures.Future()

    def copy(done: concurrent.futures.Future[Any]) -> None:
        try:
            out.set_result(fn(done.result()))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on `out`
            out.set_exception(exc)

    future.add_done_callback(copy)
    return out


class HttpSamplingClient(ResolvedFuture):
    """Samples and prompt log-probs from one sampler of the server (a snapshot of weights). `sampler_id`
    may still be on its way (a snapshot after the training calls before it): calls wait for it."""

    def __init__(
        self,
        conn: Connection,
        sampler_id: concurrent.futures.Future[str],
        base_model: str,
        tokenizer_id: str | None = None,
    ) -> None:
        self._conn = conn
        self._sampler_id = sampler_id
        self._base_model = base_model
        self._tokenizer_id = tokenizer_id or base_model
        self._seq = itertools.count()
        self._tokenizer: Any = None

    @property
    def sampler_id(self) -> str:
        return self._sampler_id.result()

    def get_base_model(self) -> str:
        return self._base_model

    def get_tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer_named(self._tokenizer_id)
        return self._tokenizer

    def sample(
        self,
        prompt: types.ModelInput,
        num_samples: int,
        sampling_params: types.SamplingParams,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
        target_prompt_logprobs: types.TensorData | None = None,
        prompt_alt_tokens_k: int = 0,
        prompt_logprobs_last_n: int | None = None,
    ) -> AwaitableConcurrentFuture[types.SampleResponse]:
        """`num_samples` responses to `prompt`, as the local `sample` (tinker 0.38's signature, its prompt-side
        options included; `topk_sample_logprobs` is a ValueError here too)."""
        check_sample_options(num_samples, topk_sample_logprobs)
        length = declared_length(prompt, "prompt")
        if length == 0:  # None: an image of undeclared size, not empty
            raise ValueError("the prompt is empty")
        if length is not None:  # else the server checks them against the prompt it reads
            prompt_options(
                length, include_prompt_logprobs, topk_prompt_logprobs, target_prompt_logprobs,
                prompt_alt_tokens_k, prompt_logprobs_last_n,
            )  # fmt: skip
        conn, seq_id = self._conn, next(self._seq)

        async def run() -> types.SampleResponse:
            request = types.SampleRequest(
                num_samples=num_samples,
                prompt=prompt,
                sampling_params=sampling_params,
                sampling_session_id=await asyncio.wrap_future(self._sampler_id),  # type: ignore[arg-type]
                seq_id=seq_id,
                prompt_logprobs=include_prompt_logprobs or None,
                topk_prompt_logprobs=topk_prompt_logprobs,
                target_prompt_logprobs=_as_model(target_prompt_logprobs),
                prompt_alt_tokens_k=prompt_alt_tokens_k,
                prompt_logprobs_last_n=prompt_logprobs_last_n,
            )
            answer = await conn.post("/api/v1/asample", dump(request))
            assert answer is not None
            request_id = str(answer["request_id"])
            response = deserialize_sample_response(await conn.result(request_id, "asample", proto=True))
            ids = answer.get("sample_sequence_ids") or [f"{request_id}:{i}" for i in range(num_samples)]
            sequences = [
                dataclasses.replace(s, sequence_id=i) for s, i in zip(response.sequences, ids, strict=True)
            ]
            return dataclasses.replace(response, sequences=sequences)

        return AwaitableConcurrentFuture(conn.submit(run()))

    def compute_logprobs(
        self, prompt: types.ModelInput, temperature: float = 1.0
    ) -> AwaitableConcurrentFuture[list[float | None]]:
        """log p(token i | tokens < i) of every prompt token (None at position 0). The protocol scores
        prompts at temperature 1.0 only: another temperature is a ValueError here (the local backends
        take it)."""
        if temperature != 1.0:
            raise ValueError(
                f"temperature={temperature}: over http prompt log-probs are at temperature 1.0 only "
                "(tinker's protocol has no temperature for them); use a local or ray backend for another"
            )
        response = self.sample(prompt, 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True)
        return AwaitableConcurrentFuture(then(response.future(), lambda r: list(r.prompt_logprobs or [])))


def _as_model(data: types.TensorData | None) -> TensorDataModel | None:
    """A TensorData as the request's JSON model, its layout (dense or sparse CSR) kept."""
    if data is None:
        return None
    return TensorDataModel(
        data=data.data, dtype=data.dtype, shape=data.shape,
        sparse_crow_indices=data.sparse_crow_indices, sparse_col_indices=data.sparse_col_indices,
    )  # fmt: skip
