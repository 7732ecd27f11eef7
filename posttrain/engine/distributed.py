"""torch.distributed set-up for one SPMD rank: gloo on CPU, nccl on CUDA; world size 1 is the same path."""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from posttrain.errors import ConfigError


@dataclass(frozen=True)
class DistInfo:
    """Where this rank sits in its group and how to reach the group's rendezvous (loopback by default)."""

    rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0 = pick a free port (world size 1 only)
    device: str = "auto"  # auto | cpu | cuda
    timeout_s: float = 600.0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def loopback_interface() -> str | None:
    """The name of this host's loopback network interface (`lo` on Linux, `lo0` on macOS), if it has one."""
    names = {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    return next((name for name in ("lo", "lo0") if name in names), None)


def keep_on_loopback(master_addr: str) -> None:
    """A group whose rendezvous is on 127.0.0.1 (one machine) keeps its collective traffic there too: gloo and
    NCCL otherwise bind to the address the hostname resolves to, often the machine's LAN address. An
    interface the user chose (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME) is kept."""
    if not master_addr.startswith("127."):
        return
    interface = loopback_interface()
    if interface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)


def resolve_device(device: str) -> torch.device:
    """`auto` is cuda when available, else cpu; asking for cuda without one is an error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is available; use cpu or auto")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"unknown device '{device}'; valid: auto, cpu, cuda")
    return torch.device(device)


def init_distributed(info: DistInfo) -> tuple[DeviceMesh, torch.device]:
    """Join (or reuse) the default process group and return a 1-D data-parallel mesh and this rank's device."""
    device = resolve_device(info.device)
    if device.type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    if not dist.is_initialized():
        port = info.master_port or free_port(info.master_addr)
        backend = "nccl" if device.type == "cuda" else "gloo"
        keep_on_loopback(info.master_addr)
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{info.master_addr}:{port}",
            rank=info.rank,
            world_size=info.world_size,
            timeout=datetime.timedelta(seconds=info.timeout_s),
        )
    elif dist.get_world_size() != info.world_size:
        raise ConfigError(
            f"a process group of world size {dist.get_world_size()} already exists in this process; "
            f"cannot join one of world size {info.world_size}"
        )
    mesh = init_device_mesh(device.type, (info.world_size,), mesh_dim_names=("dp",))
    return mesh, device


def shutdown_distributed() -> None:
    """Leave the default process group cleanly: wait for every rank, then destroy it. A process that exits
    with the group still alive can abort in gloo's teardown ("terminate called without an active
    exception") while a peer is still using it, so a rank that spawned its own group ends with this."""
    if not dist.is_initialized():
        return
    dist.barrier()
    dist.destroy_process_group()


@torch.no_grad()
def broadcast_from_rank0(params: Iterable[torch.nn.Parameter]) -> None:
    """Rank 0's values of `params` on every rank (a collective: every rank passes the same parameters in the
    same order); nothing to do on one rank or without a process group. For weights a rank draws itself
    (a fresh head, LoRA adapters) before FSDP shards them: each rank keeps its shard of its own copy, so
    without this the sharded weights would be a mix of the ranks' draws."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    for param in params:
        dist.broadcast(param.data, src=0)


def same_head_on_every_rank(model: torch.nn.Module) -> None:
    """Rank 0's task head (every parameter outside the backbone `model.base_model_prefix`, e.g. a critic's
    freshly initialised `score`) on every rank. Each rank seeds its own stream before loading
    (workers.process.rank_seed), so a head missing from the checkpoint is drawn differently on each rank;
    the backbone is loaded from the same files everywhere. (A (1, hidden) head lands whole on rank 0 under
    FSDP's dim-0 sharding; this makes any head shape safe.)"""
    prefix = getattr(model, "base_model_prefix", "") + "."
    broadcast_from_rank0(p for name, p in model.named_parameters() if not name.startswith(prefix))
