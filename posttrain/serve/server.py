"""Run the server: a ServiceClient on the served model, the app, uvicorn on 127.0.0.1 (unless told)."""

from __future__ import annotations

import logging
from pathlib import Path

import uvicorn

from posttrain.client import ServiceClient
from posttrain.errors import ConfigError
from posttrain.serve.app import ServerState, make_app
from posttrain.serve.limits import Limits
from posttrain.serve.tenants import ApiKeys

log = logging.getLogger("posttrain.serve")


def build_state(
    model_dir: str,
    model_name: str | None,
    keys: ApiKeys,
    root_dir: str,
    backend: str = "local",
    n_workers: int = 1,
    poll_timeout_s: float = 20.0,
    limits: Limits | None = None,
) -> ServerState:
    path = Path(model_dir)
    if not (path / "config.json").exists():
        raise ConfigError(f"--model {model_dir}: not a Hugging Face model directory (no config.json)")
    name = model_name or path.name
    extra = {"n_workers": n_workers, "device": "cpu"} if backend == "ray" else {}
    service = ServiceClient(backend, root_dir=root_dir, base_models=[str(path.resolve())], **extra)  # type: ignore[arg-type]
    return ServerState(
        service, keys, {name: str(path.resolve())}, poll_timeout_s=poll_timeout_s, limits=limits or Limits()
    )


def serve(
    model_dir: str,
    *,
    model_name: str | None = None,
    keys_file: str | None = None,
    root_dir: str = "serve-state",
    host: str = "127.0.0.1",
    port: int = 8000,
    backend: str = "local",
    n_workers: int = 1,
) -> None:
    state = build_state(model_dir, model_name, ApiKeys.load(keys_file), root_dir, backend, n_workers)
    log.warning("serving %s as %r on http://%s:%d", model_dir, next(iter(state.served)), host, port)
    try:
        # uvicorn handles SIGTERM/SIGINT: it stops accepting, finishes the requests in flight, then returns
        uvicorn.run(make_app(state), host=host, port=port, log_level="warning")
    finally:
        state.service.close()
