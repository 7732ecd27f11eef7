"""`posttrain serve`: the explicit API over HTTP, speaking tinker's wire protocol (SDK 0.38).

The official `tinker` SDK works against this server with only `TINKER_BASE_URL` and `TINKER_API_KEY` set.
Behind it is one `posttrain.client.ServiceClient` (its `local` or `ray` backend): every tenant's LoRA
adapter sits on the one served base model, and the calls of all tenants run through the backend's ordered
queue. The server is a protocol adapter: it authenticates (`X-API-Key` -> tenant), checks ownership of
every id and path a request names, runs each training model's requests in `seq_id` order (a retry is
applied once), and hands out request ids whose results the SDK fetches from `retrieve_future` by long
polling (protobuf for forward/backward and sample results, JSON otherwise).

Endpoints the protocol has and this server does not implement (billing, telemetry, external weight copies,
custom-loss graphs, session search...) answer 501 naming the endpoint.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pydantic
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from tinker import types

from posttrain.client import ServiceClient
from posttrain.client.sampling import SamplingClient
from posttrain.client.training import TrainingClient
from posttrain.serve.futures import FutureStore, Sequencer, UnknownRequest, failed, in_thread, resolved
from posttrain.serve.limits import Limits, Meter
from posttrain.serve.tenants import ApiKeys
from posttrain.serve.wire import (
    WireError,
    decode_forward_backward,
    encode_forward_backward_output,
    encode_sample_response,
)

log = logging.getLogger("posttrain.serve")
PROTO = "application/x-protobuf"


@dataclass
class TrainingModel:
    tenant: str
    client: TrainingClient
    base_name: str


@dataclass
class Sampler:
    tenant: str
    client: SamplingClient
    base_name: str
    model_path: str | None = None


@dataclass
class ServerState:
    """What the server knows beyond the backend: who owns what, by the ids the SDK uses."""

    service: ServiceClient
    keys: ApiKeys
    served: dict[str, str]  # base model name -> model directory
    poll_timeout_s: float = 20.0
    limits: Limits = field(default_factory=Limits)
    meter: Meter = field(init=False)
    futures: FutureStore = field(default_factory=lambda: FutureStore(uuid.uuid4().hex[:8]))
    sequencer: Sequencer = field(default_factory=Sequencer)
    sessions: dict[str, str] = field(default_factory=dict)  # session id -> tenant
    models: dict[str, TrainingModel] = field(default_factory=dict)  # tinker model id -> model
    samplers: dict[str, Sampler] = field(default_factory=dict)
    checkpoint_owner: dict[str, str] = field(default_factory=dict)  # backend model id -> tenant
    creating: dict[str, str] = field(default_factory=dict)  # model ids being created -> tenant (slots held)

    def __post_init__(self) -> None:
        self.meter = Meter(self.limits)

    def queued(self, tenant: str) -> int:
        return sum(1 for r in self.futures.pending() if r.tenant == tenant)

    # ---- ownership -----------------------------------------------------------------------------
    def session(self, session_id: str, tenant: str) -> None:
        if self.sessions.get(session_id) != tenant:
            raise HTTPException(404, f"no session {session_id!r}")

    def model(self, model_id: str, tenant: str) -> TrainingModel:
        model = self.models.get(model_id)
        if model is None or model.tenant != tenant:
            raise HTTPException(404, f"no training model {model_id!r}")
        return model

    def sampler(self, sampler_id: str, tenant: str) -> Sampler:
        sampler = self.samplers.get(sampler_id)
        if sampler is None or sampler.tenant != tenant:
            raise HTTPException(404, f"no sampling session {sampler_id!r}")
        return sampler

    def check_path(self, path: str, tenant: str, kind: str) -> None:
        """A tinker:// path of this tenant's own checkpoints (the backend then resolves it in its folder)."""
        try:
            backend_model_id, _ = self.service.backend.resolve(path, kind)
        except ValueError as exc:
            raise HTTPException(404, str(exc)) from None
        if self.checkpoint_owner.get(backend_model_id) != tenant:
            raise HTTPException(404, f"{path!r}: no such checkpoint")

    def base_dir(self, name: str) -> str:
        if name not in self.served:
            raise HTTPException(
                404, f"base model {name!r} is not served here; served: {', '.join(self.served)}"
            )
        return self.served[name]

    def hold_slot(self, model_id: str, tenant: str) -> None:
        """Count a model being created against the adapter limits from the moment it is asked for."""
        if model_id in self.models or model_id in self.creating:
            raise HTTPException(409, f"model {model_id!r} exists already")
        mine = sum(1 for m in self.models.values() if m.tenant == tenant)
        mine += sum(1 for t in self.creating.values() if t == tenant)
        self.limits.check_adapters(mine, len(self.models) + len(self.creating))
        self.creating[model_id] = tenant

    def add_model(self, model_id: str, tenant: str, client: TrainingClient, base_name: str) -> None:
        self.models[model_id] = TrainingModel(tenant, client, base_name)
        self.checkpoint_owner[client.model_id] = tenant


