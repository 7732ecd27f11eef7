"""schemathesis over the server's OpenAPI schema: bodies generated from the endpoints' request models, valid
ones and broken ones (random bytes for the protobuf one), sent by a tenant of their own; no answer may be
a 5xx. Valid bodies get that tenant's real session, model and sampler ids where they name one, so they reach
past the ownership checks into the work itself."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from .conftest import FUZZER, SESSION, Running, result

FUZZER_KEY = next(iter(FUZZER))
EXAMPLES = 10  # per endpoint and mode: ~20 endpoints x 2 modes in ~10 s
PROTOBUF_BODIES = {"/api/v1/forward_backward"}
schemathesis.serializer.alias("application/x-protobuf", "application/octet-stream")  # bytes as they are


@pytest.fixture
def fuzzer_ids(server: Running) -> Iterator[dict[str, str]]:
    """The fuzzing tenant's session, model and sampler; smaller requests while it runs."""
    state = server.state
    limits = state.limits  # type: ignore[attr-defined]
    state.limits = replace(limits, tokens_per_request=64)  # type: ignore[attr-defined]  # samples stay short
    try:
        with server.client(FUZZER_KEY) as fuzzer:
            session_id = fuzzer.post("/api/v1/create_session", json=SESSION).json()["session_id"]
            create = {"session_id": session_id, "model_seq_id": 0, "base_model": "tiny"}
            create["lora_config"] = {"rank": 2}
            model_id = result(fuzzer, fuzzer.post("/api/v1/create_model", json=create).json()["request_id"])
            sampler = {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": "tiny"}
            sampler_id = fuzzer.post("/api/v1/create_sampling_session", json=sampler).json()
        yield {
            "session_id": session_id,
            "model_id": model_id["model_id"],
            "sampling_session_id": sampler_id["sampling_session_id"],
            "base_model": "tiny",
        }
    finally:
        state.limits = limits  # type: ignore[attr-defined]


def test_the_schema_describes_each_body(server: Running) -> None:
    paths = server.client(None).get("/openapi.json").json()["paths"]
    body = paths["/api/v1/create_model"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CreateModelRequest"}
    assert "application/x-protobuf" in paths["/api/v1/forward_backward"]["post"]["requestBody"]["content"]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_endpoint_answers_a_server_error(server: Running, fuzzer_ids: dict, mode: GenerationMode) -> None:
    raw = server.client(None).get("/openapi.json").json()
    raw.pop("security")  # the key is sent with every case: no cases spent on a mangled one
    schema = schemathesis.openapi.from_dict(raw)
    operations = [r.ok() for r in schema.include(path_regex="^/api/v1/").get_all_operations()]
    assert len(operations) >= 15
    server_errors: list[str] = []
    statuses: dict[int, int] = {}
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and operation.path in PROTOBUF_BODIES:
            continue  # schemathesis cannot break a binary body (it raises); positive mode sends random bytes

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
            derandomize=True,  # the same cases every run: CI must not be flaky
        )
        def probe(case: schemathesis.Case) -> None:
            if mode is GenerationMode.POSITIVE:
                case.body = _with_real_ids(case.body, fuzzer_ids)
            response = case.call(base_url=server.url, headers={"X-API-Key": FUZZER_KEY}, timeout=30)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            if response.status_code >= 500:
                server_errors.append(f"{case.method} {case.path} {case.body!r}: {response.text[:300]}")

        try:
            probe()
        except Unsatisfiable:  # nothing to break in a GET without parameters
            assert mode is GenerationMode.NEGATIVE
    assert not server_errors, "\n".join(server_errors[:10])
    # valid bodies reach the work (200s beyond the id-less endpoints); broken ones are refused as such
    wanted = 200 if mode is GenerationMode.POSITIVE else 400
    assert statuses.get(wanted, 0) > len(operations) and 401 not in statuses, statuses


def _with_real_ids(body: Any, ids: dict[str, str]) -> Any:
    if isinstance(body, dict):
        return {k: ids[k] if k in ids and isinstance(v, str) else v for k, v in body.items()}
    return body
