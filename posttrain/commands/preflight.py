"""Checks the CLI runs before a command starts its slow work, so a Ray cluster that is not there or a port that
is taken fails in a second with what to do, instead of after loading a model (uvicorn's bind error) or
after Ray's own connection retries. No Ray import: a TCP connect is enough to know whether anyone answers.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

from posttrain.errors import ConfigError

CONNECT_TIMEOUT_S = 3.0


def check_port_free(host: str, port: int) -> None:
    """ConfigError naming the port and the fix when `host:port` cannot be bound (in use, or not allowed)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(
            socket.SOL_SOCKET, socket.SO_REUSEADDR, 1
        )  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"port {port} on {host} is in use (another `posttrain serve`?): pass --port with a free "
                    f"port, or stop the process holding it (`ss -ltnp 'sport = :{port}'` shows it)"
                ) from None
            raise ConfigError(
                f"cannot listen on {host}:{port} ({exc.strerror}): pass another --host/--port"
            ) from None


def check_ray_address(address: str) -> None:
    """ConfigError when `ray.address` names a cluster that does not answer (empty = a local instance: fine)."""
    if not address:
        return
    target = address.removeprefix("ray://")
    if target == "auto":
        target = os.environ.get("RAY_ADDRESS", "") or _current_cluster()
        if not target:
            raise ConfigError(
                "ray.address=auto: no running Ray cluster found on this machine: start one with "
                "`ray start --head`, give its address (ray.address=HOST:6379), or leave ray.address empty to "
                "start a local instance"
            )
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"ray.address={address!r} is not HOST:PORT (e.g. 10.0.0.1:6379), 'auto' or empty")
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(
            f"ray.address={address}: no Ray cluster answers at {host}:{port} ({reason}): start it with "
            f"`ray start --head --port={port}` on that node (and check the firewall), or leave ray.address "
            "empty to start a local instance"
        ) from None


def _current_cluster() -> str:
    """The address `ray start` recorded for `auto` on this machine, or ""."""
    record = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray" / "ray_current_cluster"
    return record.read_text().strip() if record.is_file() else ""
