"""Requests that used to slip through: a refused create_model that created the model anyway, a sample
without max_tokens counted as one token, a save that replaced a checkpoint without overwrite, negative image
sizes, token ids outside the vocabulary, names ending in a newline, a queue limit that refused the very
request its parked ones waited for, and a graceful stop that skipped a busy adapter."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from tinker.proto import tinker_public_pb2 as pb

from posttrain.serve.limits import Limits
from posttrain.serve.server import build_state
from posttrain.serve.tenants import ApiKeys

from .conftest import KEYS, SESSION, Running, forward_backward_message, result, serve_in_thread, training

ALICE, BOB = list(KEYS)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    """A server of this module's own: its tests leave models and a parked request behind, which would count
    against the session server's per-tenant limits in the other modules."""
    state = build_state(
        str(tiny_model_dir), "tiny", ApiKeys(KEYS), str(tmp_path_factory.mktemp("serve")), poll_timeout_s=5,
        limits=Limits(adapters_per_tenant=32, adapters_total=64),
    )  # fmt: skip
    yield from serve_in_thread(state, "tiny")


@pytest.fixture
def alice(server: Running) -> Iterator[tuple[httpx.Client, str]]:
    """Alice's client and a fresh session of hers; the server's limits are put back after the test."""
    saved = server.state.limits  # type: ignore[attr-defined]
    with server.client(ALICE) as client:
        yield client, client.post("/api/v1/create_session", json=SESSION).json()["session_id"]
    server.state.limits = saved  # type: ignore[attr-defined]


def create(client: httpx.Client, session_id: str, seq: int) -> httpx.Response:
    body = {"session_id": session_id, "model_seq_id": seq, "base_model": "tiny", "lora_config": {"rank": 2}}
    return client.post("/api/v1/create_model", json=body)


def new_model(client: httpx.Client, session_id: str, seq: int) -> str:
    answer = create(client, session_id, seq)
    assert answer.status_code == 200, answer.text
    return str(result(client, answer.json()["request_id"])["model_id"])


def forward_backward(client: httpx.Client, message: Any) -> httpx.Response:
    return client.post(
        "/api/v1/forward_backward",
        content=message.SerializeToString(),
        headers={"content-type": "application/x-protobuf"},
    )


def test_a_create_model_refused_by_a_limit_creates_nothing_and_a_repeat_is_the_same_request(
    server: Running, alice: tuple[httpx.Client, str]
) -> None:
    client, session_id = alice
    state = server.state
    model_id = new_model(client, session_id, 0)
    parked = {"model_id": model_id, "seq_id": 5, "adam_params": {"learning_rate": 1e-3}}
    assert client.post("/api/v1/optim_step", json=parked).status_code == 200  # waits for seq_ids 1-4
    state.limits = replace(state.limits, queued_requests=1)  # type: ignore[attr-defined]
    refused = create(client, session_id, 1)
    assert refused.status_code == 429 and "queued_requests=1" in refused.text
    second = f"{session_id}:train:1"
    assert second not in state.models and second not in state.creating  # type: ignore[attr-defined]
    state.limits = replace(state.limits, queued_requests=64)  # type: ignore[attr-defined]
    first = create(client, session_id, 1)
    again = create(client, session_id, 1)  # the SDK's retry of a lost answer: same session and model_seq_id
    assert first.status_code == again.status_code == 200
    assert again.json()["request_id"] == first.json()["request_id"]
    assert result(client, first.json()["request_id"])["model_id"] == second
    with server.client(BOB) as bob:  # another tenant cannot take the model over by naming it
        assert create(bob, session_id, 1).status_code in (403, 404)


