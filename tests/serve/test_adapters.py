"""Idle adapters are released and come back on their next request, under the same model id; rate limits
on tokens name themselves; /metrics has per-tenant queue time under route templates."""

from __future__ import annotations

import concurrent.futures
import logging
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, cast

import pytest

from posttrain.serve.adapters import Adapters, TrainingModel
from posttrain.serve.futures import resolved

from .conftest import KEYS, SESSION, Running, logprobs, result, training

ALICE, BOB = list(KEYS)


@pytest.fixture
def alice_model(server: Running) -> Iterator[tuple[str, str]]:
    """A fresh model of alice's (session id, model id), limits put back after the test."""
    saved = server.state.limits  # type: ignore[attr-defined]
    with server.client(ALICE) as alice:
        session_id = alice.post("/api/v1/create_session", json=SESSION).json()["session_id"]
        create = {
            "session_id": session_id,
            "model_seq_id": 0,
            "base_model": "tiny",
            "lora_config": {"rank": 2},
        }
        model_id = result(alice, alice.post("/api/v1/create_model", json=create).json()["request_id"])[
            "model_id"
        ]
    yield session_id, model_id
    server.state.limits = saved  # type: ignore[attr-defined]


def test_an_idle_adapter_is_released_and_comes_back_transparently(
    server: Running, alice_model: tuple[str, str]
) -> None:
    state = server.state
    session_id, model_id = alice_model
    model = state.models[model_id]  # type: ignore[attr-defined]
    with server.client(ALICE) as alice:
        for seq_id, verb in ((1, "forward_backward"), (2, "optim_step")):
            result(alice, training(alice, model_id, seq_id, verb))
        before = logprobs(result(alice, training(alice, model_id, 3, "forward")))
        first_backend_id, occupied = model.backend_id, state.adapters.occupied()  # type: ignore[attr-defined]
        state.limits = replace(state.limits, adapter_idle_seconds=0.3)  # type: ignore[attr-defined]
        deadline = time.time() + 10
        while model.loaded or model.releasing:  # released: saved and dropped, not only begun
            assert time.time() < deadline, "the idle adapter was not released"
            time.sleep(0.05)
        state.limits = replace(state.limits, adapter_idle_seconds=0)  # type: ignore[attr-defined]
        assert first_backend_id not in state.service.backend.models  # type: ignore[attr-defined]
        assert state.adapters.occupied() < occupied  # type: ignore[attr-defined]  # its slot is free
        internal = model.restore_path
        assert "posttrain-internal" in internal
        # the server's own save is not the tenant's to load or overwrite
        load = {"session_id": session_id, "model_seq_id": 5, "path": internal, "optimizer": True}
        assert alice.post("/api/v1/load_weights", json=load).status_code == 404
        save = {"model_id": model_id, "seq_id": 4, "path": "posttrain-internal-release"}
        refused = result(alice, alice.post("/api/v1/save_weights", json=save).json()["request_id"])
        assert refused["category"] == "user" and "the server's" in refused["error"]
        # the next request loads it again: same model id, same weights, the optimizer state with them
        assert logprobs(result(alice, training(alice, model_id, 5, "forward"))) == pytest.approx(
            before, abs=1e-6
        )
        # under the same id: its checkpoints stay one training run, tinker://<model_id>/..., as in tinker
        assert model.loaded and model.backend_id == first_backend_id == model_id
        assert internal.startswith(f"tinker://{model_id}/weights/")
        info = alice.post("/api/v1/get_info", json={"model_id": model_id, "type": "get_info"}).json()
        assert info["model_id"] == model_id and info["lora_rank"] == 2
        for seq_id, verb in ((6, "forward_backward"), (7, "optim_step")):  # and trains on
            answer = result(alice, training(alice, model_id, seq_id, verb))
            assert not (isinstance(answer, dict) and "error" in answer), answer
        assert logprobs(result(alice, training(alice, model_id, 8, "forward"))) != pytest.approx(
            before, abs=1e-6
        )
        save = {"model_id": model_id, "seq_id": 9, "path": "after-reload"}
        saved = result(alice, alice.post("/api/v1/save_weights", json=save).json()["request_id"])
        assert saved["path"] == f"tinker://{model_id}/weights/after-reload"


