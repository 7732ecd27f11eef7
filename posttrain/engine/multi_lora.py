"""Many LoRA adapters on one frozen base model, added and removed while it runs (the explicit API's tenants).

    y = W x + (alpha / r) * B (A x)          (Hu et al. 2021, "LoRA"; A: r x in, B: out x r, B = 0 at start)

peft wraps a model for a fixed set of adapters, and the base model here is sharded by FSDP2 once and for
all; tenants come and go. So adapters live outside the model: each is a small module of A/B pairs, and a
forward hook on every adapted `nn.Linear` adds the delta of the adapter active for the current pass
(`MultiLora.use`). The base weights stay frozen and sharded; adapters are small and replicated on every
rank (their gradients are averaged across ranks in `AdapterModel.optim_step`). The initialisation and the
scale are peft's (A ~ kaiming-uniform(a=sqrt(5)), B = 0), and an adapter is saved in peft's format
(`adapter_config.json` + `adapter_model.safetensors`), so peft (and vLLM) load what this writes and the
tests use peft as the oracle.

Several adapters can also share one pass (`MultiLora.routed`): every token of the model's input carries the
index of the adapter it runs under (`set_routes`), each hook gathers the tokens of each adapter, computes
that adapter's delta on them alone and adds it back in place (one base matmul for everyone, one small LoRA
matmul per adapter). As long as no sequence mixes adapters (attention only mixes tokens of one sequence),
every token's output, and so every adapter's gradient, is what a pass of that adapter alone gives (tinker's
"clock cycle" batching of many LoRA tenants; peft refuses mixed-adapter batches in training).
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import safetensors.torch
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from posttrain.engine.lora import vision_tower_linears
from posttrain.errors import ConfigError

PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class AdapterSpec:
    rank: int
    alpha: float
    target_modules: tuple[str, ...]  # last name components of the adapted linear layers (peft's rule)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _key(module_name: str) -> str:
    return module_name.replace(".", "__")  # ParameterDict keys cannot hold dots


def targeted_linears(model: nn.Module, targets: tuple[str, ...]) -> dict[str, nn.Linear]:
    """The linear layers whose last name component is in `targets`, outside a vision tower (adapters are the
    language model's, engine.lora.vision_tower_linears); an error lists what exists."""
    tower = set(vision_tower_linears(model))
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in tower}
    available = {n.rsplit(".", 1)[-1] for n in linears}
    missing = sorted(set(targets) - available)
    if missing or not targets:
        raise ConfigError(
            f"LoRA target modules {missing or list(targets)} {'not found' if missing else 'empty'}; "
            f"linear layers of this model: {', '.join(sorted(available))}"
        )
    return {n: m for n, m in linears.items() if n.rsplit(".", 1)[-1] in targets}


