"""A `posttrain serve` app on 127.0.0.1 in a thread (uvicorn), with two tenants, for the session."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn

from posttrain.serve.app import make_app
from posttrain.serve.limits import Limits
from posttrain.serve.server import build_state
from posttrain.serve.tenants import ApiKeys

SESSION = {"tags": [], "user_metadata": None, "sdk_version": "test"}  # a create_session body
KEYS = {"tml-alice-0123456789abcdef": "alice", "tml-bob-0123456789abcdefgh": "bob"}


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


@pytest.fixture(scope="session")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    state = build_state(
        str(tiny_model_dir),
        "tiny",
        ApiKeys(KEYS),
        str(tmp_path_factory.mktemp("serve")),
        poll_timeout_s=5,
        limits=Limits(adapters_per_tenant=16, adapters_total=32),  # the session's tests share the server
    )
    port = free_port()
    config = uvicorn.Config(make_app(state), host="127.0.0.1", port=port, log_level="warning")
    running = uvicorn.Server(config)
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not running.started:
        assert time.time() < deadline, "the server did not start"
        time.sleep(0.05)
    yield Running(f"http://127.0.0.1:{port}", state, "tiny")
    running.should_exit = True
    thread.join(timeout=30)
    state.service.close()
