"""Sessions end: by the client's /finish or for want of heartbeats, and what names an ended one gets a 410
(the SDK's heartbeat loop stops on it). A retried `asample` (same sampling session and seq_id) is the first
request, sampled and charged once, also after a restart. /metrics shows a tenant's key its own series."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from posttrain.serve.futures import Sequencer
from posttrain.serve.journal import Journal

from .conftest import KEYS, SESSION, Running, result

ALICE, BOB = list(KEYS)
PROMPT = {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7, 8, 9]}]}


@pytest.fixture
def alice(server: Running) -> Iterator[tuple[httpx.Client, str, str]]:
    """Alice's client, a fresh session of hers and a sampling session on the base model in it."""
    with server.client(ALICE) as client:
        session_id = client.post("/api/v1/create_session", json=SESSION).json()["session_id"]
        body = {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": "tiny"}
        sampler = client.post("/api/v1/create_sampling_session", json=body).json()["sampling_session_id"]
        yield client, session_id, sampler


def asample(client: httpx.Client, sampler: str, seq_id: int | None) -> httpx.Response:
    body = {
        "sampling_session_id": sampler, "seq_id": seq_id, "num_samples": 2, "prompt": PROMPT,
        "sampling_params": {"max_tokens": 3, "temperature": 1.0},
    }  # fmt: skip
    return client.post("/api/v1/asample", json=body)


def heartbeat(client: httpx.Client, session_id: str) -> httpx.Response:
    return client.post(
        "/api/v1/session_heartbeat", json={"session_id": session_id, "type": "session_heartbeat"}
    )


def test_a_retried_asample_is_sampled_and_charged_once(
    server: Running, alice: tuple[httpx.Client, str, str]
) -> None:
    client, _, sampler = alice
    tokens = server.state.meter.tokens  # type: ignore[attr-defined]
    before = tokens["alice"]
    first = asample(client, sampler, seq_id=1)
    assert first.status_code == 200, first.text
    charged = tokens["alice"] - before
    assert charged == 5 + 2 * 3  # the prompt and two samples of at most 3 tokens
    again = asample(client, sampler, seq_id=1)
    assert again.json() == first.json()  # the same request id and sequence ids
    assert tokens["alice"] - before == charged  # not charged twice
    other = asample(client, sampler, seq_id=2)
    assert other.json()["request_id"] != first.json()["request_id"]
    unnumbered = [asample(client, sampler, seq_id=None).json()["request_id"] for _ in range(2)]
    assert unnumbered[0] != unnumbered[1]  # without a seq_id each request is its own
    for request_id in (first.json()["request_id"], other.json()["request_id"], *unnumbered):
        assert isinstance(result(client, request_id), bytes)
    assert asample(client, sampler, seq_id=-1).status_code == 400


def test_a_finished_session_is_410_and_its_samplers_are_released(
    server: Running, alice: tuple[httpx.Client, str, str]
) -> None:
    client, session_id, sampler = alice
    assert heartbeat(client, session_id).status_code == 200
    with server.client(BOB) as bob:
        assert heartbeat(bob, session_id).status_code == 404  # not bob's: not even its end is told
        assert bob.post(f"/api/v1/sessions/{session_id}/finish").status_code == 404
    assert client.post(f"/api/v1/sessions/{session_id}/finish").status_code == 200
    # finishing it again (the SDK's close() after an expiry, or twice) answers as the first time
    assert client.post(f"/api/v1/sessions/{session_id}/finish").status_code == 200
    with server.client(BOB) as bob:
        assert bob.post(f"/api/v1/sessions/{session_id}/finish").status_code == 404  # still not bob's
    gone = heartbeat(client, session_id)
    assert gone.status_code == 410 and "finished by its client" in gone.text
    again = {"session_id": session_id, "sampling_session_seq_id": 1, "base_model": "tiny"}
    assert client.post("/api/v1/create_sampling_session", json=again).status_code == 410
    released = asample(client, sampler, seq_id=1)
    assert released.status_code == 404 and "released" in released.text


def test_a_session_not_heard_from_expires(server: Running, alice: tuple[httpx.Client, str, str]) -> None:
    client, session_id, sampler = alice
    state = server.state
    idle = state.limits.session_idle_seconds  # type: ignore[attr-defined]
    assert idle > 0
    assert asample(client, sampler, seq_id=1).status_code == 200  # a request keeps the session alive
    assert time.monotonic() - state.session_heard[session_id] < idle  # type: ignore[attr-defined]
    state.session_heard[session_id] -= idle + 1  # type: ignore[attr-defined]  # as if not heard from since
    deadline = time.time() + 10
    while session_id in state.sessions:  # type: ignore[attr-defined]  # the server's upkeep ends it
        assert time.time() < deadline, "the idle session did not expire"
        time.sleep(0.05)
    gone = heartbeat(client, session_id)
    assert gone.status_code == 410 and f"session_idle_seconds={idle:g}" in gone.text
    assert asample(client, sampler, seq_id=2).status_code == 404


def test_metrics_need_a_key_and_show_its_own_tenant(
    server: Running, alice: tuple[httpx.Client, str, str]
) -> None:
    client, _, sampler = alice
    assert asample(client, sampler, seq_id=1).status_code == 200
    assert server.client(None).get("/metrics").status_code == 401
    mine = client.get("/metrics").text
    assert 'posttrain_tokens_total{tenant="alice"}' in mine and "posttrain_adapters_loaded " in mine
    with server.client(BOB) as bob:
        heartbeat(bob, "x")  # bob has made a request
        theirs = bob.get("/metrics").text
    assert 'tenant="alice"' not in theirs and 'tenant="bob"' in theirs
    server.state.public_metrics = True  # type: ignore[attr-defined]  # `posttrain serve --public-metrics`
    try:
        everyone = server.client(None).get("/metrics").text
    finally:
        server.state.public_metrics = False  # type: ignore[attr-defined]
    assert 'tenant="alice"' in everyone and 'tenant="bob"' in everyone


def test_sampling_seq_ids_and_finished_sessions_survive_a_restart(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "journal.sqlite3")
    Sequencer(journal).remember("s:sample:0", 1_000_000_001, "r1")
    journal.session("s", "alice")
    journal.session("t", "alice")
    journal.session_finished("s", "alice", "session 's' was finished by its client")
    journal.close()
    reopened = Journal(tmp_path / "journal.sqlite3")
    after = Sequencer(reopened)
    after.restore("s:sample:0", reopened.seqs()["s:sample:0"])
    assert after.seen("s:sample:0", 1_000_000_001) == "r1"
    assert reopened.sessions() == {"t": "alice"}
    assert reopened.finished_sessions() == {"s": ("alice", "session 's' was finished by its client")}
    reopened.close()
