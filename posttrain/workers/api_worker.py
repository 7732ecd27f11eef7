"""The explicit API's worker: training models and samplers by id, on one SPMD rank.

Each training model (one per `TrainingClient`) is either the full weights (a `TrainEngine` of its own) or a
LoRA adapter (`AdapterModel`) on the one frozen base engine that all of the worker's adapters share, so N
tenants cost one copy of the base plus N small adapters. Each sampler (one per `SamplingClient`) is a
snapshot of a model's weights, taken in-process (`snapshot_sampler`) or loaded from a directory; LoRA
samplers share one rollout engine and sample in one batch (`api_samplers.py`).
Batches arrive split for this rank, in the explicit API's layout (`data/keys.py`: `input_ids` right-padded,
`target_tokens`, the loss inputs under `api/<name>`, `api/row` and `api/valid` for each row). A plain class:
the controller runs it as a Ray actor per rank, or in-process.
"""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain.algorithms.api_losses import API_LOSSES
from posttrain.config.schema import LoraConfig, OptimConfig
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.engine.adapter_model import AdapterModel
from posttrain.engine.distributed import DistInfo
from posttrain.engine.engine_config import EngineConfig
from posttrain.engine.multi_lora import AdapterSpec
from posttrain.engine.shared_prompt import MASKED_ATTENTION
from posttrain.engine.train_engine import TrainEngine
from posttrain.errors import ConfigError
from posttrain.models import is_vision_language, load_config
from posttrain.models.attention import sliding_window
from posttrain.models.routing import is_moe
from posttrain.models.vl import VISION_TOWER_MODES
from posttrain.rollout.base import SamplingParams
from posttrain.workers.api_samplers import ADAPTER_DIR, ApiSamplers, SamplerSettings
from posttrain.workers.process import prepare_worker_process, rank_seed
from posttrain.workers.prompt_scoring import PromptScoring

# The modules each tinker LoRA switch adapts (Qwen2/Llama/Mistral names).
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)


@dataclass(frozen=True)
class ApiWorkerSpec:
    """Settings shared by every model of a backend (the model levers of the `model` config section)."""

    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    micro_batch_size: int = 64
    pack_row_tokens: int = 256
    rollout_name: str = "native"
    rollout_max_batch_size: int = 256
    seed: int = 0
    threads: int = 0
    # waiting forward/backward requests of different LoRA adapters run as one pass over the shared base, up
    # to this many tokens (0: one request per pass); see client/call_queue.py
    shared_pass_tokens: int = 16384
    # a vision-language model's vision tower, as the trainers' model.vision_tower: auto (trained for a model
    # make-model built from scratch, frozen for a pretrained one), frozen or trained. Full-weight clients
    # follow it; LoRA clients adapt the language model only, so `trained` with a LoRA client is refused.
    vision_tower: str = "auto"

    def __post_init__(self) -> None:
        if self.vision_tower not in VISION_TOWER_MODES:
            raise ValueError(
                f"ApiWorkerSpec(vision_tower={self.vision_tower!r}) unknown; valid: {', '.join(VISION_TOWER_MODES)}"
            )


@dataclass(frozen=True)
class ModelSpec:
    """One training model: its base directory, LoRA (rank 0 = the full weights) and the modules adapted."""

    base_model: str
    lora_rank: int = 0
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    seed: int | None = None
    lora_alpha: float = 32.0
    target_modules: tuple[str, ...] = field(default=())

    def lora(self) -> LoraConfig:
        modules = (
            (ATTN_MODULES if self.train_attn else ())
            + (MLP_MODULES if self.train_mlp else ())
            + (UNEMBED_MODULES if self.train_unembed else ())
        )
        return LoraConfig(
            rank=self.lora_rank, alpha=self.lora_alpha, target_modules=self.target_modules or modules
        )


