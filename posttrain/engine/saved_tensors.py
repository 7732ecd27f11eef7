"""Activation memory of a pass as autograd holds it: the distinct storages of the tensors saved for backward.

Resident-set size says little on CPU (the allocator keeps freed pages), so the sequence-parallel tests and
`bench/long_context.py` count what a forward leaves for the backward instead: every tensor that autograd
saves inside `record_saved_tensors()` (`torch.autograd.graph.saved_tensors_hooks`), once per storage (views
of one tensor share it). Storages of the model's parameters (a linear layer saves its weight) are counted
apart: they do not grow with the sequence. Under gradient checkpointing the checkpointed layers save nothing
through these hooks (torch.utils.checkpoint keeps their inputs and recomputes the rest in backward), so the
inputs of each checkpointing layer (transformers' `gradient_checkpointing` layers) are counted instead; the
one layer recomputed at a time during backward is not. Imports nothing of the engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

MIB = 2**20


@dataclass
class SavedTensors:
    """Bytes per distinct storage: saved activations (and checkpointed layers' inputs), and parameters."""

    activations: dict[int, int] = field(default_factory=dict)
    parameters: dict[int, int] = field(default_factory=dict)

    @property
    def activation_mib(self) -> float:
        return sum(self.activations.values()) / MIB

    @property
    def parameter_mib(self) -> float:
        return sum(self.parameters.values()) / MIB

    def _add(self, tensor: torch.Tensor, parameter_storages: set[int]) -> None:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        (self.parameters if ptr in parameter_storages else self.activations)[ptr] = storage.nbytes()


def _checkpointing(module: nn.Module) -> bool:
    return bool(getattr(module, "gradient_checkpointing", False)) and module.training


@contextmanager
def record_saved_tensors(model: nn.Module) -> Iterator[SavedTensors]:
    """Count, into the yielded `SavedTensors`, what the forwards of `model` inside the block keep for backward.
    Parameter storages are looked up when a tensor is saved (FSDP swaps in unsharded parameters per layer)."""
    record = SavedTensors()

    def parameter_storages() -> set[int]:
        # FSDP's sharded parameters are DTensors (their local shard is never what a layer saves)
        return {
            (p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr()
            for p in model.parameters()
        }

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        record._add(tensor, parameter_storages())
        return tensor

    def layer_inputs(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if _checkpointing(module) and torch.is_grad_enabled():
            params = parameter_storages()
            for value in (*args, *kwargs.values()):
                if isinstance(value, torch.Tensor):
                    record._add(value, params)
                elif isinstance(value, tuple):  # rotary (cos, sin)
                    for item in value:
                        if isinstance(item, torch.Tensor):
                            record._add(item, params)

    handles = [
        m.register_forward_pre_hook(layer_inputs, with_kwargs=True)
        for m in model.modules()
        if hasattr(m, "gradient_checkpointing")
    ]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield record
    finally:
        for handle in handles:
            handle.remove()
