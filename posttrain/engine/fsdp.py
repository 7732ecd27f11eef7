"""Apply FSDP2 (`fully_shard`) to any Hugging Face causal LM: each decoder layer, then the root.

The model code never knows it is sharded; world size 1 goes through the same calls.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of an HF model (the units worth sharding one by one)."""
    names = getattr(model, "_no_split_modules", None) or []
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if layers:
        return layers
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            return list(module)
    return []


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    reshard_after_forward: bool | None = None,
    compute_dtype: torch.dtype | None = None,
    offload: bool = False,
) -> FSDPModule:
    """Shard every decoder layer, then the root module (embeddings, norm, head), over `mesh`.

    `compute_dtype` (e.g. bf16) casts the gathered parameters for compute while the sharded master weights,
    gradient reduction and optimizer stay in the model's dtype. `offload` keeps parameters, gradients and
    the optimizer step in CPU memory (accelerators only). `reshard_after_forward` defaults to True on
    several ranks (memory) and False on one, where a "shard" is the whole tensor and resharding would only
    add a copy per pass (callers then reshard with `reshard_all` when they are done).
    """
    if reshard_after_forward is None:
        reshard_after_forward = mesh.size() > 1
    kwargs: dict = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if compute_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    kwargs["offload_policy"] = CPUOffloadPolicy() if offload else OffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model  # type: ignore[return-value]


def reshard_all(model: nn.Module) -> None:
    """Free every gathered (unsharded) parameter, so the sharded ones are the only copy again."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def full_named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, full tensor) one at a time; a collective on every rank, in the same order.

    Only one unsharded tensor exists at a time, so the rollout engine can take weights without a second
    full copy of the model being built.
    """
    for name, tensor in model.state_dict().items():
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        yield name, tensor.detach()