def _json(model: Any) -> dict[str, Any]:
    return model.model_dump(mode="json", exclude_none=True)


def make_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="posttrain serve", description=__doc__.splitlines()[0])
    app.state.server = state

    async def tenant_of(request: Request) -> str:
        tenant = state.keys.tenant(request.headers.get("x-api-key"))
        if request.url.path != "/api/v1/retrieve_future":  # polling is how results arrive: never limited
            state.meter.admit(tenant)
        return tenant

    async def body_as(request: Request, model: type[pydantic.BaseModel]) -> Any:
        try:
            return model.model_validate_json(await request.body())
        except pydantic.ValidationError as exc:
            raise HTTPException(400, f"{model.__name__}: {exc.errors(include_url=False)}") from None

    def submitted(tenant: str, kind: str, future: Any, encode: Callable[[Any], Any], **extra: Any) -> dict:
        state.limits.check_queued(state.queued(tenant))
        request_id = state.futures.add(tenant, kind, future, encode)
        return {"request_id": request_id, **extra}

    def in_order(
        model_id: str,
        seq_id: int | None,
        tenant: str,
        kind: str,
        start: Callable[[], Any],
        encode: Callable[[Any], Any],
    ) -> dict:
        """Submit a training model's request in seq_id order; a seq_id seen before returns its first id."""
        if seq_id is None:
            raise HTTPException(400, f"{kind} needs a seq_id")
        earlier = state.sequencer.seen(model_id, seq_id)
        if earlier is not None:
            return {"request_id": earlier, "model_id": model_id}
        future = state.sequencer.submit(model_id, seq_id, start)
        answer = submitted(tenant, kind, future, encode, model_id=model_id)
        state.sequencer.remember(model_id, seq_id, answer["request_id"])
        return answer

    @app.middleware("http")
    async def log_requests(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        start = time.perf_counter()
        response = await call_next(request)
        tenant = state.keys.peek(request.headers.get("x-api-key"))
        state.meter.record(tenant, request.url.path, response.status_code, time.perf_counter() - start)
        log.info(
            "%s %s %d %.1fms tenant=%s", request.method, request.url.path, response.status_code,
            1000 * (time.perf_counter() - start), state.keys.peek(request.headers.get("x-api-key")),
        )  # fmt: skip
        return response

    # ---- service ------------------------------------------------------------------------------
    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(state.meter.prometheus(), media_type="text/plain; version=0.0.4")

    @app.get("/api/v1/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.post("/api/v1/client/config")
    async def client_config(request: Request) -> dict:
        await tenant_of(request)
        return {"pjwt_auth_enabled": False, "parallel_fwdbwd_chunks": False, "use_pyqwest_transport": False}

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config(request: Request) -> dict:
        await tenant_of(request)
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities(request: Request) -> dict:
        await tenant_of(request)
        models = [
            types.SupportedModel(
                model_name=name, max_context_length=_context(path), trainable=True, sampleable=True
            )
            for name, path in state.served.items()
        ]
        return _json(types.GetServerCapabilitiesResponse(supported_models=models))

    @app.post("/api/v1/create_session")
    async def create_session(request: Request) -> dict:
        tenant = await tenant_of(request)
        await body_as(request, types.CreateSessionRequest)
        session_id = uuid.uuid4().hex
        state.sessions[session_id] = tenant
        return _json(types.CreateSessionResponse(session_id=session_id))

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request) -> dict:
        tenant = await tenant_of(request)
        body = await body_as(request, types.SessionHeartbeatRequest)
        state.session(body.session_id, tenant)
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish_session(session_id: str, request: Request) -> dict:
        tenant = await tenant_of(request)
        state.session(session_id, tenant)
        return {}

    # ---- training models ----------------------------------------------------------------------
    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> dict:
        tenant = await tenant_of(request)
        body: types.CreateModelRequest = await body_as(request, types.CreateModelRequest)
        state.session(body.session_id, tenant)
        path = state.base_dir(body.base_model)
        model_id = f"{body.session_id}:train:{body.model_seq_id}"
        if body.lora_config is None:
            raise HTTPException(400, "create_model needs a lora_config: this server trains LoRA adapters")
        lora = body.lora_config
        state.limits.check_rank(lora.rank)
        state.hold_slot(model_id, tenant)

        def create() -> types.CreateModelResponse:
            try:
                client = state.service.create_lora_training_client(
                    path, rank=lora.rank, seed=lora.seed, train_mlp=lora.train_mlp,
                    train_attn=lora.train_attn, train_unembed=lora.train_unembed,
                )  # fmt: skip
                state.add_model(model_id, tenant, client, body.base_model)
            finally:
                state.creating.pop(model_id, None)
            return types.CreateModelResponse(model_id=model_id)

        future = in_thread(create)
        return submitted(tenant, "create_model", future, _json, model_id=model_id)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict:
        tenant = await tenant_of(request)
        body = await body_as(request, types.GetInfoRequest)
        model = state.model(body.model_id, tenant)
        info = model.client.get_info()
        data = types.ModelData(
            arch=info.model_data.arch, model_name=model.base_name, tokenizer_id=info.model_data.tokenizer_id
        )
        return _json(
            info.model_copy(
                update={"model_id": body.model_id, "model_data": data, "model_name": model.base_name}
            )
        )

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict:
        tenant = await tenant_of(request)
        body = await request.body()
        if request.headers.get("content-encoding") == "zstd":
            raise HTTPException(
                415, "zstd-compressed bodies are not accepted (the server's client config disables them)"
            )
        try:
            call = decode_forward_backward(body)
        except WireError as exc:
            raise HTTPException(400, str(exc)) from None
        model = state.model(call.model_id, tenant)
        tokens = sum(d.model_input.length for d in call.data)
        state.limits.check_tokens(tokens)
        state.meter.count_tokens(tenant, tokens)
        verb = model.client.forward if call.forward_only else model.client.forward_backward

        def start() -> Any:
            return verb(call.data, call.loss_fn, call.loss_fn_config)

        kind = "forward" if call.forward_only else "forward_backward"
        return in_order(call.model_id, call.seq_id, tenant, kind, start, encode_forward_backward_output)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> dict:
        tenant = await tenant_of(request)
        body: types.OptimStepRequest = await body_as(request, types.OptimStepRequest)
        model = state.model(body.model_id, tenant)
        params = body.optim_params

        def start() -> Any:
            if not isinstance(params, types.AdamParams):
                raise ValueError(f"optimizer {type(params).__name__} is not supported; use AdamParams")
            return model.client.optim_step(params)

        return in_order(body.model_id, body.seq_id, tenant, "optim_step", start, _json)

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> dict:
        tenant = await tenant_of(request)
        body: types.SaveWeightsRequest = await body_as(request, types.SaveWeightsRequest)
        model = state.model(body.model_id, tenant)
        name = body.path or f"state-{body.seq_id}"
        return in_order(
            body.model_id,
            body.seq_id,
            tenant,
            "save_weights",
            lambda: model.client.save_state(name, body.ttl_seconds),
            _json,
        )

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request) -> dict:
        tenant = await tenant_of(request)
        body: types.SaveWeightsForSamplerRequest = await body_as(request, types.SaveWeightsForSamplerRequest)
        model = state.model(body.model_id, tenant)
        if body.kind != "snapshot":
            raise HTTPException(400, f"sampler weights of kind {body.kind!r} are not supported (snapshot is)")

        def start() -> Any:
            if body.path is not None:
                return model.client.save_weights_for_sampler(body.path, body.ttl_seconds)
            sampler_id = f"{body.model_id}:sample:{body.sampling_session_seq_id}"
            client = model.client.save_weights_and_get_sampling_client()
            state.samplers[sampler_id] = Sampler(tenant, client, model.base_name)
            return resolved(types.SaveWeightsForSamplerResponseInternal(sampling_session_id=sampler_id))

        return in_order(body.model_id, body.seq_id, tenant, "save_weights_for_sampler", start, _json)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> dict:
        tenant = await tenant_of(request)
        body: types.LoadWeightsRequest = await body_as(request, types.LoadWeightsRequest)
        state.check_path(body.path, tenant, "weights")
        if body.model_id is not None:  # onto an existing model, in its sequence
            model = state.model(body.model_id, tenant)
            load = model.client.load_state_with_optimizer if body.optimizer else model.client.load_state
            return in_order(
                body.model_id, body.seq_id, tenant, "load_weights", lambda: load(body.path), _json
            )
        if body.session_id is None or body.model_seq_id is None:
            raise HTTPException(400, "load_weights needs model_id + seq_id, or session_id + model_seq_id")
        state.session(body.session_id, tenant)
        model_id = f"{body.session_id}:train:{body.model_seq_id}"
        service = state.service
        state.hold_slot(model_id, tenant)

        def create() -> types.LoadWeightsResponse:
            make = (
                service.create_training_client_from_state_with_optimizer
                if body.optimizer
                else service.create_training_client_from_state
            )
            try:
                client = make(body.path)
            finally:
                state.creating.pop(model_id, None)
            base_name = next(
                (n for n, p in state.served.items() if Path(p) == Path(client.get_info().model_name or "")),
                "",
            )
            state.add_model(model_id, tenant, client, base_name)
            return types.LoadWeightsResponse(path=body.path, model_id=model_id)

        return submitted(tenant, "load_weights", in_thread(create), _json, model_id=model_id)

    # ---- sampling -----------------------------------------------------------------------------
    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict:
        tenant = await tenant_of(request)
        body: types.CreateSamplingSessionRequest = await body_as(request, types.CreateSamplingSessionRequest)
        state.session(body.session_id, tenant)
        sampler_id = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
        if body.model_path is not None:
            state.check_path(body.model_path, tenant, "sampler_weights")
            client = state.service.create_sampling_client(model_path=body.model_path)
            base_name = next(iter(state.served))
        elif body.base_model is not None:
            client = state.service.create_sampling_client(base_model=state.base_dir(body.base_model))
            base_name = body.base_model
        else:
            raise HTTPException(400, "create_sampling_session needs base_model or model_path")
        state.samplers[sampler_id] = Sampler(tenant, client, base_name, body.model_path)
        return _json(types.CreateSamplingSessionResponse(sampling_session_id=sampler_id))

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request) -> dict:
        tenant = await tenant_of(request)
        sampler = state.sampler(sampler_id, tenant)
        return {"sampler_id": sampler_id, "base_model": sampler.base_name, "model_path": sampler.model_path}

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> dict:
        tenant = await tenant_of(request)
        body: types.SampleRequest = await body_as(request, types.SampleRequest)
        if body.sampling_session_id is None:
            raise HTTPException(400, "asample needs a sampling_session_id (create_sampling_session first)")
        sampler = state.sampler(body.sampling_session_id, tenant)
        unsupported = {
            "topk_sample_logprobs": body.topk_sample_logprobs, "target_prompt_logprobs": body.target_prompt_logprobs,
            "prompt_alt_tokens_k": body.prompt_alt_tokens_k, "prompt_logprobs_last_n": body.prompt_logprobs_last_n,
        }  # fmt: skip
        named = [k for k, v in unsupported.items() if v]
        tokens = body.prompt.length + body.num_samples * (body.sampling_params.max_tokens or 0)
        state.limits.check_tokens(tokens)
        state.meter.count_tokens(tenant, tokens)
        try:
            if named:
                raise ValueError(f"sample options not supported here: {', '.join(named)}")
            future = sampler.client.sample(
                body.prompt, body.num_samples, body.sampling_params,
                include_prompt_logprobs=bool(body.prompt_logprobs), topk_prompt_logprobs=body.topk_prompt_logprobs,
            )  # fmt: skip
        except ValueError as exc:
            future = failed(exc)
        answer = submitted(tenant, "sample", future, encode_sample_response)
        answer["sample_sequence_ids"] = [f"{answer['request_id']}:{i}" for i in range(body.num_samples)]
        return answer

    # ---- futures ------------------------------------------------------------------------------
    @app.post("/api/v1/retrieve_future", response_model=None)
    async def retrieve_future(request: Request) -> Response | dict:
        tenant = await tenant_of(request)
        body: types.FutureRetrieveRequest = await body_as(request, types.FutureRetrieveRequest)
        try:
            pending = state.futures.get(body.request_id, tenant)
        except UnknownRequest:
            raise HTTPException(
                404, f"no request {body.request_id!r} (unknown, or lost in a server restart)"
            ) from None
        if not await FutureStore.wait(pending, state.poll_timeout_s):
            return {"type": "try_again", "request_id": body.request_id, "queue_state": "active"}
        exc = pending.future.exception()
        if exc is not None:
            category = "user" if isinstance(exc, (ValueError, TypeError, KeyError)) else "server"
            return {"error": f"{type(exc).__name__}: {exc}", "category": category}
        payload = pending.encode(pending.future.result())
        if isinstance(payload, bytes):
            return Response(content=payload, media_type=PROTO)
        return payload

    # ---- the rest of the protocol ------------------------------------------------------------
    @app.api_route("/api/v1/{rest:path}", methods=["GET", "POST", "PUT", "DELETE"], include_in_schema=False)
    async def not_implemented(rest: str, request: Request) -> JSONResponse:
        await tenant_of(request)
        return JSONResponse(
            {"detail": f"/api/v1/{rest} is not implemented by posttrain serve"}, status_code=501
        )

    return app


def _context(path: str) -> int | None:
    from posttrain.models import load_config

    return getattr(load_config(path), "max_position_embeddings", None)