class ApiWorker:
    role = "api"

    def __init__(self, spec: ApiWorkerSpec, dist_info: DistInfo | None = None) -> None:
        self.dist_info = dist_info or DistInfo()
        if spec.rollout_name not in ("native", "hf"):
            raise ConfigError(
                f"ApiWorkerSpec(rollout_name={spec.rollout_name!r}): the explicit API's samplers are engines made per "
                "snapshot and LoRA adapters on a shared base (rollout_name='native'; 'hf' for other architectures)"
            )
        prepare_worker_process(spec.threads, rank_seed(spec.seed, self.dist_info.rank))
        self.spec = spec
        self.rank = self.dist_info.rank
        self.base: TrainEngine | None = None  # the frozen base every LoRA adapter of this worker shares
        self.models: dict[str, TrainEngine | AdapterModel] = {}
        self.model_specs: dict[str, ModelSpec] = {}
        device = self.dist_info.device if self.dist_info.device not in ("auto", "") else "cpu"
        self.samplers = ApiSamplers(
            SamplerSettings(
                spec.rollout_name,
                device,
                spec.dtype,
                spec.rollout_max_batch_size,
                spec.attn_implementation,
                rank_seed(spec.seed, self.rank, "sampler"),
            )
        )
        self._adapters_made = itertools.count()

    def ping(self) -> dict[str, Any]:
        return {"rank": self.rank, "pid": os.getpid()}

    # ---- models --------------------------------------------------------------------------------
    def _engine_config(self, base_model: str, **overrides: Any) -> EngineConfig:
        """The engine of a model: packed rows sharing datums' common prefixes; a vision-language model's rows
        are padded instead (images need the model's multimodal positions per row, as in the trainers), and so
        are a sliding-window model's (Gemma, Mistral v0.1: packed layouts would attend past the window)."""
        packed = not is_vision_language(base_model) and sliding_window(load_config(base_model)) is None
        return EngineConfig(
            model_path=base_model,
            dtype=self.spec.dtype,
            attn_implementation=self.spec.attn_implementation,
            micro_batch_size=self.spec.micro_batch_size,
            remove_padding=packed,
            pack_row_tokens=self.spec.pack_row_tokens,
            share_prompt=packed and self.spec.attn_implementation in MASKED_ATTENTION,  # common prefixes
            vision_tower=self.spec.vision_tower,
            **overrides,
        )

    def create_model(self, model_id: str, model: ModelSpec) -> None:
        """A full-weight model (its own engine), or a LoRA adapter on the one shared frozen base."""
        if model_id in self.models:
            raise ConfigError(f"model {model_id!r} exists already")
        if model.lora_rank == 0:
            if model.seed is not None:
                torch.manual_seed(model.seed)
            self.models[model_id] = TrainEngine(self._engine_config(model.base_model), self.dist_info)
        else:
            if self.base is None:
                self.base = TrainEngine(
                    self._engine_config(model.base_model, trainable=False), self.dist_info
                )
            elif Path(self.base.config.model_path).resolve() != Path(model.base_model).resolve():
                raise ConfigError(
                    f"this backend's base model is {self.base.config.model_path}, not {model.base_model}"
                )
            if model.train_mlp and not model.target_modules and is_moe(load_config(model.base_model)):
                raise ConfigError(
                    f"train_mlp=True on {model.base_model}, a mixture-of-experts model: the API's LoRA adapts "
                    "linear layers, not the routed experts' fused weights (it would adapt a shared expert only, "
                    "or fail to find the MLP), so it is refused rather than half done; pass train_mlp=False "
                    "(attention and unembedding adapters), or train the full weights (create_training_client)"
                )
            lora = model.lora()
            spec = AdapterSpec(lora.rank, lora.alpha, tuple(lora.target_modules))
            # the A matrices come from the client's seed, or else from one every rank draws alike (adapters
            # are replicated: all ranks must start from the same matrices)
            seed = (
                model.seed
                if model.seed is not None
                else rank_seed(self.spec.seed, self.rank, "adapter") + next(self._adapters_made)
            )
            adapters = self.base.attach_adapters()
            self.models[model_id] = AdapterModel(self.base, adapters, model_id, spec, seed)
        self.model_specs[model_id] = model

    def drop_model(self, model_id: str) -> None:
        model = self.models.pop(model_id, None)
        if isinstance(model, AdapterModel):
            model.close()
        self.model_specs.pop(model_id, None)

    def _model(self, model_id: str) -> TrainEngine | AdapterModel:
        if model_id not in self.models:
            raise ConfigError(f"no model {model_id!r} on this backend")
        return self.models[model_id]

    def forward(self, model_id: str, batch: Batch, loss: ApiLossSpec) -> Batch:
        """Per-row log-probs of the targets and per-row losses, without gradients."""
        engine = self._model(model_id)
        log_probs = engine.compute_log_prob(batch)
        outputs: dict[int, tuple[torch.Tensor, float]] = {}
        with torch.no_grad():
            api_loss(loss, log_probs, batch, outputs)
        return _row_outputs(batch, outputs)

    def forward_backward(self, model_id: str, batch: Batch, loss: ApiLossSpec) -> Batch:
        """Accumulate gradients of the summed loss (until `optim_step`); per-row log-probs and losses.

        tinker's reduction is a sum over datums; FSDP averages gradients over the data-parallel ranks, so
        each rank's sum is scaled by the number of ranks.
        """
        engine = self._model(model_id)
        self.samplers.free_caches()
        outputs: dict[int, tuple[torch.Tensor, float]] = {}

        def loss_fn(log_probs: torch.Tensor, entropy: torch.Tensor | None, mb: Batch) -> Any:
            return api_loss(loss, log_probs, mb, outputs) * engine.dp_size, {}

        params = _trained_parameters(engine)
        before = [None if p.grad is None else p.grad.clone() for p in params]  # nothing to copy before a step
        try:
            engine.forward_backward(batch, loss_fn)
        except BaseException:
            for p, g in zip(params, before, strict=True):  # no partial gradients of a failed call
                p.grad = g
            raise
        return _row_outputs(batch, outputs)

    # ---- several adapters in one pass ---------------------------------------------------------
    def _routed_models(self, model_ids: list[str]) -> list[AdapterModel]:
        models = [self._model(m) for m in model_ids]
        if len(set(model_ids)) != len(model_ids) or not all(isinstance(m, AdapterModel) for m in models):
            raise ConfigError("a shared pass takes distinct LoRA adapters of the shared base model")
        return models  # type: ignore[return-value]

    def forward_routed(self, model_ids: list[str], batch: Batch, losses: list[ApiLossSpec]) -> Batch:
        """`forward` of several adapters in one pass over the shared base: row i runs under adapter
        `model_ids[batch["api_adapter"][i]]` with that adapter's loss. Outputs in the batch's row order."""
        models = self._routed_models(model_ids)
        assert self.base is not None and self.base.adapters is not None
        batch = _positions_as_rows(batch)
        with self.base.adapters.routed([m.name for m in models]):
            log_probs = self.base.compute_log_prob(batch)
        outputs: dict[int, tuple[torch.Tensor, float]] = {}
        with torch.no_grad():
            _routed_loss(losses, log_probs, batch, outputs)
        return _row_outputs(batch, outputs)

    def forward_backward_routed(self, model_ids: list[str], batch: Batch, losses: list[ApiLossSpec]) -> Batch:
        """`forward_backward` of several adapters in one pass (one base forward and backward for all, each
        adapter's delta on its own tokens): each adapter's gradients are those of its rows and loss alone,
        since no sequence mixes adapters and the adapters share no parameter."""
        models = self._routed_models(model_ids)
        assert self.base is not None and self.base.adapters is not None
        self.samplers.free_caches()
        batch = _positions_as_rows(batch)
        outputs: dict[int, tuple[torch.Tensor, float]] = {}

        def loss_fn(log_probs: torch.Tensor, entropy: torch.Tensor | None, mb: Batch) -> Any:
            return _routed_loss(losses, log_probs, mb, outputs) * self.base.dp_size, {}  # type: ignore[union-attr]

        before = [_grads(m) for m in models]
        try:
            with self.base.adapters.routed([m.name for m in models]):
                self.base.forward_backward(batch, loss_fn)
        except BaseException:
            for model, grads in zip(models, before, strict=True):  # no partial gradients of a failed pass
                for p, g in zip(model.adapter.parameters(), grads, strict=True):
                    p.grad = g
            raise
        return _row_outputs(batch, outputs)

    def optim_step(self, model_id: str, params: OptimConfig) -> dict[str, float]:
        return self._model(model_id).optim_step(params)

    def save_state(self, model_id: str, path: str) -> None:
        """Weights and optimizer state of `model_id` (sharded, every rank writes), with its spec beside."""
        folder = Path(path)
        self._model(model_id).save(folder / "model")
        if self.rank == 0:
            spec = self.model_specs[model_id]
            (folder / "model_spec.json").write_text(
                json.dumps(spec.__dict__ | {"target_modules": list(spec.target_modules)})
            )

    def load_state(self, model_id: str, path: str, with_optimizer: bool) -> None:
        self._model(model_id).load(Path(path) / "model", with_optimizer=with_optimizer)

    def export_sampler_weights(self, model_id: str, out_dir: str) -> None:
        """The model as a Hugging Face directory a sampler loads (LoRA merged), written by rank 0; a LoRA
        model's adapter also in peft's format under ADAPTER_DIR, so that a sampler opened on the directory
        here is a frozen adapter on the shared engine (batched with other tenants') and not a model copy."""
        model = self._model(model_id)
        model.export_hf(out_dir, merged=True)
        if isinstance(model, AdapterModel) and self.rank == 0:
            model.adapter.save_peft(Path(out_dir) / ADAPTER_DIR, model.config.model_path)

    def export_external_weights(self, model_id: str, out_dir: str, base_name: str) -> None:
        """tinker's external weights: a LoRA model's adapter in peft's format (adapter_config.json naming
        `base_name` + adapter_model.safetensors: what peft, vLLM and tinker-cookbook's weights tools read),
        a full model as a Hugging Face directory; written by rank 0."""
        model = self._model(model_id)
        if not isinstance(model, AdapterModel):
            model.export_hf(out_dir, merged=True)
        elif self.rank == 0:
            model.adapter.save_peft(Path(out_dir), base_name)

    # ---- samplers (workers/api_samplers.py) -----------------------------------------------------
    def snapshot_sampler(self, sampler_id: str, model_id: str) -> dict[str, float]:
        """A sampler with `model_id`'s current weights, copied in-process (no disk)."""
        return self.samplers.snapshot(sampler_id, self._model(model_id))

    def open_sampler(self, sampler_id: str, path: str) -> None:
        """A sampler on the weights of a Hugging Face directory (a base model or exported sampler weights)."""
        self.samplers.open(sampler_id, path)

    def close_sampler(self, sampler_id: str) -> None:
        self.samplers.close(sampler_id)

    def sample(self, sampler_ids: list[str], batch: Batch, samplings: list[SamplingParams]) -> Batch:
        """One response per prompt row, row i on sampler `sampler_ids[api_adapter[i]]` (ApiSamplers.sample)."""
        return self.samplers.sample(sampler_ids, batch, samplings)

    def prompt_log_probs(
        self, sampler_id: str, batch: Batch, temperature: float = 1.0, scoring: PromptScoring | None = None
    ) -> Batch:
        return self.samplers.prompt_log_probs(sampler_id, batch, temperature, scoring)


