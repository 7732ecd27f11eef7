"""The `http` backend: the explicit API against `posttrain serve` (tinker's wire protocol), with the local
clients' methods and return types, so one script runs on `local`, `ray` and `http` alike.

    service = ServiceClient(backend="http", base_url="http://127.0.0.1:8000", api_key="tml-...")
    training = service.create_lora_training_client("tiny", rank=8, seed=0)   # a model name the server serves

`api_key` defaults to TINKER_API_KEY, else POSTTRAIN_API_KEY; `base_url` to TINKER_BASE_URL. Verbs return
tinker futures at once (`.result()`, `await`, `.result_async()`). A training client sends its requests in
call order, each with the next seq_id of its model (the server runs a model's requests in seq_id order and
answers a repeated seq_id with its first delivery, so a retried `optim_step` is applied once); results are
long-polled, so `forward_backward` then `optim_step` pipeline as they do locally. Bodies and results use the
SDK's own codecs (protobuf for forward/backward and samples, JSON otherwise).

Differences from the local backends, all from the protocol: base models are named as the server lists them
(`get_server_capabilities`); `compute_logprobs` scores at temperature 1.0 only; `get_tokenizer` loads the
tokenizer the server names (its directory when on this machine, else from the Hugging Face hub).
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

from tinker import types
from tinker.lib.public_interfaces.api_future import AwaitableConcurrentFuture
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from posttrain.client.backend import ResolvedFuture
from posttrain.client.batching import check_request
from posttrain.client.custom_loss import CustomLoss, custom_output, linearise, probe_data
from posttrain.client.http_sampling import HttpSamplingClient, dump, load_tokenizer_named, resolved, then
from posttrain.client.http_transport import (
    ApiStatusError,
    Connection,
    HttpApiError,
    ModelSequence,
    RetryPolicy,
    Sender,
    Transport,
)
from posttrain.client.service import ServiceClient, check_lora_args

T = TypeVar("T")


class HttpServiceClient(ServiceClient):
    """`ServiceClient(backend="http", ...)` is one of these: the same methods, run by a server."""

    def __init__(
        self,
        backend: str = "http",
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 60.0,
        retry: RetryPolicy | None = None,
        heartbeat_s: float = 10.0,
        transport: Transport | None = None,
        **local_only: Any,
    ) -> None:
        """`timeout_s`: per HTTP request (result polls are long polls well within it); `retry`: how
        retryable failures are retried; `heartbeat_s`: the session heartbeat period (0: none);
        `transport`: what sends each HTTP request (default aiohttp; tests and proxies pass their own)."""
        if backend != "http":
            raise ValueError(f"HttpServiceClient is backend='http', not {backend!r}")
        given = sorted(k for k, v in local_only.items() if v not in (None, (), 1))
        if given:
            raise ValueError(
                f"{', '.join(given)}: settings of the local and ray backends; a server has its own "
                "(backend='http' takes base_url, api_key, timeout_s, retry, heartbeat_s, transport)"
            )
        base_url = base_url or os.environ.get("TINKER_BASE_URL")
        if not base_url:
            raise ValueError("backend='http' needs base_url=... or TINKER_BASE_URL (the server's address)")
        api_key = api_key or os.environ.get("TINKER_API_KEY") or os.environ.get("POSTTRAIN_API_KEY")
        if not api_key:
            raise ValueError("backend='http' needs api_key=... or TINKER_API_KEY / POSTTRAIN_API_KEY")
        self.base_models = []
        self.connection = Connection(
            base_url, api_key, timeout_s=timeout_s, retry=retry, heartbeat_s=heartbeat_s, transport=transport
        )
        self._model_seqs = itertools.count()  # model_seq_id: the server's model id is session:train:<it>
        self._sampler_seqs = itertools.count()  # sampling_session_seq_id

    def close(self) -> None:
        self.connection.close()

    def _next_model_seq(self) -> int:
        return next(self._model_seqs)

    def _next_sampler_seq(self) -> int:
        return next(self._sampler_seqs)

    # ---- training clients ----------------------------------------------------------------------
    def create_lora_training_client(  # type: ignore[override]
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        user_metadata: dict[str, str] | None = None,
    ) -> HttpTrainingClient:
        """A new LoRA adapter of `rank` on the served model `base_model` (B matrices zero)."""
        check_lora_args(rank, train_mlp, train_attn, train_unembed, "a server trains LoRA adapters")
        lora = types.LoraConfig(
            rank=rank, seed=seed, train_mlp=train_mlp, train_attn=train_attn, train_unembed=train_unembed
        )
        request = types.CreateModelRequest(
            session_id=self.connection.session_id,
            model_seq_id=self._next_model_seq(),
            base_model=base_model,
            lora_config=lora,
            user_metadata=user_metadata,
        )
        return self._new_model("/api/v1/create_model", dump(request), "create_model")

    def create_training_client(  # type: ignore[override]
        self, base_model: str, seed: int | None = None
    ) -> HttpTrainingClient:
        """Full fine-tuning, asked of the server (posttrain serve trains LoRA adapters only and says so)."""
        request = types.CreateModelRequest(
            session_id=self.connection.session_id, model_seq_id=self._next_model_seq(), base_model=base_model
        )
        return self._new_model("/api/v1/create_model", dump(request), "create_model")

    def create_training_client_from_state(self, path: str) -> HttpTrainingClient:  # type: ignore[override]
        """A new client with the weights of a saved state (a fresh optimizer)."""
        return self._from_state(path, optimizer=False)

    def create_training_client_from_state_with_optimizer(  # type: ignore[override]
        self, path: str
    ) -> HttpTrainingClient:
        """A new client with the weights and optimizer state of a saved state."""
        return self._from_state(path, optimizer=True)

    def _from_state(self, path: str, optimizer: bool) -> HttpTrainingClient:  # type: ignore[override]
        request = types.LoadWeightsRequest(
            session_id=self.connection.session_id,
            model_seq_id=self._next_model_seq(),
            path=path,
            optimizer=optimizer,
        )
        return self._new_model("/api/v1/load_weights", dump(request), "load_weights")

    def _new_model(self, endpoint: str, body: dict[str, Any], kind: str) -> HttpTrainingClient:
        """Create a model on the server and wait for it. Its id is the session's and the model_seq_id's,
        so a creation whose answer was lost (a 409 on the retry) is waited for by asking for its info."""
        model_id = f"{body['session_id']}:train:{body['model_seq_id']}"
        conn = self.connection

        async def create() -> types.GetInfoResponse:
            answer = await conn.post(endpoint, body, done_on_conflict=True)
            if answer is not None:
                await conn.result(answer["request_id"], kind)
                return await _info(conn, model_id)
            for _ in range(conn.retry.max_attempts * 10):  # the first attempt's creation is under way
                try:
                    return await _info(conn, model_id)
                except ApiStatusError as exc:
                    if exc.status != 404:
                        raise
                await asyncio.sleep(conn.retry.max_delay_s / 10)
            raise HttpApiError(f"{kind}: model {model_id} was not created", endpoint)

        info = conn.run(create())
        return HttpTrainingClient(self, model_id, info)

    # ---- sampling clients ----------------------------------------------------------------------
    def create_sampling_client(  # type: ignore[override]
        self, model_path: str | None = None, base_model: str | None = None
    ) -> HttpSamplingClient:
        """A sampler on saved sampler weights (`model_path`, a tinker:// path) or on a served base model."""
        if model_path is None and base_model is None:
            raise ValueError("Either model_path or base_model must be provided")
        request = types.CreateSamplingSessionRequest(
            session_id=self.connection.session_id,
            sampling_session_seq_id=self._next_sampler_seq(),
            base_model=None if model_path is not None else base_model,
            model_path=model_path,
        )
        conn = self.connection

        async def create() -> tuple[str, str]:
            answer = await conn.post("/api/v1/create_sampling_session", dump(request))
            assert answer is not None
            sampler_id = str(answer["sampling_session_id"])
            record = await conn.get(f"/api/v1/samplers/{sampler_id}")
            return sampler_id, str(record.get("base_model") or base_model or "")

        sampler_id, name = conn.run(create())
        return HttpSamplingClient(conn, resolved(sampler_id), name)

    # ---- capabilities --------------------------------------------------------------------------
    def get_server_capabilities(self) -> types.GetServerCapabilitiesResponse:
        """The base models the server serves (trainable and sampleable, with their context length)."""
        answer = self.connection.run(self.connection.get("/api/v1/get_server_capabilities"))
        return types.GetServerCapabilitiesResponse.model_validate(answer)


async def _info(conn: Connection, model_id: str) -> types.GetInfoResponse:
    answer = await conn.post("/api/v1/get_info", dump(types.GetInfoRequest(model_id=model_id)))
    return types.GetInfoResponse.model_validate(answer)


class HttpTrainingClient(ResolvedFuture):
    """tinker's training verbs on one model of the server (`model_id`, the server's id)."""

    def __init__(self, service: HttpServiceClient, model_id: str, info: types.GetInfoResponse) -> None:
        self._service = service
        self._conn = service.connection
        self.model_id = model_id
        self._info = info
        self._base_model = info.model_name or (info.model_data.model_name if info.model_data else None) or ""
        self._sequence = ModelSequence(self._conn, model_id)
        self._tokenizer: Any = None

    def _turn(self, run: Callable[[Sender], Awaitable[T]]) -> AwaitableConcurrentFuture[T]:
        return AwaitableConcurrentFuture(self._sequence.turn(run))

    # ---- forward / backward --------------------------------------------------------------------
    def _fb_body(
        self, data: list[types.Datum], loss_fn: str, config: Any, forward_only: bool
    ) -> Callable[[int], bytes]:
        def body(seq_id: int) -> bytes:
            request = types.ForwardBackwardRequest(
                forward_backward_input=types.ForwardBackwardInput(
                    data=data,
                    loss_fn=loss_fn,  # type: ignore[arg-type]  # posttrain names too (policy_loss)
                    loss_fn_config=config,
                ),
                model_id=self.model_id,
                seq_id=seq_id,
            )
            message = forward_backward_request_to_proto(request)
            message.forward_only = forward_only
            return bytes(message.SerializeToString())

        return body

    async def _fb(
        self, send: Sender, data: list[types.Datum], loss_fn: str, config: Any, forward_only: bool
    ) -> str:
        endpoint = "/api/v1/forward_backward"
        return await send(endpoint, self._fb_body(data, loss_fn, config, forward_only))

    async def _output(self, request_id: str, kind: str) -> types.ForwardBackwardOutput:
        return deserialize_forward_backward_output(await self._conn.result(request_id, kind, proto=True))

    def _run(
        self, data: Sequence[types.Datum], loss_fn: str, config: Mapping[str, Any] | None, forward_only: bool
    ) -> AwaitableConcurrentFuture[types.ForwardBackwardOutput]:
        check_request(data, loss_fn, config)  # a bad call fails here, as locally, and takes no seq_id
        data, config = list(data), dict(config) if config else None
        kind = "forward" if forward_only else "forward_backward"

        async def run(send: Sender) -> types.ForwardBackwardOutput:
            request_id = await self._fb(send, data, loss_fn, config, forward_only)
            send.release()
            return await self._output(request_id, kind)

        return self._turn(run)

    def forward(
        self, data: Sequence[types.Datum], loss_fn: str, loss_fn_config: Mapping[str, Any] | None = None
    ) -> AwaitableConcurrentFuture[types.ForwardBackwardOutput]:
        """Per-datum log-probs of the targets and the loss, without gradients."""
        return self._run(data, loss_fn, loss_fn_config, forward_only=True)

    def forward_backward(
        self, data: Sequence[types.Datum], loss_fn: str, loss_fn_config: Mapping[str, Any] | None = None
    ) -> AwaitableConcurrentFuture[types.ForwardBackwardOutput]:
        """As `forward`, and the loss's gradients accumulate on the server until the next `optim_step`."""
        return self._run(data, loss_fn, loss_fn_config, forward_only=False)

    def forward_backward_custom(
        self, data: Sequence[types.Datum], loss_fn: CustomLoss
    ) -> AwaitableConcurrentFuture[types.ForwardBackwardOutput]:
        """A loss of your own over the per-datum log-probs, as the local backends run it: a forward gives
        each datum's log-probs `lp_i`; `loss_fn(data, lps)` is differentiated here; a `cross_entropy`
        forward_backward with weights `-dloss/dlp_i` then puts dloss/dtheta into the server's gradients.
        Both requests are sent in this call's turn, so later calls come after them."""
        probe, data = probe_data(data), list(data)

        async def run(send: Sender) -> types.ForwardBackwardOutput:
            first = await self._output(await self._fb(send, probe, "cross_entropy", None, True), "forward")
            linear, value, metrics = await asyncio.to_thread(linearise, data, loss_fn, first)
            request_id = await self._fb(send, linear, "cross_entropy", None, False)
            send.release()
            return custom_output(await self._output(request_id, "forward_backward"), value, metrics)

        return self._turn(run)

    def optim_step(
        self, optim_params: types.AdamParams | None = None, *, adam_params: types.AdamParams | None = None
    ) -> AwaitableConcurrentFuture[types.OptimStepResponse]:
        """One AdamW step of this model with these settings, then the gradients are zeroed."""
        if optim_params is not None and adam_params is not None:
            raise ValueError("Specify optim_params or legacy adam_params, not both")
        params = optim_params if optim_params is not None else adam_params
        if not isinstance(params, types.AdamParams):
            raise TypeError("Expected AdamParams")

        def body(seq_id: int) -> dict[str, Any]:
            return dump(types.OptimStepRequest(optim_params=params, model_id=self.model_id, seq_id=seq_id))

        return self._json_turn("/api/v1/optim_step", body, "optim_step", types.OptimStepResponse)

    def _json_turn(
        self, endpoint: str, body: Callable[[int], dict[str, Any]], kind: str, cls: type[T]
    ) -> AwaitableConcurrentFuture[T]:
        async def run(send: Sender) -> T:
            request_id = await send(endpoint, body)
            send.release()
            answer = await self._conn.result(request_id, kind)
            return cls.model_validate(answer)  # type: ignore[attr-defined,no-any-return]

        return self._turn(run)

    # ---- state ---------------------------------------------------------------------------------
    def save_state(
        self, name: str, ttl_seconds: int | None = None, overwrite: bool = False
    ) -> AwaitableConcurrentFuture[types.SaveWeightsResponse]:
        """Weights and optimizer state under `tinker://<model>/weights/<name>` on the server; a name saved
        before is an error unless `overwrite`."""

        def body(seq_id: int) -> dict[str, Any]:
            request = types.SaveWeightsRequest(
                model_id=self.model_id, path=name, seq_id=seq_id, ttl_seconds=ttl_seconds, overwrite=overwrite
            )
            return dump(request)

        return self._json_turn("/api/v1/save_weights", body, "save_weights", types.SaveWeightsResponse)

    def load_state(self, path: str) -> AwaitableConcurrentFuture[types.LoadWeightsResponse]:
        """The weights of a saved state (the optimizer keeps its own)."""
        return self._load(path, optimizer=False)

    def load_state_with_optimizer(self, path: str) -> AwaitableConcurrentFuture[types.LoadWeightsResponse]:
        """The weights and optimizer state of a saved state."""
        return self._load(path, optimizer=True)

    def _load(self, path: str, optimizer: bool) -> AwaitableConcurrentFuture[types.LoadWeightsResponse]:
        def body(seq_id: int) -> dict[str, Any]:
            return dump(
                types.LoadWeightsRequest(
                    model_id=self.model_id, seq_id=seq_id, path=path, optimizer=optimizer
                )
            )

        return self._json_turn("/api/v1/load_weights", body, "load_weights", types.LoadWeightsResponse)

    # ---- samplers ------------------------------------------------------------------------------
    def save_weights_for_sampler(
        self, name: str, ttl_seconds: int | None = None
    ) -> AwaitableConcurrentFuture[types.SaveWeightsForSamplerResponse]:
        """The current weights as a sampler checkpoint `tinker://<model>/sampler_weights/<name>`."""

        def body(seq_id: int) -> dict[str, Any]:
            request = types.SaveWeightsForSamplerRequest(
                model_id=self.model_id, path=name, seq_id=seq_id, ttl_seconds=ttl_seconds
            )
            return dump(request)

        return self._json_turn(
            "/api/v1/save_weights_for_sampler",
            body,
            "save_weights_for_sampler",
            types.SaveWeightsForSamplerResponse,
        )

    def save_weights_and_get_sampling_client(self, name: str | None = None) -> HttpSamplingClient:
        """A sampler with the current weights (a snapshot on the server; later training does not change
        it). Returned at once; its calls wait for the snapshot, which comes after the calls before it."""
        sampler_seq = self._service._next_sampler_seq()

        def body(seq_id: int) -> dict[str, Any]:
            request = types.SaveWeightsForSamplerRequest(
                model_id=self.model_id, seq_id=seq_id, sampling_session_seq_id=sampler_seq
            )
            return dump(request)

        saved = self._json_turn(
            "/api/v1/save_weights_for_sampler", body, "save_weights_for_sampler",
            types.SaveWeightsForSamplerResponseInternal,
        )  # fmt: skip
        sampler_id = then(saved.future(), lambda r: str(r.sampling_session_id))
        return HttpSamplingClient(self._conn, sampler_id, self._base_model, self._tokenizer_id())

    def create_sampling_client(self, model_path: str) -> HttpSamplingClient:
        return self._service.create_sampling_client(model_path=model_path)

    # ---- info ----------------------------------------------------------------------------------
    def get_info(self) -> types.GetInfoResponse:
        return self._conn.run(_info(self._conn, self.model_id))

    def _tokenizer_id(self) -> str:
        data = self._info.model_data
        return (data.tokenizer_id if data else None) or self._base_model

    def get_tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer_named(self._tokenizer_id())
        return self._tokenizer
