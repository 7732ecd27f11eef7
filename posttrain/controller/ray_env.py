"""Start or join Ray. The local mode (no address) is loopback-only: nothing listens beyond 127.0.0.1."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from posttrain.errors import ConfigError

log = logging.getLogger(__name__)


def loopback_env(tmpdir: str | Path) -> dict[str, str]:
    """Environment that makes a local Ray head and its nodes bind to 127.0.0.1 and keep files in `tmpdir`."""
    return {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_TMPDIR": str(tmpdir),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
    }


def start_ray(address: str = "", num_cpus: int = 0, tmpdir: str | Path = "") -> None:
    """Join `address` (e.g. "auto" for a cluster started with `ray start`) or start a loopback-only local Ray.

    Calling it again in the same process reuses the running instance (tests start Ray once per session).
    Ray reads its loopback switch when it is imported, so the environment is set before `import ray`.
    """
    if not address:
        tmp = Path(tmpdir or Path(tempfile.gettempdir()) / f"posttrain-ray-{os.getuid()}").resolve()
        # Unix socket paths are limited to ~107 bytes; Ray puts its sockets under RAY_TMPDIR.
        if len(str(tmp)) > 60:
            raise ConfigError(
                f"ray.tmpdir '{tmp}' is too long for Ray's socket paths (keep it under 60 characters)"
            )
        tmp.mkdir(parents=True, exist_ok=True)
        os.environ.update(loopback_env(tmp))
    import ray

    if ray.is_initialized():
        if not address:  # Ray already running in this process: local mode still means loopback only
            check_loopback(started_here=False)
        return
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    ray.init(  # address="local": a new Ray whatever RAY_ADDRESS says (a user's cluster is ray.address's)
        address="local",
        num_cpus=num_cpus or os.cpu_count(),
        include_dashboard=False,
        log_to_driver=True,
        _temp_dir=str(tmp),
    )
    check_loopback(started_here=True)
    log.info("started local Ray (loopback only) in %s", tmp)


def check_loopback(started_here: bool) -> None:
    """Refuse a local-mode run on a Ray whose nodes listen beyond 127.0.0.1 (shut down if started here)."""
    import ray

    nodes = node_addresses()
    if all(ip == "127.0.0.1" for ip in nodes):
        return
    if started_here:
        ray.shutdown()
        raise ConfigError(
            f"local Ray bound to {nodes}, not 127.0.0.1: Ray was imported before posttrain could set "
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0; set it in the environment, or give ray.address"
        )
    raise ConfigError(
        f"Ray is already running in this process with nodes on {nodes}, not 127.0.0.1 only: local mode (no "
        "ray.address) is loopback-only; give ray.address to use that cluster, or stop it first"
    )


def node_addresses() -> list[str]:
    import ray

    return [n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")]


def cluster_has_gpus() -> bool:
    import ray

    return bool(ray.cluster_resources().get("GPU", 0) > 0)


def stop_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


def ray_is_running() -> bool:
    """Whether this process is connected to Ray (without importing Ray when it is not loaded)."""
    import sys

    return "ray" in sys.modules and sys.modules["ray"].is_initialized()
