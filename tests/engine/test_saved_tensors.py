"""What a forward leaves for the backward: saved activations counted once per storage, parameters apart,
and under gradient checkpointing the checkpointed layers' inputs."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from posttrain.engine.saved_tensors import MIB, record_saved_tensors


class Layer(nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(256, 256, bias=False)
        self.gradient_checkpointing = checkpointed  # as transformers' GradientCheckpointingLayer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gradient_checkpointing:
            return checkpoint(lambda t: torch.tanh(self.linear(t)), x, use_reentrant=False)
        return torch.tanh(self.linear(x))


def saved(checkpointed: bool) -> tuple[float, float]:
    torch.manual_seed(0)
    model = nn.Sequential(Layer(checkpointed), Layer(checkpointed))
    x = torch.randn(1024, 256, requires_grad=True)  # 1 MiB
    with record_saved_tensors(model) as record:
        model(x).sum().backward()
    return record.activation_mib, record.parameter_mib


def test_activations_are_counted_once_per_storage_and_parameters_apart() -> None:
    activations, parameters = saved(checkpointed=False)
    # each layer saves its input (for the weight gradient) and its tanh output: x, h1, out = 3 MiB
    assert activations == 3.0
    assert parameters == 2 * 256 * 256 * 4 / MIB  # each linear saves its weight


def test_checkpointed_layers_count_their_inputs() -> None:
    activations, parameters = saved(checkpointed=True)
    assert activations == 2.0  # the two layers' inputs, kept by the checkpoint; nothing inside them
    assert parameters == 0.0
