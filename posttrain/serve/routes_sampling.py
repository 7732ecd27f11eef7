"""The sampling endpoints of `posttrain serve`: sampling sessions (on a base model or on a tenant's own
sampler weights) and `asample`, whose result is protobuf. A sample's
prompt (its image chunks decoded and processed) is read in a worker thread, off the event loop. Sampling
sessions are journaled (journal.py says which survive a restart)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, HTTPException, Request
from starlette.concurrency import run_in_threadpool
from tinker import types

from posttrain.client.sampling import context_length
from posttrain.serve.api import Api, as_json
from posttrain.serve.futures import failed
from posttrain.serve.journal import SamplerRow
from posttrain.serve.state import Sampler
from posttrain.serve.wire import encode_sample_response


def add_sampling_routes(app: FastAPI, api: Api) -> None:
    state, bodies = api.state, api.bodies

    @app.post(
        "/api/v1/create_sampling_session", openapi_extra=bodies.json(types.CreateSamplingSessionRequest)
    )
    async def create_sampling_session(request: Request) -> dict:
        tenant = await api.tenant(request)
        body: types.CreateSamplingSessionRequest = await api.body(request, types.CreateSamplingSessionRequest)
        state.session(body.session_id, tenant)
        sampler_id = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
        if body.model_path is not None:
            state.check_path(body.model_path, tenant, "sampler_weights")
            row = SamplerRow(sampler_id, tenant, next(iter(state.served)), model_path=body.model_path)
        elif body.base_model is not None:
            row = SamplerRow(sampler_id, tenant, body.base_model)
        else:
            raise HTTPException(400, "create_sampling_session needs base_model or model_path")
        state.add_sampler(Sampler(state.open_sampler(row), row))
        return as_json(types.CreateSamplingSessionResponse(sampling_session_id=sampler_id))

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request) -> dict:
        tenant = await api.tenant(request)
        sampler = state.sampler(sampler_id, tenant)
        return {"sampler_id": sampler_id, "base_model": sampler.base_name, "model_path": sampler.model_path}

    @app.post("/api/v1/asample", openapi_extra=bodies.json(types.SampleRequest))
    async def asample(request: Request) -> dict:
        tenant = await api.tenant(request)
        body: types.SampleRequest = await api.body(request, types.SampleRequest)
        if body.sampling_session_id is None:
            raise HTTPException(400, "asample needs a sampling_session_id (create_sampling_session first)")
        sampler = state.sampler(body.sampling_session_id, tenant)
        if body.record_stability_info:  # refused at the first sample, not at the first update after a batch
            raise HTTPException(
                400,
                "record_stability_info (the sampling side of tinker's stable_reinforce loss) is not supported by "
                "posttrain serve, nor that loss: train with importance_sampling or ppo (tinker-cookbook: "
                "Config(loss_fn=...), AsyncConfig(loss_fn='ppo'))",
            )
        if body.num_samples < 1:
            raise HTTPException(400, f"num_samples must be >= 1, got {body.num_samples}")
        targets = _tensor_data(body.target_prompt_logprobs)
        # every sample counts the tokens it may generate: max_tokens, or without it what the context leaves
        # (the sampler fills up to the context then); at least one, so num_samples is bounded too
        base_dir = api.base_dir(sampler.base_name)
        prompt_tokens = await api.input_tokens({"prompt": body.prompt}, base_dir)
        # from here to `remember` nothing awaits: a retry of this seq_id (the SDK's, after a lost answer) gets
        # this request's id, sampled once and charged once
        if body.seq_id is not None:
            earlier = api.seen(body.sampling_session_id, body.seq_id)
            if earlier is not None:
                return _sample_answer(earlier, body.num_samples)
        max_tokens = body.sampling_params.max_tokens
        if max_tokens is None:
            max_tokens = context_length(base_dir) - prompt_tokens
        api.tokens(tenant, prompt_tokens + body.num_samples * max(1, max_tokens))

        def start() -> Any:
            return sampler.client.sample(
                body.prompt, body.num_samples, body.sampling_params,
                include_prompt_logprobs=bool(body.prompt_logprobs), topk_prompt_logprobs=body.topk_prompt_logprobs,
                topk_sample_logprobs=body.topk_sample_logprobs, target_prompt_logprobs=targets,
                prompt_alt_tokens_k=body.prompt_alt_tokens_k, prompt_logprobs_last_n=body.prompt_logprobs_last_n,
            )  # fmt: skip

        state.limits.check_queued(state.queued(tenant))
        pending = state.futures.open(tenant, "sample")  # journaled before the work starts (FutureStore.open)
        if body.seq_id is not None:
            state.sequencer.remember(body.sampling_session_id, body.seq_id, pending.request_id)
        future: Any = None
        try:  # in a worker thread: `sample` processes the prompt's image chunks, which would stall the loop
            future = await run_in_threadpool(start)
        except Exception as exc:  # noqa: BLE001 - a request the sampler refuses is that request's error
            future = failed(exc)
        finally:  # a request taken on always gets an answer, even if this handler is cancelled
            if future is None:
                future = failed(RuntimeError("the sample request was cancelled before it started"))
            state.futures.attach(pending, future, encode_sample_response)
        return _sample_answer(pending.request_id, body.num_samples)


def _sample_answer(request_id: str, num_samples: int) -> dict[str, Any]:
    return {
        "request_id": request_id,
        "sample_sequence_ids": [f"{request_id}:{i}" for i in range(num_samples)],
    }


def _tensor_data(model: Any) -> types.TensorData | None:
    """A request's TensorData (its JSON model) as the SDK's TensorData; a malformed one is a 400."""
    if model is None:
        return None
    try:
        return types.TensorData(
            data=model.data, dtype=model.dtype, shape=model.shape,
            sparse_crow_indices=model.sparse_crow_indices, sparse_col_indices=model.sparse_col_indices,
        )  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - what is wrong with it, named
        raise HTTPException(400, f"target_prompt_logprobs is malformed: {exc}") from None