@dataclass(frozen=True)
class ApiLossSpec:
    """A loss by name with its loss_fn_config (checked and resolved by the client before it is sent; a
    name or mode is a string, e.g. `policy_loss`'s, and request-wide totals are numbers)."""

    name: str
    config: dict[str, float | str] = field(default_factory=dict)
    # the loss inputs (besides target_tokens) of the request, in a batch merged from several requests whose
    # other columns it must not read; None: every `api_in_*` column of the batch
    inputs: tuple[str, ...] | None = None


def api_loss(
    spec: ApiLossSpec, log_probs: torch.Tensor, mb: Batch, outputs: dict[int, tuple[torch.Tensor, float]]
) -> torch.Tensor:
    """The summed loss of a micro-batch's datums, computed on the whole (B, T) block at once (tinker's losses
    are per token; gspo's sequence ratio is a masked mean per row, and padding is outside every mask);
    padding rows count 0. Each row's detached log-probs and loss go to `outputs` by its `api_row`."""
    mask, valid, rows = mb[keys.ATTENTION_MASK], mb[keys.API_VALID], mb[keys.API_ROW]
    inputs = {keys.TARGET_TOKENS: mb[keys.TARGET_TOKENS]}
    names = [k.removeprefix(keys.API_INPUT_PREFIX) for k in mb.keys() if k.startswith(keys.API_INPUT_PREFIX)]
    inputs.update(
        {k: mb[keys.API_INPUT_PREFIX + k] for k in names if spec.inputs is None or k in spec.inputs}
    )
    per_token, _ = API_LOSSES.get(spec.name)(log_probs, inputs, **spec.config)
    if per_token.dim() > mask.dim():  # K targets per position (cross_entropy's top-K): their sum
        per_token = per_token.sum(-1)
    row_loss = (per_token * mask).sum(-1) * valid
    lengths = mask.sum(-1).tolist()
    detached, losses = log_probs.detach().float().cpu(), row_loss.detach().cpu().tolist()
    for i, row in enumerate(rows.tolist()):
        outputs[int(row)] = (detached[i, : int(lengths[i])], float(losses[i]))
    return row_loss.sum()


