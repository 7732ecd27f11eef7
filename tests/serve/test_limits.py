"""Per-tenant limits answer with a 4xx naming the limit; /metrics counts per tenant."""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest
from fastapi import HTTPException

from posttrain.serve.limits import Limits, Meter

from .conftest import KEYS, SESSION, Running

ALICE, BOB = list(KEYS)


def test_each_limit_names_itself() -> None:
    limits = Limits(
        max_lora_rank=8, adapters_per_tenant=1, adapters_total=2, tokens_per_request=10, queued_requests=3
    )
    cases = [
        (lambda: limits.check_rank(16), 400, "max_lora_rank=8"),
        (lambda: limits.check_adapters(1, 1), 403, "adapters_per_tenant=1"),
        (lambda: limits.check_adapters(0, 2), 403, "adapters_total=2"),  # never released: final
        # released when idle: a slot may free up, so the SDK backs off and tries again (429)
        (lambda: replace(limits, adapter_idle_seconds=60).check_adapters(0, 2), 429, "adapters_total=2"),
        (lambda: limits.check_tokens(11), 413, "tokens_per_request=10"),
        (lambda: limits.check_queued(3), 429, "queued_requests=3"),
        (lambda: limits.check_free_slot(2, "s:train:0"), 429, "adapters_total=2"),
    ]
    for check, status, name in cases:
        with pytest.raises(HTTPException) as caught:
            check()
        assert caught.value.status_code == status and name in caught.value.detail
    limits.check_rank(8), limits.check_adapters(0, 1), limits.check_tokens(10), limits.check_queued(2)
    meter = Meter(Limits(requests_per_second=2))
    meter.admit("a"), meter.admit("a")
    with pytest.raises(HTTPException, match="requests_per_second=2"):
        meter.admit("a")
    meter.admit("b")  # buckets are per tenant
    tokens = Meter(Limits(tokens_per_second=100))
    tokens.admit_tokens("a", 250)  # a full bucket lets a large request through, and is in debt after it
    with pytest.raises(HTTPException, match="tokens_per_second=100") as caught:
        tokens.admit_tokens("a", 1)
    assert caught.value.status_code == 429
    tokens.admit_tokens("b", 100)
    assert tokens.tokens == {"a": 250, "b": 100}


def test_the_server_enforces_limits_per_tenant_and_counts(server: Running) -> None:
    state = server.state
    saved = state.limits
    state.limits = replace(saved, max_lora_rank=4, adapters_per_tenant=1)  # type: ignore[attr-defined]
    try:
        with server.client(BOB) as bob:
            session_id = bob.post("/api/v1/create_session", json=SESSION).json()["session_id"]
            create = {
                "session_id": session_id,
                "model_seq_id": 50,
                "base_model": "tiny",
                "lora_config": {"rank": 8},
            }
            too_big = bob.post("/api/v1/create_model", json=create)
            assert too_big.status_code == 400 and "max_lora_rank=4" in too_big.text
            create["lora_config"] = {"rank": 2}
            assert bob.post("/api/v1/create_model", json=create).status_code == 200
            create["model_seq_id"] = 51
            second = bob.post("/api/v1/create_model", json=create)
            assert second.status_code == 403 and "adapters_per_tenant=1" in second.text
        metrics = server.client(BOB).get("/metrics").text
        assert (
            'posttrain_requests_total{tenant="bob",endpoint="/api/v1/create_model",status="403"} 1' in metrics
        )
        assert "# TYPE posttrain_requests_total counter" in metrics
    finally:
        state.limits = saved  # type: ignore[attr-defined]


def test_samplers_are_bounded_per_tenant_and_released_with_their_session(server: Running) -> None:
    state = server.state
    saved = state.limits
    state.limits = replace(saved, samplers_per_tenant=2)  # type: ignore[attr-defined]
    try:
        with server.client(BOB) as bob:
            session_id = bob.post("/api/v1/create_session", json=SESSION).json()["session_id"]
            ids = []
            for seq in range(3):
                body = {"session_id": session_id, "sampling_session_seq_id": seq, "base_model": "tiny"}
                answer = bob.post("/api/v1/create_sampling_session", json=body)
                assert answer.status_code == 200
                ids.append(answer.json()["sampling_session_id"])

            def sampler(sampler_id: str) -> httpx.Response:
                return bob.get(f"/api/v1/samplers/{sampler_id}")

            oldest = sampler(ids[0])
            assert oldest.status_code == 404 and "samplers_per_tenant=2" in oldest.text
            assert sampler(ids[1]).status_code == 200 and sampler(ids[2]).status_code == 200
            assert bob.post(f"/api/v1/sessions/{session_id}/finish").status_code == 200
            assert all("was released" in sampler(i).text for i in ids[1:])
            assert not any(i in state.samplers for i in ids)  # type: ignore[attr-defined]
    finally:
        state.limits = saved  # type: ignore[attr-defined]
