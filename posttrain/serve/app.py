"""`posttrain serve`: the explicit API over HTTP, speaking tinker's wire protocol (SDK 0.38).

The official `tinker` SDK works against this server with only `TINKER_BASE_URL` and `TINKER_API_KEY` set.
Behind it is one `posttrain.client.ServiceClient` (its `local` or `ray` backend): every tenant's LoRA
adapter sits on the one served base model, and the calls of all tenants run through the backend's ordered
queue. The server is a protocol adapter: it authenticates (`X-API-Key` -> tenant), checks ownership of
every id and path a request names, runs each training model's requests in `seq_id` order (a retry is
applied once), and hands out request ids whose results the SDK fetches from `retrieve_future` by long
polling (protobuf for forward/backward and sample results, JSON otherwise). What it must remember is
journaled (journal.py), so a restarted server goes on where it was (recovery.py).

Endpoints the protocol has and this server does not implement (billing, external weight copies, custom-loss
graphs, session search...) answer 501 naming the endpoint, marked not to be retried; the SDK's telemetry
(on by default) is accepted and counted. This module holds the service,
session and futures endpoints and the server's upkeep; routes_training.py, routes_sampling.py and
routes_runs.py (the REST client's training runs and checkpoints) the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from tinker import types

from posttrain.serve.api import Api, as_json
from posttrain.serve.futures import FutureStore, UnknownRequest
from posttrain.serve.lifecycle import maintain, shut_down
from posttrain.serve.routes_runs import add_run_routes
from posttrain.serve.routes_sampling import add_sampling_routes
from posttrain.serve.routes_training import add_training_routes
from posttrain.serve.state import ServerState

log = logging.getLogger("posttrain.serve")
PROTO = "application/x-protobuf"


class RequestLog:
    """One log line and one metrics sample per request (tenant, endpoint, status, time): plain ASGI, which
    costs a fraction of a `BaseHTTPMiddleware` per request (no second task, no wrapped body stream)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # what the client gets if the app fails before answering

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            seconds = time.perf_counter() - start
            key = dict(scope["headers"]).get(b"x-api-key")
            tenant = self.state.keys.peek(key.decode("latin-1") if key is not None else None)
            route = scope.get("route")  # the route's template: ids in paths do not make new series
            endpoint = getattr(route, "path", None) or "(no route)"
            self.state.meter.record(tenant, endpoint, status, seconds)
            log.info(
                "%s %s %d %.1fms tenant=%s", scope["method"], scope["path"], status, 1000 * seconds, tenant
            )