class LoraAdapter(nn.Module):
    """The A and B matrices of one adapter, for each adapted linear layer (by its module name)."""

    def __init__(
        self,
        spec: AdapterSpec,
        linears: dict[str, nn.Linear],
        dtype: torch.dtype,
        device: torch.device,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        if spec.rank < 1 or spec.alpha <= 0:
            raise ConfigError(
                f"LoRA rank must be >= 1 and alpha > 0; got rank={spec.rank}, alpha={spec.alpha}"
            )
        self.spec = spec
        self.module_names = sorted(linears)
        self.lora_a = nn.ParameterDict()
        self.lora_b = nn.ParameterDict()
        for name in self.module_names:
            linear = linears[name]
            a = torch.empty(spec.rank, linear.in_features, dtype=torch.float32)
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)  # peft's init of lora_A
            self.lora_a[_key(name)] = nn.Parameter(a.to(device=device, dtype=dtype))
            b = torch.zeros(linear.out_features, spec.rank, dtype=dtype, device=device)
            self.lora_b[_key(name)] = nn.Parameter(b)

    def delta(self, module_name: str, x: torch.Tensor) -> torch.Tensor:
        a, b = self.lora_a[_key(module_name)], self.lora_b[_key(module_name)]
        return (x.to(a.dtype) @ a.T) @ b.T * self.spec.scale

    # ---- peft's on-disk format -----------------------------------------------------------------
    def peft_state(self) -> dict[str, torch.Tensor]:
        """Tensors under peft's names (`base_model.model.<module>.lora_A.weight`), contiguous, on CPU."""
        state = {}
        for name in self.module_names:
            state[f"{PEFT_PREFIX}{name}.lora_A.weight"] = self.lora_a[_key(name)].detach().cpu().contiguous()
            state[f"{PEFT_PREFIX}{name}.lora_B.weight"] = self.lora_b[_key(name)].detach().cpu().contiguous()
        return state

    def save_peft(self, folder: Path, base_model: str) -> None:
        """`adapter_config.json` + `adapter_model.safetensors`, as `PeftModel.from_pretrained` reads them."""
        folder.mkdir(parents=True, exist_ok=True)
        safetensors.torch.save_file(self.peft_state(), str(folder / "adapter_model.safetensors"))
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": self.spec.rank,
            "lora_alpha": self.spec.alpha,
            "lora_dropout": 0.0,
            "target_modules": sorted(self.spec.target_modules),
            "bias": "none",
            "fan_in_fan_out": False,
            "inference_mode": True,
        }
        (folder / "adapter_config.json").write_text(json.dumps(config, indent=1))

    @torch.no_grad()
    def load_peft(self, folder: Path) -> None:
        """The tensors of `save_peft` (shapes checked; every adapted layer must be there)."""
        state = safetensors.torch.load_file(str(folder / "adapter_model.safetensors"))
        expected = self.peft_state()
        if set(state) != set(expected):
            missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
            raise ConfigError(
                f"adapter in {folder} does not match: missing {missing[:3]}, unexpected {extra[:3]}"
            )
        for name in self.module_names:
            for table, kind in ((self.lora_a, "A"), (self.lora_b, "B")):
                value = state[f"{PEFT_PREFIX}{name}.lora_{kind}.weight"]
                if value.shape != table[_key(name)].shape:
                    raise ConfigError(
                        f"adapter in {folder}: {name} lora_{kind} has shape {tuple(value.shape)}"
                    )
                table[_key(name)].copy_(value)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@dataclass(frozen=True)
class _Group:
    """Adapters of one rank and one set of adapted layers, computed together with batched matmuls: their
    tokens are gathered into a (members, width, in) block, padded with a zero row (index `positions`)."""

    members: tuple[int, ...]  # adapter indices into the routed list
    gather: torch.Tensor  # (members * width,) flat token index per block cell; padding = positions
    width: int
    whole: bool = False  # one adapter on every position, in order: no gather or scatter needed


def _plan(slots: torch.Tensor, adapters: list[LoraAdapter]) -> list[_Group]:
    """Groups of adapters whose tokens are computed in one batched matmul. Padding every member to the
    largest member's token count is allowed while it at most doubles the work; beyond, members go alone."""
    positions = slots.numel()
    tokens = {k: torch.nonzero(slots == k).squeeze(1) for k in range(len(adapters))}
    by_shape: dict[tuple[int, tuple[str, ...]], list[int]] = {}
    for k, adapter in enumerate(adapters):
        if tokens[k].numel():
            key = (adapter.spec.rank, tuple(adapter.module_names))
            by_shape.setdefault(key, []).append(k)
    groups = []
    for members in by_shape.values():
        width = max(tokens[k].numel() for k in members)
        if len(members) > 1 and width * len(members) > 2 * sum(tokens[k].numel() for k in members):
            batches = [[k] for k in members]
        else:
            batches = [members]
        for batch in batches:
            w = max(tokens[k].numel() for k in batch)
            if len(batch) == 1 and w == positions:  # every position is this adapter's, in order
                groups.append(_Group(tuple(batch), tokens[batch[0]], w, whole=True))
                continue
            gather = torch.full((len(batch), w), positions, dtype=torch.long, device=slots.device)
            for row, k in enumerate(batch):
                gather[row, : tokens[k].numel()] = tokens[k]
            groups.append(_Group(tuple(batch), gather.reshape(-1), w))
    return groups