def test_an_adapter_with_gradients_not_yet_stepped_is_not_released_idle(
    server: Running, alice_model: tuple[str, str]
) -> None:
    """A save holds weights and optimizer state, not gradients: released between forward_backward and
    optim_step, the step would have had nothing to apply (grad norm 0, the adapter unchanged)."""
    state = server.state
    _, model_id = alice_model
    model = state.models[model_id]  # type: ignore[attr-defined]
    with server.client(ALICE) as alice:
        result(alice, training(alice, model_id, 1, "forward_backward"))
        state.limits = replace(state.limits, adapter_idle_seconds=0.2)  # type: ignore[attr-defined]
        try:
            time.sleep(1.5)  # several sweeps (the upkeep sweeps idle adapters every few tenths of a second)
            assert model.loaded and model.grads_pending
            step = result(alice, training(alice, model_id, 2, "optim_step"))
            assert step["metrics"]["grad_norm:mean"] > 0 and not model.grads_pending
            deadline = time.time() + 10
            while model.loaded or model.releasing:  # stepped: released as any idle adapter
                assert time.time() < deadline, "the stepped adapter was not released"
                time.sleep(0.05)
        finally:
            state.limits = replace(state.limits, adapter_idle_seconds=0)  # type: ignore[attr-defined]


def test_a_finished_sessions_adapters_are_released_and_free_the_tenants_slots(
    server: Running, alice_model: tuple[str, str]
) -> None:
    """adapters_per_tenant counts the adapters a tenant holds loaded, not every model it ever made (its fifth
    script run was refused for good); a finished session's adapters are saved and unloaded."""
    state: Any = server.state
    session_id, model_id = alice_model
    model = state.models[model_id]
    state.limits = replace(state.limits, adapters_per_tenant=state.adapters.loaded_by(model.tenant))
    with server.client(ALICE) as alice:
        other = alice.post("/api/v1/create_session", json=SESSION).json()["session_id"]
        create = {"session_id": other, "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 2}}
        full = alice.post("/api/v1/create_model", json=create)
        assert full.status_code == 403 and "adapters_per_tenant=" in full.text
        assert alice.post(f"/api/v1/sessions/{session_id}/finish").status_code == 200
        deadline = time.time() + 10
        while model.loaded or model.releasing:
            assert time.time() < deadline, "the finished session's adapter was not released"
            time.sleep(0.05)
        created = alice.post("/api/v1/create_model", json=create)
        assert "model_id" in result(
            alice, created.json()["request_id"]
        )  # the freed slot is the tenant's again
        again = alice.post("/api/v1/get_info", json={"model_id": model_id, "type": "get_info"})
        assert again.status_code == 200  # the model is still the tenant's
        busy = alice.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 1, "adam_params": {}})
        assert busy.status_code == 429 and "adapters_per_tenant=" in busy.text  # loading it needs a slot
        busy_model = state.models[result(alice, created.json()["request_id"])["model_id"]]
        busy_model.busy += 1  # a request of it still running when its session finishes
        assert alice.post(f"/api/v1/sessions/{other}/finish").status_code == 200
        time.sleep(0.3)
        assert busy_model.loaded  # not under the running request
        busy_model.busy -= 1
        deadline = time.time() + 10
        while busy_model.loaded or busy_model.releasing:  # once it is done: released
            assert time.time() < deadline, "the busy adapter of a finished session was never released"
            time.sleep(0.05)


def test_a_released_adapter_waits_for_a_free_slot(server: Running, alice_model: tuple[str, str]) -> None:
    state = server.state
    _, model_id = alice_model
    model = state.models[model_id]  # type: ignore[attr-defined]
    assert state.adapters.release(model)  # type: ignore[attr-defined]
    state.limits = replace(state.limits, adapters_total=state.adapters.occupied())  # type: ignore[attr-defined]
    with server.client(ALICE) as alice:
        full = alice.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 1, "adam_params": {}})
        assert full.status_code == 429 and "adapters_total=" in full.text and model_id in full.text


