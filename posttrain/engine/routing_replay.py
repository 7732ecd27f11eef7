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

Under Ulysses sequence parallelism (sp > 1) a model call runs this rank's slice of the packed rows' columns
(`sequence_parallel.slice_rows`), and every token's router runs on the rank that holds it. Replaying cuts the
recorded experts of the whole packed layout to this rank's columns; recording gathers each rank's slice over
the sp group back into the whole layout first, so every rank returns the same (B, T, L, k) grid. Both need the
packed rows' width before sp's padding (`packed_width`, told before each call, as the packers tell the MoE
load-balancing loss).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch
from torch import nn

from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.engine.sequence_parallel import SequenceParallel
from posttrain.errors import ConfigError
from posttrain.models.routing import ROUTE_DTYPE, RoutingRecorder, forced_routing, router_modules

T = TypeVar("T")


class RoutingReplay:
    """Records (`recorded`) or forces (`replaying`) the routers of `model` on a micro-batch's real cells; `sp`: the
    sequence-parallel group when each model call runs one slice of the packed rows' columns."""

    def __init__(self, model: nn.Module, sp: SequenceParallel | None = None) -> None:
        self.model = model
        self.sp = sp if sp is not None and sp.size > 1 else None
        self._width: int | None = None  # the packed rows' width before sp's padding (sp only)
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
        self._call_shape = (0, 0, 0)  # (rows, local columns, packed width) of the call recorded (sp only)
        self._n_forced = 0  # real cells of the micro-batch being replayed that carry recorded experts
        self.replayed_cells = 0  # token cells forced to recorded experts, summed over replayed model calls

    def cell_positions(self, flat_positions: torch.Tensor) -> None:
        """The flat packed position of each real cell of the micro-batch, for the next model call."""
        self._told = flat_positions

    def packed_width(self, real_positions: torch.Tensor, width: int) -> None:
        """The next model call's packed rows are `width` columns wide before sp's padding (a `real_tokens`
        hook of the packers: the positions are not needed here)."""
        self._width = width

    def _sliced(self, ids: torch.Tensor) -> tuple[int, int, int]:
        """(rows, this rank's columns, packed width before padding) of an sp model call over `ids`."""
        if self._width is None:
            raise ConfigError("routing replay under sequence parallelism: the packed width was not told")
        rows, local = ids.shape
        return rows, local, self._width

    def _to_local(self, forced: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """(rows x W, L, k) over the whole packed layout -> (rows x local, L, k) over this rank's columns."""
        assert self.sp is not None
        rows, local, width = self._sliced(ids)
        grid = forced.unflatten(0, (rows, width))
        pad = local * self.sp.size - width
        if pad:
            grid = torch.cat([grid, grid.new_full((rows, pad, *grid.shape[2:]), -1)], 1)
        start = self.sp.rank * local
        return grid[:, start : start + local].flatten(0, 1)

    def _gathered(self, local_cells: torch.Tensor, rows: int, local: int, width: int) -> torch.Tensor:
        """(L, rows x local, k) recorded on this rank's columns -> (L, rows x W, k) over the whole layout."""
        assert self.sp is not None
        wide = local_cells.to(torch.int32).contiguous()  # gloo has no int16 collectives
        parts = [torch.empty_like(wide) for _ in range(self.sp.size)]
        torch.distributed.all_gather(parts, wide, group=self.sp.group)
        grid = torch.cat([p.unflatten(1, (rows, local)) for p in parts], 2)  # (L, rows, W', k)
        return grid[:, :, :width].flatten(1, 2).to(local_cells.dtype)

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
        ids = kwargs.get("input_ids", args[0] if args else None)
        assert isinstance(ids, torch.Tensor)
        if self.sp is not None:  # the whole packed layout, then this rank's columns of it
            tokens = ids.shape[0] * self._sliced(ids)[2]
        forced = torch.full((tokens, *self._cells.shape[1:]), -1, dtype=self._cells.dtype, device=told.device)
        forced[told] = self._cells.to(told.device)
        self._forced = self._to_local(forced, ids) if self.sp is not None else forced
        self.replayed_cells += self._n_forced

    def _on_model_record(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._call_positions.append(self._positions(args, kwargs)[1])
        if self.sp is not None:
            ids = kwargs.get("input_ids", args[0] if args else None)
            assert isinstance(ids, torch.Tensor)
            self._call_shape = self._sliced(ids)

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
        stacked = RoutingRecorder.stacked(calls)
        if self.sp is not None:
            stacked = self._gathered(stacked, *self._call_shape)
        cells = stacked[:, positions[0].to(calls[0][0].device)].transpose(0, 1)
        grid = torch.full((*mask.shape, *cells.shape[1:]), -1, dtype=ROUTE_DTYPE, device=cells.device)
        grid[mask.to(cells.device)] = cells
        return out, grid