def test_the_request_a_model_waits_for_is_never_refused_by_the_queue_limit(
    server: Running, alice: tuple[httpx.Client, str]
) -> None:
    client, session_id = alice
    model_id = new_model(client, session_id, 0)
    later = training(client, model_id, 2, "forward")  # parked: seq_id 1 has not come
    server.state.limits = replace(server.state.limits, queued_requests=1)  # type: ignore[attr-defined]
    too_many = client.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 3, "adam_params": {}})
    assert too_many.status_code == 429
    first = training(client, model_id, 1, "forward")  # the gap: accepted, and the parked one runs after it
    for request_id in (first, later):
        assert isinstance(result(client, request_id), bytes)


def test_a_sample_without_max_tokens_counts_what_the_context_leaves(
    server: Running, alice: tuple[httpx.Client, str]
) -> None:
    client, session_id = alice
    server.state.limits = replace(server.state.limits, tokens_per_request=50)  # type: ignore[attr-defined]
    body = {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": "tiny"}
    sampler = client.post("/api/v1/create_sampling_session", json=body).json()["sampling_session_id"]
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7, 8, 9]}]}

    def sample(params: dict) -> httpx.Response:
        ask = {"sampling_session_id": sampler, "num_samples": 2, "prompt": prompt, "sampling_params": params}
        return client.post("/api/v1/asample", json=ask)

    assert sample({"max_tokens": 10}).status_code == 200
    unbounded = sample({"temperature": 1.0})  # up to the 1024-position context each: far over 50
    assert unbounded.status_code == 413 and "tokens_per_request=50" in unbounded.text
    # tinker's stable_reinforce asks samples for stability info: refused at the first sample (it was
    # accepted and ignored, and the loss failed at the first update, after a whole batch of rollouts)
    stable = {
        "sampling_session_id": sampler,
        "num_samples": 1,
        "prompt": prompt,
        "record_stability_info": True,
    }
    refused = client.post("/api/v1/asample", json={**stable, "sampling_params": {"max_tokens": 2}})
    assert refused.status_code == 400 and "stable_reinforce" in refused.text


def test_save_state_replaces_a_checkpoint_only_with_overwrite(
    server: Running, alice: tuple[httpx.Client, str]
) -> None:
    client, session_id = alice
    model_id = new_model(client, session_id, 0)

    def save(seq_id: int, **extra: Any) -> dict:
        body = {"model_id": model_id, "seq_id": seq_id, "path": "kept", **extra}
        return result(client, client.post("/api/v1/save_weights", json=body).json()["request_id"])

    assert save(1)["path"].endswith("/weights/kept")
    refused = save(2)
    assert refused["category"] == "user" and "exists already: pass overwrite=True" in refused["error"]
    assert save(3, overwrite=True)["path"].endswith("/weights/kept")


def test_checkpoint_names_ending_in_a_newline_are_refused(
    server: Running, alice: tuple[httpx.Client, str]
) -> None:
    client, session_id = alice
    model_id = new_model(client, session_id, 0)
    body = {"model_id": model_id, "seq_id": 1, "path": "ck\n"}
    answer = result(client, client.post("/api/v1/save_weights", json=body).json()["request_id"])
    assert answer["category"] == "user" and "ck\\n" in answer["error"]


def test_token_ids_outside_the_vocabulary_are_the_requests_error(
    server: Running, alice: tuple[httpx.Client, str]
) -> None:
    client, session_id = alice
    model_id = new_model(client, session_id, 0)
    cases = [
        (
            [5, 2**31 - 1, 7],
            [6, 7, 8],
            "datum 0: token id 2147483647 at position 1 is outside the model's vocabulary",
        ),
        ([5, -3, 7], [6, 7, 8], "token id -3 at position 1"),
        ([5, 6, 7], [6, 10**9, 8], "datum 0: target_tokens: token id 1000000000 at position 1"),
    ]
    for seq_id, (tokens, targets, message) in enumerate(cases, start=1):
        sent = forward_backward(client, forward_backward_message(model_id, seq_id, tokens, targets))
        answer = result(client, sent.json()["request_id"])
        assert answer["category"] == "user" and message in answer["error"], answer
    # and the model goes on
    assert isinstance(result(client, training(client, model_id, len(cases) + 1, "forward")), bytes)


