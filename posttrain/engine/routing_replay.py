"""Routing replay in the training engine: record the experts each real token is routed to (R2), and force every
router to recorded experts (R2 and R3).

R3 ("Rollout Routing Replay", Ma et al. 2025, arXiv:2510.11370) replays the experts the sampler chose; R2 (verl's
name) replays the experts this engine chose in the old-log-prob pass, so that the update passes, run after the
policy moved, compute the new log-probs with the experts of the old ones and the PPO ratio measures the change of
the weights, not a change of routing. Both carry the experts as `routed_experts` ((B, T, L, k), aligned with
input_ids, -1 where nothing was recorded).

The engine calls the model in several layouts: padded rows, where the call's 2-D attention mask says where the
real cells are, and packed rows, where the packers tell which flat packed position holds each real cell
(`cell_positions`, in `attention_mask.bool()` order). Recording reads each router's top-k at those positions;
replaying runs each router with its top-k replaced by the recorded experts and its weights recomputed from the
current logits (`models.routing.forced_routing`); other positions (padding, packing filler) and cells holding -1
keep the router's own choice. The replay hooks stay on through the backward, so a layer recomputed under gradient
checkpointing is routed the same way. Nothing here knows the RL loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch
from torch import nn

from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.errors import ConfigError
from posttrain.models.routing import ROUTE_DTYPE, RoutingRecorder, forced_routing, router_modules

T = TypeVar("T")


class RoutingReplay:
    """Records (`recorded`) or forces (`replaying`) the routers of `model` on a micro-batch's real cells."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.routers = router_modules(model)
        self.recorder = RoutingRecorder(model)
        self._n_cells = 0  # real cells of the micro-batch being recorded or replayed
        self._told: torch.Tensor | None = None
        self._cells: torch.Tensor | None = None  # (real cells, L, k) being replayed
        self._forced: torch.Tensor | None = None  # (tokens of the current model call, L, k)
        self._call_positions: list[
            torch.Tensor
        ] = []  # per model call being recorded: each real cell's position
        # (input_ids, positions) of the current model call, computed once for both hooks
        self._this_call: tuple[torch.Tensor, torch.Tensor] | None = None
        self._n_forced = 0  # real cells of the micro-batch being replayed that carry recorded experts
        self.replayed_cells = 0  # token cells forced to recorded experts, summed over replayed model calls

    def cell_positions(self, flat_positions: torch.Tensor) -> None:
        """The flat packed position of each real cell of the micro-batch, for the next model call."""
        self._told = flat_positions

    def _positions(self, args: tuple, kwargs: dict) -> tuple[int, torch.Tensor]:
        """(tokens of this model call, the position among them of each real cell of the micro-batch)."""
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, torch.Tensor):
            raise ConfigError("routing replay needs input_ids (an embeddings-only pass cannot be replayed)")
        if self._this_call is not None and self._this_call[0] is ids:
            # the replay and the record hooks of one call (recording a replayed pass): `_told` is used up
            return ids.numel(), self._this_call[1]
        told, self._told = self._told, None
        if told is None:  # padded rows (possibly without the columns that are padding in every row)
            mask = kwargs.get("attention_mask")
            if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or int(mask.sum()) != self._n_cells:
                raise ConfigError(
                    f"routing replay: a model call over {tuple(ids.shape)} tokens is neither the micro-batch's "
                    "padded rows nor a packed layout told its cell positions"
                )
            told = mask.reshape(-1).nonzero().flatten()
        self._this_call = (ids, told)
        return ids.numel(), told

    def _on_model_replay(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        assert self._cells is not None
        tokens, told = self._positions(args, kwargs)
        forced = torch.full((tokens, *self._cells.shape[1:]), -1, dtype=self._cells.dtype, device=told.device)
        forced[told] = self._cells.to(told.device)
        self._forced = forced
        self.replayed_cells += self._n_forced

    def _on_model_record(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._call_positions.append(self._positions(args, kwargs)[1])

    def _router_hook(self, layer: int) -> Callable[[nn.Module, tuple, tuple], tuple]:
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
        self._n_cells = len(self._cells)
        self._n_forced = int((self._cells >= 0).all(dim=-1).any(dim=-1).sum())  # cells with a replayed layer
        handles = [self.model.register_forward_pre_hook(self._on_model_replay, with_kwargs=True)]
        handles += [
            router.register_forward_hook(self._router_hook(i)) for i, router in enumerate(self.routers)
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self._cells = self._told = self._forced = self._this_call = None

    def recorded(self, mb: Batch, run: Callable[[], T]) -> tuple[T, torch.Tensor]:
        """(`run()`, the experts every router chose for each real cell of `mb` during it: (B, T, L, k) on the
        grid of `mb`'s input_ids, -1 on padding). `run` must call the model once over all of `mb`'s real cells
        (one forward, no gradient checkpointing recomputation: the engine's no-grad log-prob pass)."""
        mask = mb[keys.ATTENTION_MASK].bool()
        self._told, self._n_cells, self._call_positions = None, int(mask.sum()), []
        handle = self.model.register_forward_pre_hook(self._on_model_record, with_kwargs=True)
        try:
            with self.recorder.record() as calls:
                out = run()
        finally:
            handle.remove()
            self._told = self._this_call = None
        positions, self._call_positions = self._call_positions, []
        if len(positions) != 1 or any(len(layer) != 1 for layer in calls):
            raise ConfigError(
                f"routing replay: recording needs one model call per micro-batch; this pass made {len(positions)}"
            )
        cells = RoutingRecorder.stacked(calls)[:, positions[0].to(calls[0][0].device)].transpose(0, 1)
        grid = torch.full((*mask.shape, *cells.shape[1:]), -1, dtype=ROUTE_DTYPE, device=cells.device)
        grid[mask.to(cells.device)] = cells
        return out, grid
