"""Routing replay in the training engine: force every router to the experts the sampler chose (R3).

A micro-batch carrying `routed_experts` ((B, T, L, k), aligned with input_ids, -1 where nothing was recorded) runs
with each router's top-k replaced by the recorded experts and its weights recomputed from the current logits
(`models.routing.forced_routing`). The engine calls the model in several layouts: padded rows, where the call's
2-D attention mask says where the real cells are, and packed rows, where the packers tell which flat packed
position holds each real cell (`cell_positions`, in `attention_mask.bool()` order); other positions (padding,
packing filler) and cells holding -1 keep the router's own choice. The hooks stay on through the backward, so a layer recomputed under gradient
checkpointing is routed the same way. Nothing here knows the RL loop.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.errors import ConfigError
from posttrain.models.routing import forced_routing, router_modules


class RoutingReplay:
    """Forces the routers of `model` to a micro-batch's recorded experts inside `replaying(mb)`."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.routers = router_modules(model)
        self._cells: torch.Tensor | None = None  # (real cells, L, k) of the micro-batch being replayed
        self._told: torch.Tensor | None = None
        self._forced: torch.Tensor | None = None  # (tokens of the current model call, L, k)

    def cell_positions(self, flat_positions: torch.Tensor) -> None:
        """The flat packed position of each real cell of the micro-batch, for the next model call."""
        self._told = flat_positions

    def _on_model(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, torch.Tensor):
            raise ConfigError("routing replay needs input_ids (an embeddings-only pass cannot be replayed)")
        assert self._cells is not None
        told, self._told = self._told, None
        if told is None:  # padded rows (possibly without the columns that are padding in every row)
            mask = kwargs.get("attention_mask")
            if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or int(mask.sum()) != len(self._cells):
                raise ConfigError(
                    f"routing replay: a model call over {tuple(ids.shape)} tokens is neither the micro-batch's "
                    "padded rows nor a packed layout told its cell positions"
                )
            told = mask.reshape(-1).nonzero().flatten()
        forced = torch.full((ids.numel(), *self._cells.shape[1:]), -1, dtype=self._cells.dtype)
        forced = forced.to(ids.device)
        forced[told] = self._cells
        self._forced = forced

    def _router_hook(self, layer: int):
        def hook(module: nn.Module, args: tuple, output: tuple) -> tuple:
            assert self._forced is not None
            logits, weights, indices = output
            forced = self._forced[:, layer]
            if forced.shape[0] != logits.shape[0]:
                raise ConfigError(
                    f"routing replay: router of sparse layer {layer} ran {logits.shape[0]} tokens, the replayed "
                    f"call has {forced.shape[0]}"
                )
            replay = (forced >= 0).all(dim=-1)
            new_weights, new_indices = forced_routing(
                logits, forced.clamp(min=0), bool(getattr(module, "norm_topk_prob", False))
            )
            keep = replay[:, None]
            return (
                logits,
                torch.where(keep, new_weights, weights),
                torch.where(keep, new_indices, indices.to(new_indices.dtype)),
            )

        return hook

    @contextmanager
    def replaying(self, mb: Batch) -> Iterator[None]:
        """Passes (forward and backward) inside run with `mb`'s recorded experts."""
        routed = mb[keys.ROUTED_EXPERTS]
        layers = len(self.routers)
        if routed.dim() != 4 or routed.shape[2] != layers or routed.shape[3] != self.routers[0].top_k:
            raise ConfigError(
                f"{keys.ROUTED_EXPERTS} of shape {tuple(routed.shape)} does not fit this model's {layers} sparse "
                f"layers of top-{self.routers[0].top_k} routing (recorded by another model?)"
            )
        mask = mb[keys.ATTENTION_MASK].bool()
        self._told = None
        self._cells = routed[mask].long()
        handles = [self.model.register_forward_pre_hook(self._on_model, with_kwargs=True)]
        handles += [
            router.register_forward_hook(self._router_hook(i)) for i, router in enumerate(self.routers)
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self._cells = self._told = self._forced = None
