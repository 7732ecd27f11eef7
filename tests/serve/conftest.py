"""A `posttrain serve` app on 127.0.0.1 in a thread (uvicorn), with two tenants, for the session."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from posttrain.serve.app import make_app
from posttrain.serve.limits import Limits
from posttrain.serve.server import build_state
from posttrain.serve.tenants import ApiKeys

SESSION = {"tags": [], "user_metadata": None, "sdk_version": "test"}  # a create_session body
KEYS = {"tml-alice-0123456789abcdef": "alice", "tml-bob-0123456789abcdefgh": "bob"}
FUZZER = {
    "tml-fuzz-0123456789abcdefgh": "fuzzer"
}  # test_schema's tenant: what it sends fills no one else's queue
PROMPT, TARGET = [5, 6, 7, 8, 9], [6, 7, 8, 9, 10]  # one datum of the training helpers below


@dataclass
class Running:
    url: str
    state: object
    model_name: str

    def client(self, key: str | None) -> httpx.Client:
        headers = {"X-API-Key": key} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_in_thread(state: Any, model_name: str) -> Iterator[Running]:
    """`state` served by uvicorn on a free loopback port in a thread, until the generator is closed."""
    port = free_port()
    config = uvicorn.Config(make_app(state), host="127.0.0.1", port=port, log_level="warning")
    running = uvicorn.Server(config)
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not running.started:
        assert time.time() < deadline, "the server did not start"
        time.sleep(0.05)
    yield Running(f"http://127.0.0.1:{port}", state, model_name)
    state.begin_stop()
    running.should_exit = True
    thread.join(timeout=30)
    state.service.close()


@pytest.fixture(scope="session")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    state = build_state(
        str(tiny_model_dir),
        "tiny",
        ApiKeys({**KEYS, **FUZZER}),
        str(tmp_path_factory.mktemp("serve")),
        poll_timeout_s=5,
        limits=Limits(adapters_per_tenant=48, adapters_total=96),  # the session's tests share the server
    )
    yield from serve_in_thread(state, "tiny")


@pytest.fixture(scope="session")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny-vl preset for the image tests (test_http_images, test_sdk_images)."""
    from posttrain.data.tasks.shapes import corpus
    from posttrain.models import make_tiny_model

    return make_tiny_model("tiny-vl", tmp_path_factory.mktemp("vl") / "model", corpus(500), seed=0)


@pytest.fixture(scope="module")
def vl_server(vl_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    """A server of tiny-vl for one test module."""
    state = build_state(
        str(vl_dir), "tiny-vl", ApiKeys(KEYS), str(tmp_path_factory.mktemp("serve")), poll_timeout_s=5
    )
    yield from serve_in_thread(state, "tiny-vl")


# ---- requests by hand (httpx), for the tests that look at the protocol itself ------------------------
def result(client: httpx.Client, request_id: str) -> Any:
    """A request's answer: the JSON body, or the protobuf bytes."""
    for _ in range(200):
        answer = client.post("/api/v1/retrieve_future", json={"request_id": request_id})
        assert answer.status_code == 200, answer.text
        if answer.headers["content-type"] == "application/x-protobuf":
            return answer.content
        if answer.json().get("type") != "try_again":
            return answer.json()
    raise AssertionError(f"{request_id} never finished")


def forward_backward_message(model_id: str, seq_id: int, tokens: list[int], targets: list[int]) -> Any:
    """The protobuf body of a cross-entropy forward_backward of one datum, as the SDK sends it."""
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": targets, "weights": [1.0] * len(targets)},
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"),
        model_id=model_id,
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(request)


def training(client: httpx.Client, model_id: str, seq_id: int, verb: str) -> str:
    """Send a forward, forward_backward or optim_step; its request id."""
    if verb == "optim_step":
        step = {"model_id": model_id, "seq_id": seq_id, "adam_params": {"learning_rate": 0.05}}
        answer = client.post("/api/v1/optim_step", json=step)
    else:
        message = forward_backward_message(model_id, seq_id, PROMPT, TARGET)
        message.forward_only = verb == "forward"
        answer = client.post(
            "/api/v1/forward_backward",
            content=message.SerializeToString(),
            headers={"content-type": "application/x-protobuf"},
        )
    assert answer.status_code == 200, answer.text
    return answer.json()["request_id"]


def logprobs(answer: bytes) -> list[float]:
    assert isinstance(answer, bytes), answer
    return deserialize_forward_backward_output(answer).loss_fn_outputs[0]["logprobs"].tolist()
