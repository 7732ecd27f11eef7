"""Mixtures of experts in the training engine: the router's load-balancing loss, for any HF MoE model.

transformers computes this loss only when the model is called with `output_router_logits=True`, over every
token of the call (or the ones a 2-D attention mask keeps). The engine calls the model in several layouts
(padded, packed, shared prompts), where a packed row's tail is filler that must not count. So the router
logits are captured here with forward hooks on the model's router modules (the classes the model records as
`router_logits`), and the engine's packers say which flat positions hold real tokens.

Under Ulysses sequence parallelism (sp > 1) each rank runs one slice of every packed row's columns, so it sees
the routing of its own tokens only. The loss is built from per-expert sums over tokens (routed assignments,
router probabilities, and the token count), so summing those over the sp group gives exactly the unsliced
loss. Nothing here knows the RL loop; of the engine it imports only `sequence_parallel`'s collectives.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from posttrain.engine.sequence_parallel import SequenceParallel, local_positions, sum_over_group
from posttrain.errors import ConfigError
from posttrain.models.routing import is_moe, num_experts, router_classes


def resolve_aux_loss_coef(config: PretrainedConfig, coef: float | None) -> float:
    """`model.router_aux_loss_coef` resolved against the model: None = the config's own coefficient for an MoE
    (0 for a dense model); a positive value on a dense model, or a negative one, is an error."""
    moe = is_moe(config)
    if coef is None:
        return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if moe else 0.0
    if coef < 0:
        raise ConfigError(f"model.router_aux_loss_coef must be >= 0 (0 = off); got {coef}")
    if coef > 0 and not moe:
        raise ConfigError(
            f"model.router_aux_loss_coef={coef} needs a mixture-of-experts model; this one is "
            f"'{getattr(config, 'model_type', '?')}' with no routed experts (set it to 0 or leave it unset)"
        )
    return float(coef)


def expert_sums(router_logits: Sequence[torch.Tensor], top_k: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-expert sums over the tokens of every layer: (routed assignments (E,), no gradient; router
    probabilities (E,), with gradient; how many token x layer rows were summed)."""
    logits = torch.cat([layer.float() for layer in router_logits])  # (layers x tokens, E)
    probs = F.softmax(logits, dim=-1)
    with torch.no_grad():
        chosen = F.one_hot(probs.topk(top_k, dim=-1).indices, logits.shape[-1]).sum(1).float()  # (rows, E)
    return chosen.sum(0), probs.sum(0), logits.shape[0]


def balance_from_sums(chosen: torch.Tensor, probs: torch.Tensor, rows: float) -> torch.Tensor:
    """E * sum_e f_e * P_e with f_e = chosen_e / rows and P_e = probs_e / rows (0 rows: 0)."""
    rows = max(rows, 1.0)
    return chosen.shape[-1] * ((chosen / rows) * (probs / rows)).sum()


def load_balancing_loss(router_logits: Sequence[torch.Tensor], top_k: int) -> torch.Tensor:
    """Switch Transformer's auxiliary loss (Fedus et al. 2021, eqs. 4-6) as transformers computes it:
    E * sum_e f_e * P_e over the tokens of every layer, f_e the share of tokens whose top-k holds expert e
    (the f_e sum to k) and P_e the mean router probability of e. 1 x k when routing is perfectly balanced."""
    chosen, probs, rows = expert_sums(router_logits, top_k)
    return balance_from_sums(chosen, probs, float(rows))


class RouterAuxLoss:
    """Captures the router logits of each forward of `model` inside `capture()`, restricted to real tokens.

    Real tokens per model call: the ones a 2-D `attention_mask` keeps (padded layouts), else the flat
    positions last told with `real_tokens` (the packers' layouts), else all of them.

    `sp` (a sequence-parallel group of more than one rank): each model call runs this rank's slice of the
    packed rows' columns (`sequence_parallel.slice_rows`); the told positions are mapped onto it, and `loss`
    sums the per-expert counts and probabilities over the group, so every rank gets the unsliced loss.
    """

    def __init__(self, model: nn.Module, top_k: int, sp: SequenceParallel | None = None) -> None:
        self.model = model
        self.top_k = top_k
        self.sp = sp if sp is not None and sp.size > 1 else None
        self.num_experts = num_experts(cast(PretrainedConfig, model.config))
        self.classes = router_classes(model)
        if not self.classes:
            raise ConfigError(
                "model.router_aux_loss_coef > 0 but the model records no router logits (transformers' "
                "`router_logits` outputs); set model.router_aux_loss_coef=0"
            )
        self._told: tuple[torch.Tensor, int] | None = None
        self._current: torch.Tensor | None = None
        self._logits: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        # of the last model call: a rank with no real token sums zeros there
        self._device: torch.device | None = None

    def real_tokens(self, flat_positions: torch.Tensor, width: int) -> None:
        """The flat (row-major) positions of the real tokens of the next model call, over its packed rows of
        `width` columns (before any sequence-parallel padding)."""
        self._told = (flat_positions, width)

    def _on_model(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        mask = kwargs.get("attention_mask")
        told, self._told = self._told, None
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor):
            self._device = ids.device
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            self._current = mask.reshape(-1).nonzero().flatten()
        elif self.sp is None:
            self._current = None if told is None else told[0]
        elif told is None:
            # the sliced rows end in filler columns that must not count, and only the packer knows the width
            raise ConfigError(
                "the router load-balancing loss under model.sequence_parallel_size > 1 needs the packed layout's "
                "real tokens; this pass does not give them (set model.router_aux_loss_coef=0)"
            )
        else:
            assert isinstance(ids, torch.Tensor)
            self._current = local_positions(told[0], told[1], ids.shape[1], self.sp)

    def _on_router(self, module: nn.Module, args: tuple[Any, ...], output: tuple[Any, ...]) -> None:
        # kept as they are: an op here, inside a checkpointed layer, would save tensors in the forward that
        # the recomputation (hooks removed by then) does not, which gradient checkpointing rejects
        self._logits.append((output[0], self._current))

    @contextmanager
    def capture(self) -> Iterator[None]:
        """Record router logits of the forwards inside (hooks removed on exit, so a recomputation in
        backward under gradient checkpointing is not recorded twice)."""
        self._logits, self._told, self._current = [], None, None
        handles = [self.model.register_forward_pre_hook(self._on_model, with_kwargs=True)]
        handles += [
            m.register_forward_hook(self._on_router)
            for m in self.model.modules()
            if isinstance(m, self.classes)
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def loss(self) -> torch.Tensor:
        """The load-balancing loss of the captured forwards (all layers, all calls; under sp, of every rank's
        tokens: the same value on each rank of the group); 0 if none ran."""
        logits = []
        for layer, real in self._logits:
            layer = layer.reshape(-1, layer.shape[-1])
            layer = layer if real is None else layer[real]
            if layer.numel():
                logits.append(layer)
        self._logits = []
        if self.sp is None:
            return load_balancing_loss(logits, self.top_k) if logits else torch.zeros(())
        # every rank takes part in the sums, those whose slice holds no real token too
        if logits:
            chosen, probs, rows = expert_sums(logits, self.top_k)
        else:
            # on the call's device: NCCL reduces CUDA tensors only; float32 as expert_sums'
            zeros = torch.zeros(self.num_experts, dtype=torch.float32, device=self._device)
            chosen, probs, rows = zeros, zeros.clone(), 0
        counts = torch.cat([chosen, torch.tensor([float(rows)], device=chosen.device)])
        counts = sum_over_group(counts, self.sp)
        return balance_from_sums(counts[:-1], sum_over_group(probs, self.sp), float(counts[-1]))
