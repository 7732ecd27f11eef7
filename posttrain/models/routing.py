"""A mixture's expert choices: recorded where a sampler runs the model, forced where the trainer recomputes it.

Routing replay (R3, "Rollout Routing Replay", Ma et al. 2025, arXiv:2510.11370): the sampler and the trainer
compute the router logits in different kernels and layouts, so a token near a top-k tie can be sent to other
experts in the trainer than it was in the sampler; its log-prob then differs by far more than rounding, and
that routing mismatch dominates an MoE policy's train/rollout gap. R3 records the sampler's top-k experts of
every token in every sparse layer and makes the trainer's routers use them. R2 (verl's name) records in the
trainer's own old-log-prob pass instead and replays in the update passes (engine.routing_replay).

transformers' top-k routers (Qwen2-MoE, Qwen3-MoE, Mixtral: `*TopKRouter`, the class each model records as
`router_logits`) return `(router_logits, top_k_weights, top_k_indices)`; the sparse block then runs the chosen
experts with those weights. Recording is a forward hook reading the indices; forcing is a forward hook that
replaces indices and weights, so no model code is copied. Forced weights are the router's own gating function
evaluated at the forced experts from the current logits: softmax over all experts, gathered at the forced ones,
renormalised over them when the model normalises its top-k (`norm_topk_prob`). With `norm_topk_prob` (Qwen3-MoE)
this is R3's softmax over the replayed experts' logits; without it (Qwen2-MoE's default) the weights keep the
model's own unnormalised form, so replaying the experts the router would have chosen changes nothing. Gradients
reach the router through the weights, as in R3. Layers are numbered in module order (sparse layers only).

Must not import anything above models/ (the rollout engine and the training engine both use it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel

from posttrain.errors import ConfigError

ROUTE_DTYPE = torch.int16  # expert indices as recorded and carried in the Batch (-1: not recorded)


def num_experts(config: PretrainedConfig) -> int:
    """Routed experts per sparse layer (0 for a dense model); the name differs between families."""
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def is_moe(config: PretrainedConfig) -> bool:
    return num_experts(config) > 0 and int(getattr(config, "num_experts_per_tok", 0) or 0) > 0


def router_classes(model: nn.Module) -> tuple[type, ...]:
    """The module classes whose first output is a layer's router logits (transformers' `router_logits`
    recorder of each PreTrainedModel inside `model`, peft and FSDP wrappers included)."""
    classes: set[type] = set()
    for module in model.modules():
        if not isinstance(module, PreTrainedModel):
            continue
        recorder = (getattr(module, "_can_record_outputs", None) or {}).get("router_logits")
        target = getattr(recorder, "target_class", None)
        if isinstance(target, type):
            classes.add(target)
    return tuple(classes)


def router_modules(model: nn.Module) -> list[nn.Module]:
    """The top-k routers of `model`, one per sparse layer, in layer order; an error when the model's routers
    are not transformers' top-k routers (no `top_k`, so their choices cannot be recorded or forced)."""
    classes = router_classes(model)
    routers = [m for m in model.modules() if classes and isinstance(m, classes)]
    if not routers:
        raise ConfigError(
            "routing replay (actor.router_replay.mode) needs a mixture of experts whose routers transformers records as "
            f"`router_logits`; '{getattr(getattr(model, 'config', None), 'model_type', '?')}' has none"
        )
    unsupported = sorted(
        {type(m).__name__ for m in routers if not isinstance(getattr(m, "top_k", None), int)}
    )
    if unsupported:
        raise ConfigError(
            f"routing replay (actor.router_replay.mode): routers {unsupported} are not top-k routers returning (logits, "
            "weights, indices); routing replay supports transformers' *TopKRouter (Qwen2-MoE, Qwen3-MoE, Mixtral)"
        )
    return routers


def forced_routing(
    logits: torch.Tensor, forced: torch.Tensor, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(top-k weights, indices) of tokens whose experts are `forced` (N, k): the router's gating at those
    experts from `logits` (N, E) (see the module docstring); in the logits' dtype, as the router returns."""
    indices = forced.long()
    weights = F.softmax(logits, dim=-1, dtype=torch.float).gather(-1, indices)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), indices


class RoutingRecorder:
    """The top-k expert indices every router of `model` chooses in the passes run inside `record()`."""

    def __init__(self, model: nn.Module) -> None:
        self.routers = router_modules(model)

    @contextmanager
    def record(self) -> Iterator[list[list[torch.Tensor]]]:
        """Yields, per sparse layer, the (tokens, k) indices of each router call, filled as the passes run."""
        calls: list[list[torch.Tensor]] = [[] for _ in self.routers]

        def hook(layer: int) -> Callable[[nn.Module, tuple, tuple], None]:
            return lambda module, args, output: calls[layer].append(output[2].to(ROUTE_DTYPE))

        handles = [router.register_forward_hook(hook(i)) for i, router in enumerate(self.routers)]
        try:
            yield calls
        finally:
            for handle in handles:
                handle.remove()

    @staticmethod
    def stacked(calls: list[list[torch.Tensor]]) -> torch.Tensor:
        """(layers, tokens, k): the recorded calls of each layer end to end."""
        return torch.stack([torch.cat(layer) for layer in calls])