def make_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.loop, state.stop = asyncio.get_running_loop(), asyncio.Event()
        upkeep = asyncio.create_task(maintain(state))
        try:
            yield
        finally:
            upkeep.cancel()
            await asyncio.to_thread(shut_down, state)

    app = FastAPI(title="posttrain serve", description=__doc__.splitlines()[0], lifespan=lifespan)
    app.state.server = state
    api = Api(state)
    bodies = api.bodies

    app.add_middleware(RequestLog, state=state)

    # ---- service ------------------------------------------------------------------------------
    @app.get("/metrics", response_class=Response)
    async def metrics(request: Request) -> Response:
        """Prometheus' text format: the caller's own series (a tenant's key), or every tenant's without a key
        when the server runs with --public-metrics."""
        tenant = None if state.public_metrics else await api.tenant(request)
        loaded = sum(1 for m in list(state.models.values()) if m.loaded)
        gauges = {
            "posttrain_adapters_loaded": ("LoRA adapters loaded on the backend.", loaded),
            "posttrain_models": ("Training models known (loaded or released).", len(state.models)),
            "posttrain_futures_in_memory": ("Requests held in memory.", state.futures.in_memory()),
            "posttrain_requests_pending": ("Requests not finished.", len(state.futures.pending())),
        }
        return Response(state.meter.prometheus(gauges, tenant), media_type="text/plain; version=0.0.4")

    @app.get("/api/v1/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.post("/api/v1/client/config")
    async def client_config(request: Request) -> dict:
        """The SDK's flags. It cuts a forward_backward into chunks of at most `fwdbwd_max_chunk_bytes_count`
        estimated bytes, each a request of its own; every token of a model input counts at least 4 bytes,
        so chunks of 4 x tokens_per_request bytes are never refused by that limit (the SDK's default, 5 MB,
        holds ~311k tokens of a typical datum)."""
        await api.tenant(request)
        return {
            "pjwt_auth_enabled": False,
            "parallel_fwdbwd_chunks": False,
            "use_pyqwest_transport": False,
            "fwdbwd_max_chunk_bytes_count": min(5_000_000, 4 * state.limits.tokens_per_request),
        }

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config(request: Request) -> dict:
        await api.tenant(request)
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities(request: Request) -> dict:
        await api.tenant(request)
        models = [
            types.SupportedModel(
                model_name=name, max_context_length=_context(path), trainable=True, sampleable=True
            )
            for name, path in state.served.items()
        ]
        return as_json(types.GetServerCapabilitiesResponse(supported_models=models))

    # ---- sessions -----------------------------------------------------------------------------
    @app.post("/api/v1/create_session", openapi_extra=bodies.json(types.CreateSessionRequest))
    async def create_session(request: Request) -> dict:
        tenant = await api.tenant(request)
        await api.body(request, types.CreateSessionRequest)
        session_id = uuid.uuid4().hex
        state.add_session(session_id, tenant)
        return as_json(types.CreateSessionResponse(session_id=session_id))

    @app.post("/api/v1/session_heartbeat", openapi_extra=bodies.json(types.SessionHeartbeatRequest))
    async def heartbeat(request: Request) -> dict:
        tenant = await api.tenant(request)
        body = await api.body(request, types.SessionHeartbeatRequest)
        state.session(body.session_id, tenant)
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish_session(session_id: str, request: Request) -> dict:
        """Finish a session (its samplers are released). Finishing one of the tenant's sessions that already
        finished (twice, or after it expired) answers as the first time: the SDK's `close()` raises otherwise."""
        tenant = await api.tenant(request)
        finished = state.finished_sessions.get(session_id)
        if finished is not None and finished[0] == tenant:
            return {}
        state.session(session_id, tenant)
        state.finish_session(session_id, f"session {session_id!r} was finished by its client")
        return {}

    add_training_routes(app, api)
    add_sampling_routes(app, api)
    add_run_routes(app, api)

    # ---- futures ------------------------------------------------------------------------------
    @app.post(
        "/api/v1/retrieve_future", response_model=None, openapi_extra=bodies.json(types.FutureRetrieveRequest)
    )
    async def retrieve_future(request: Request) -> Response | dict:
        tenant = await api.tenant(request)
        body: types.FutureRetrieveRequest = await api.body(request, types.FutureRetrieveRequest)
        try:
            pending = state.futures.get(body.request_id, tenant)
        except UnknownRequest:
            raise HTTPException(
                404, f"no request {body.request_id!r} (unknown, or its result expired)"
            ) from None
        if not await FutureStore.wait(pending, state.poll_timeout_s, state.stop):
            return {"type": "try_again", "request_id": body.request_id, "queue_state": "active"}
        answer = pending.answer.result()
        state.futures.retrieved(pending)
        if isinstance(answer, bytes):
            return Response(content=answer, media_type=PROTO)
        return answer

    # ---- the SDK's telemetry ----------------------------------------------------------------
    @app.post("/api/v1/telemetry", openapi_extra=bodies.json(types.TelemetrySendRequest))
    async def telemetry(request: Request) -> dict:
        """The SDK's events about itself (sent every 10 s unless TINKER_TELEMETRY=0): accepted, counted in
        /metrics as requests of this endpoint, and logged at debug level. Refused, the SDK would log a
        warning with a traceback at every flush and hold its exit up to 30 s trying again."""
        tenant = await api.tenant(request)
        body: types.TelemetrySendRequest = await api.body(request, types.TelemetrySendRequest)
        log.debug("telemetry from tenant %s: %d event(s)", tenant, len(body.events))
        return {"status": "accepted"}

    # ---- the rest of the protocol ------------------------------------------------------------
    @app.api_route("/api/v1/{rest:path}", methods=["GET", "POST", "PUT", "DELETE"], include_in_schema=False)
    async def not_implemented(rest: str, request: Request) -> JSONResponse:
        """404, naming the endpoint as not implemented. Not 501: the SDK retries every 5xx for 5 minutes
        (`InternalClientHolder.execute_with_retries`, whatever `x-should-retry` says), so a user waited that
        long for this answer. A request that spent a training model's seq_id (save_weights_external) has it
        consumed with the refusal, so the model's next request is not held behind the gap."""
        tenant = await api.tenant(request)
        detail = f"/api/v1/{rest} is not implemented by posttrain serve"
        refusal = HTTPException(404, detail)
        if request.method == "POST" and "json" in request.headers.get("content-type", ""):
            try:
                body = json.loads(await request.body())
            except ValueError:
                body = None
            if (
                isinstance(body, dict)
                and isinstance(body.get("model_id"), str)
                and isinstance(body.get("seq_id"), int)
            ):
                try:
                    model = state.model(body["model_id"], tenant)
                except HTTPException:
                    model = None
                if model is not None:
                    api.refused_in_order(model, body["seq_id"], tenant, rest, refusal)
        return JSONResponse({"detail": detail}, status_code=404, headers={"x-should-retry": "false"})

    bodies.install(app)
    return app


def _context(path: str) -> int | None:
    from posttrain.models import load_config

    return getattr(load_config(path), "max_position_embeddings", None)