def test_tokens_per_second_is_a_429_naming_it_and_metrics_have_queue_time(
    server: Running, alice_model: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="posttrain.serve")
    state = server.state
    session_id, model_id = alice_model
    state.limits = replace(state.limits, tokens_per_second=2.0)  # type: ignore[attr-defined]
    with server.client(ALICE) as alice:
        result(
            alice, training(alice, model_id, 1, "forward")
        )  # 5 tokens: through on a full bucket, now in debt
        with pytest.raises(AssertionError, match=r"limit tokens_per_second=2 reached"):
            training(alice, model_id, 2, "forward")
        assert alice.post(f"/api/v1/sessions/{session_id}/finish").status_code == 200
    metrics = server.client(ALICE).get("/metrics").text
    assert (
        'posttrain_requests_total{tenant="alice",endpoint="/api/v1/forward_backward",status="429"}' in metrics
    )
    assert 'endpoint="/api/v1/sessions/{session_id}/finish"' in metrics  # the route, not one series per id
    assert session_id not in metrics
    assert 'posttrain_queue_seconds_count{tenant="alice"}' in metrics
    assert "posttrain_adapters_loaded " in metrics
    # one log line per request: method, path, status, time, tenant
    lines = [r.getMessage() for r in caplog.records if "/api/v1/forward_backward 429" in r.getMessage()]
    assert lines and re.fullmatch(r"POST /api/v1/forward_backward 429 [0-9.]+ms tenant=alice", lines[0])


class HeldCallbacks(concurrent.futures.Future[Any]):
    """A gate whose callbacks, registered before it resolved, run only when told: as when the loading thread
    has resolved it but not yet run them, while a later request finds it done."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[Callable[[concurrent.futures.Future[Any]], object]] = []

    def add_done_callback(self, fn: Callable[[concurrent.futures.Future[Any]], object]) -> None:
        if self.done():
            fn(self)
        else:
            self.held.append(fn)


def test_a_models_requests_start_in_order_even_when_a_later_one_sees_the_adapter_ready_first() -> None:
    adapters = Adapters(cast(Any, None))  # no state needed: the adapter is loaded by the test
    gate = HeldCallbacks()
    model = TrainingModel("s:train:0", "alice", "tiny", {}, "backend-id", gate=gate)
    started: list[tuple[int, str]] = []

    def start(n: int) -> Callable[[Any], concurrent.futures.Future[Any]]:
        return lambda client: started.append((n, client)) or resolved(n)  # type: ignore[func-returns-value]

    first = adapters.run(model, start(1))  # waits for the adapter
    gate.set_result("client")  # loaded; the first request's callback not yet run
    second = adapters.run(model, start(2))  # sees the gate done
    assert (first.result(10), second.result(10)) == (1, 2)
    assert started == [(1, "client"), (2, "client")]  # the first started first
    for callback in gate.held:  # the late callback finds nothing left to start
        callback(gate)
    adapters._starter.submit(lambda: None).result(10)
    assert started == [(1, "client"), (2, "client")] and model.busy == 0


def test_a_checkpoint_saved_with_a_ttl_expires_unless_it_is_the_restore_point(
    server: Running, alice_model: tuple[str, str]
) -> None:
    state: Any = server.state
    _, model_id = alice_model
    with server.client(ALICE) as alice:

        def save(seq_id: int, name: str, ttl: int | None) -> str:
            body = {"model_id": model_id, "seq_id": seq_id, "path": name, "ttl_seconds": ttl}
            return str(
                result(alice, alice.post("/api/v1/save_weights", json=body).json()["request_id"])["path"]
            )

        first = save(1, "ttl-first", 1)
        sampler = {"model_id": model_id, "seq_id": 2, "path": "ttl-sampler", "ttl_seconds": 1}
        for_sampler = result(
            alice, alice.post("/api/v1/save_weights_for_sampler", json=sampler).json()["request_id"]
        )
        run_id = first.split("/")[2]
        listed = alice.get(f"/api/v1/training_runs/{run_id}/checkpoints").json()["checkpoints"]
        assert all(c["expires_at"] for c in listed if "ttl-" in c["tinker_path"])
        time.sleep(1.1)

        def listed_paths() -> list[str]:
            got = alice.get(f"/api/v1/training_runs/{run_id}/checkpoints").json()["checkpoints"]
            return [c["tinker_path"] for c in got]

        # asserted on what is left, not on which call deleted it: the server's own minute-by-minute upkeep
        # may expire them between the sleep and this call
        state.adapters.expire()
        assert first in listed_paths(), "the restore point (first) stays"
        assert for_sampler["path"] not in listed_paths()
        second = save(3, "ttl-second", None)  # the model's restore point moves on: the first may go now
        state.adapters.expire()
        paths = listed_paths()
        assert second in paths and first not in paths and for_sampler["path"] not in paths
        refused = alice.post(
            "/api/v1/save_weights", json={"model_id": model_id, "seq_id": 4, "path": "x", "ttl_seconds": 0}
        )
        assert "ttl_seconds must be > 0" in str(result(alice, refused.json()["request_id"]))