def _trained_parameters(engine: TrainEngine | AdapterModel) -> list[torch.nn.Parameter]:
    """What a model's `forward_backward` accumulates gradients into: its adapter's matrices, or the full
    model's trainable weights."""
    if isinstance(engine, AdapterModel):
        return list(engine.adapter.parameters())
    return [p for p in engine.model.parameters() if p.requires_grad]


def _grads(model: AdapterModel) -> list[torch.Tensor | None]:
    """Copies of an adapter's accumulated gradients (small: LoRA matrices)."""
    return [None if p.grad is None else p.grad.clone() for p in model.adapter.parameters()]


def _positions_as_rows(batch: Batch) -> Batch:
    """The batch with `api_row` = each row's position: rows of several requests (whose `api_row`s repeat)
    then have one key each, and `_row_outputs` returns them in the batch's order."""
    renumbered = batch.index(torch.arange(len(batch)))  # a copy: the caller's batch stays as it was
    renumbered.set(keys.API_ROW, torch.arange(len(batch)))
    return renumbered


def _routed_loss(
    losses: list[ApiLossSpec],
    log_probs: torch.Tensor,
    mb: Batch,
    outputs: dict[int, tuple[torch.Tensor, float]],
) -> torch.Tensor:
    """The sum of each adapter's own loss over its own rows of the micro-batch."""
    slots = mb[keys.API_ADAPTER]
    total = log_probs.new_zeros(())
    for k in torch.unique(slots).tolist():
        rows = torch.nonzero(slots == k).squeeze(1)
        total = total + api_loss(losses[int(k)], log_probs[rows], mb.index(rows), outputs)
    return total


def _row_outputs(batch: Batch, rows: dict[int, tuple[torch.Tensor, float]]) -> Batch:
    """`api/logprobs` (B, T) and `api/loss` (B,) in the order of the batch's `api/row` column."""
    order = batch[keys.API_ROW].tolist()
    width = batch[keys.INPUT_IDS].shape[1]
    per_position = batch[keys.TARGET_TOKENS].shape[2:]  # (K,) with K targets per position
    log_probs = torch.zeros(len(order), width, *per_position)
    losses = torch.zeros(len(order))
    for i, row in enumerate(order):
        values, loss = rows[int(row)]
        log_probs[i, : values.shape[0]] = values
        losses[i] = loss
    return Batch.from_dict({keys.API_LOGPROBS: log_probs, keys.API_LOSS: losses})