class TokenRoutes:
    """Which adapter each position of a pass's input runs under, as batched-matmul groups, for the model's
    full input and for the positions the LM head keeps (`packing.packed_model_output` shows the head only
    those)."""

    def __init__(
        self, slots: torch.Tensor, head_slots: torch.Tensor | None, adapters: list[LoraAdapter]
    ) -> None:
        self.numel = slots.numel()
        self.groups = _plan(slots, adapters)
        self.head_numel = head_slots.numel() if head_slots is not None else -1
        self.head_groups = _plan(head_slots, adapters) if head_slots is not None else []

    def plan(self, positions: int) -> list[_Group]:
        if positions == self.numel:
            return self.groups
        if positions == self.head_numel:
            return self.head_groups
        raise RuntimeError(
            f"a routed layer saw {positions} positions; the routes cover {self.numel} (or {self.head_numel} "
            "at the LM head): set_routes must describe the model's input of this pass"
        )


class MultiLora:
    """Adapters by name over one base model; `use(name)` makes one the active adapter of the passes inside,
    `routed(names)` lets several share a pass (token by token, `set_routes`).

    One forward hook per adapted linear layer (installed when the first adapter targets it); outside `use`
    and `routed` the hooks add nothing, so the base model is exactly itself (the reference policy, a base
    sampler).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.adapters: dict[str, LoraAdapter] = {}
        self._hooks: dict[str, torch.utils.hooks.RemovableHandle] = {}
        self._active: LoraAdapter | None = None
        self._routed: list[LoraAdapter] | None = None
        self._routes: TokenRoutes | None = None

    def add(
        self, name: str, spec: AdapterSpec, dtype: torch.dtype, device: torch.device, seed: int | None
    ) -> LoraAdapter:
        if name in self.adapters:
            raise ConfigError(f"adapter {name!r} exists already")
        linears = targeted_linears(self.model, spec.target_modules)
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        adapter = LoraAdapter(spec, linears, dtype, device, generator)
        for module_name, linear in linears.items():
            if module_name not in self._hooks:
                self._hooks[module_name] = linear.register_forward_hook(self._hook(module_name))
        self.adapters[name] = adapter
        return adapter

    @torch.no_grad()
    def add_frozen_copy(self, name: str, source: LoraAdapter) -> LoraAdapter:
        """A frozen copy of `source` (an adapter of another model with the same layer names) under `name`:
        a sampler of a LoRA model is its adapter, snapshotted, on a shared base (no merged copy of the
        whole model per sampler); later training of `source` does not change it."""
        dtype, device = source.lora_a[_key(source.module_names[0])].dtype, self._device()
        adapter = self.add(name, source.spec, dtype, device, seed=0)  # seeded: leaves the global RNG alone
        if adapter.module_names != source.module_names:
            self.remove(name)
            raise ConfigError(f"adapter {name!r}: the layers it adapts are not this model's")
        for table, src in ((adapter.lora_a, source.lora_a), (adapter.lora_b, source.lora_b)):
            for key, value in src.items():
                table[key].copy_(_full(value.detach()))
        return adapter.requires_grad_(False)

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def remove(self, name: str) -> None:
        self.adapters.pop(name, None)

    def _hook(self, module_name: str):  # noqa: ANN202
        def add_delta(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
            if self._routed is not None:
                return self._routed_delta(module_name, args[0], out)
            adapter = self._active
            if adapter is None or _key(module_name) not in adapter.lora_a:
                return out
            return out + adapter.delta(module_name, args[0]).to(out.dtype)

        return add_delta

    def _routed_delta(self, module_name: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` plus each routed adapter's delta on its own tokens only: per group of like adapters, the
        tokens gathered into a padded block, two batched matmuls, the results written back at their tokens.

        Groups own disjoint tokens and a padding cell's delta is zero (its row of x is zero), so the write
        back is a copy (`index_copy`), not an accumulating scatter: on CPU `index_add` sorts its indices in
        an OpenMP region per call, dozens of calls per decoding step, and each region waits a scheduler
        time slice when the cores are shared (a served 4 x 8-token sample took 1-2 s instead of ~0.1)."""
        if self._routes is None:
            raise RuntimeError("a routed pass ran before set_routes described its tokens")
        assert self._routed is not None
        key = _key(module_name)
        flat_x = x.reshape(-1, x.shape[-1])
        positions = flat_x.shape[0]
        padded_x: torch.Tensor | None = None
        deltas: torch.Tensor | None = None
        for group in self._routes.plan(positions):
            members = [self._routed[k] for k in group.members]
            if key not in members[0].lora_a:
                continue  # the group's adapters (one set of layers) do not adapt this one
            if group.whole:  # the only group: the plain LoRA delta of one adapter on the whole input
                return out + members[0].delta(module_name, x).to(out.dtype)
            if padded_x is None:
                padded_x = torch.cat([flat_x, flat_x.new_zeros(1, flat_x.shape[1])])
                deltas = out.new_zeros(positions + 1, out.shape[-1])
            a = torch.stack([m.lora_a[key] for m in members])  # (K, r, in)
            b = torch.stack([m.lora_b[key] for m in members])  # (K, out, r)
            scale = torch.tensor([m.spec.scale for m in members], dtype=a.dtype, device=a.device)
            block = padded_x.index_select(0, group.gather).view(len(members), group.width, -1).to(a.dtype)
            delta = torch.bmm(torch.bmm(block, a.transpose(1, 2)), b.transpose(1, 2)) * scale[:, None, None]
            deltas = deltas.index_copy(0, group.gather, delta.reshape(-1, delta.shape[-1]).to(out.dtype))  # type: ignore[union-attr]
        if deltas is None:
            return out
        return out + deltas[:positions].view(out.shape)

    @contextlib.contextmanager
    def routed(self, names: list[str]) -> Iterator[None]:
        """Passes inside run with several adapters at once: adapter `names[k]` on the tokens routed to k.

        Each pass must first say which token runs under which adapter (`set_routes`); the routes stay set
        until the next call, so a backward that recomputes activations (gradient checkpointing) sees them.
        """
        missing = [n for n in names if n not in self.adapters]
        if missing:
            raise ConfigError(f"no adapter {missing[0]!r}")
        if self._active is not None or self._routed is not None:
            raise RuntimeError("a routed pass cannot nest inside another adapter context")
        self._routed, self._routes = [self.adapters[n] for n in names], None
        try:
            yield
        finally:
            self._routed, self._routes = None, None

    def set_routes(self, slots: torch.Tensor, head_slots: torch.Tensor | None = None) -> None:
        """The adapter index (into `routed`'s names; -1 = none, the base alone) of every position of the
        model's next input, flattened, and of the positions its LM head keeps (None: it keeps them all)."""
        if self._routed is None:
            raise RuntimeError("set_routes outside MultiLora.routed")
        self._routes = TokenRoutes(slots, head_slots, self._routed)

    @property
    def routing(self) -> bool:
        return self._routed is not None

    @contextlib.contextmanager
    def use(self, name: str) -> Iterator[LoraAdapter]:
        """Passes inside run with adapter `name` on every layer it adapts."""
        if name not in self.adapters:
            raise ConfigError(f"no adapter {name!r}")
        previous, self._active = self._active, self.adapters[name]
        try:
            yield self._active
        finally:
            self._active = previous

    @torch.no_grad()
    def merged_weights(self, name: str) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, W + scale * B @ A) of every layer adapter `name` adapts, one at a time (a collective
        on sharded bases: every rank iterates): all a sampler built from the base directory needs."""
        adapter = self.adapters[name]
        modules = dict(self.model.named_modules())
        for module_name in adapter.module_names:
            weight = _full(modules[module_name].weight)
            delta = adapter.lora_b[_key(module_name)].float() @ adapter.lora_a[_key(module_name)].float()
            yield f"{module_name}.weight", (weight.float() + delta * adapter.spec.scale).to(weight.dtype)
