"""Run the server: a ServiceClient on the served model, its state recovered from the journal in the state
folder, the app, uvicorn on 127.0.0.1 (unless told). SIGTERM or SIGINT stops it gracefully (lifecycle.py)
and the process exits with status 0."""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from types import FrameType

import uvicorn

from posttrain.client import ServiceClient
from posttrain.errors import ConfigError
from posttrain.serve.app import make_app
from posttrain.serve.config import load_limits
from posttrain.serve.limits import Limits
from posttrain.serve.recovery import recover
from posttrain.serve.state import ServerState
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
    tokenizer_id: str | None = None,
    public_metrics: bool = False,
) -> ServerState:
    """The server's state on a new backend, with what the journal in `root_dir` remembers. `tokenizer_id`
    is what `get_info` tells clients to load the tokenizer from (default: the model directory, which only
    loads on this machine; a hub id such as "Qwen/Qwen2.5-0.5B" loads anywhere)."""
    path = Path(model_dir)
    if not (path / "config.json").exists():
        raise ConfigError(f"--model {model_dir}: not a Hugging Face model directory (no config.json)")
    name = model_name or path.name
    if backend != "ray" and n_workers != 1:
        raise ConfigError(
            f"--n-workers {n_workers} needs --backend ray (the local backend is one in-process worker)"
        )
    extra = {"n_workers": n_workers, "device": "cpu"} if backend == "ray" else {}
    service = ServiceClient(backend, root_dir=root_dir, base_models=[str(path.resolve())], **extra)  # type: ignore[arg-type]
    if tokenizer_id is not None and not tokenizer_id.strip():
        raise ConfigError("--tokenizer-id is empty: give a hub id or a directory, or leave it out")
    state = ServerState(
        service, keys, {name: str(path.resolve())}, poll_timeout_s=poll_timeout_s, limits=limits or Limits(),
        tokenizer_ids={name: tokenizer_id} if tokenizer_id else {}, public_metrics=public_metrics,
    )  # fmt: skip
    recover(state)
    return state


class _Server(uvicorn.Server):
    """uvicorn's server, telling the state when a stop begins (so long polls end at once)."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.state.begin_stop()
        super().handle_exit(sig, frame)


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
    config: str | None = None,
    tokenizer_id: str | None = None,
    public_metrics: bool = False,
) -> None:
    limits = load_limits(config) if config else Limits()
    keys = ApiKeys.load(keys_file)
    state = build_state(
        model_dir,
        model_name,
        keys,
        root_dir,
        backend,
        n_workers,
        limits=limits,
        tokenizer_id=tokenizer_id,
        public_metrics=public_metrics,
    )
    log.warning("serving %s as %r on http://%s:%d", model_dir, next(iter(state.served)), host, port)
    grace = limits.shutdown_grace_seconds
    server = _Server(
        uvicorn.Config(
            make_app(state),
            host=host,
            port=port,
            log_level="warning",
            timeout_graceful_shutdown=int(grace) + 1,
        ),
        state,
    )
    # uvicorn re-raises the stop signal once it is done, to the handler in place before it: these make that
    # a no-op, so the stop ends here and the process exits 0
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()  # the app's lifespan ends with the graceful stop (lifecycle.shut_down)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        state.service.close()
    log.warning("stopped")