def test_a_negative_image_size_is_a_400_naming_the_chunk(
    server: Running, alice: tuple[httpx.Client, str]
) -> None:
    client, session_id = alice
    model_id = new_model(client, session_id, 0)
    message = forward_backward_message(model_id, 1, [5] * 8, [5] * 8)
    message.data[0].model_input.add().image.CopyFrom(
        pb.ImageChunk(data=b"x", format="png", expected_tokens=-100)
    )
    answer = forward_backward(client, message)
    assert answer.status_code == 400 and "datum 0: chunk 1: expected_tokens=-100 is negative" in answer.text


def test_a_stop_saves_an_adapter_whose_request_still_runs(
    server: Running, alice: tuple[httpx.Client, str]
) -> None:
    """What a graceful stop does for every loaded adapter (release_all): one with a request still running
    is saved after it, not skipped (its unsaved steps were lost, or the whole model when it had no save)."""
    client, session_id = alice
    model_id = new_model(client, session_id, 0)
    assert isinstance(result(client, training(client, model_id, 1, "forward_backward")), dict | bytes)
    state = server.state
    model = state.models[model_id]  # type: ignore[attr-defined]
    model.busy += 1  # a request that outlived the grace time (answered as failed, still running)
    try:
        assert not state.adapters.release(model)  # type: ignore[attr-defined]  # an idle sweep skips it
        assert state.adapters.release(model, "the server stops", busy_too=True, wait_s=60)  # type: ignore[attr-defined]
    finally:
        model.busy -= 1
    assert not model.loaded and "posttrain-internal" in model.restore_path


def test_n_workers_without_ray_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    from posttrain.errors import ConfigError

    with pytest.raises(ConfigError, match="--n-workers 2 needs --backend ray"):
        build_state(str(tiny_model_dir), "tiny", ApiKeys(KEYS), str(tmp_path), n_workers=2)


def test_a_body_over_max_request_bytes_is_a_413_before_it_is_read(
    server: Running, alice: tuple[httpx.Client, str]
) -> None:
    client, session_id = alice
    model_id = new_model(client, session_id, 0)
    server.state.limits = replace(server.state.limits, max_request_bytes=2000)  # type: ignore[attr-defined]
    big = forward_backward(
        client, forward_backward_message(model_id, 1, [5] * 1000, [5] * 1000)
    )  # declares its length
    assert big.status_code == 413 and "max_request_bytes=2000" in big.text

    def chunks() -> Iterator[bytes]:  # chunked: no length declared, refused once the bytes read pass it
        yield b'{"model_id": "' + model_id.encode() + b'", "seq_id": 1, "path": "'
        for _ in range(10):
            yield b"x" * 500

    streamed = client.post(
        "/api/v1/save_weights", content=chunks(), headers={"content-type": "application/json"}
    )
    assert streamed.status_code == 413 and "max_request_bytes=2000" in streamed.text
    small = forward_backward(client, forward_backward_message(model_id, 1, [5] * 8, [5] * 8))
    assert small.status_code == 200


def test_an_optimizer_the_server_lacks_is_refused_when_the_model_is_made(
    server: Running, alice: tuple[httpx.Client, str]
) -> None:
    """Not at the first optim_step, after gradients were computed: the model's optimizer is fixed for life."""
    client, session_id = alice
    body = {
        "session_id": session_id, "model_seq_id": 90, "base_model": "tiny", "lora_config": {"rank": 2},
        "optimizer_config": {"type": "dimuon", "version": 1},
    }  # fmt: skip
    refused = client.post("/api/v1/create_model", json=body)
    assert refused.status_code == 400 and "dimuon" in refused.text and "AdamW" in refused.text
    body["optimizer_config"] = {"type": "adamw"}
    assert client.post("/api/v1/create_model", json=body).status_code == 200
