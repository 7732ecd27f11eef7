"""One tenant's LoRA adapter on a shared, frozen base engine: the training model of a LoRA `TrainingClient`.

It answers the calls the explicit API's worker makes of a training model (`compute_log_prob`,
`forward_backward`, `optim_step`, `save`/`load`, `export_hf`, `named_tensors_for_rollout`), as `TrainEngine`
does for full weights, so the worker treats both alike. Every pass runs the base engine's code (packing,
shared prefixes, micro-batches) with this adapter active (`MultiLora.use`); the optimizer is this adapter's
own AdamW. Adapters are replicated on every rank, so their gradients are averaged across ranks before the
step (the same average FSDP applies to sharded parameters). State on disk is tensors and JSON only (peft's
adapter files, the optimizer's moments as safetensors): nothing is unpickled when a tenant's state loads.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import safetensors.torch
import torch
import torch.distributed as dist

from posttrain.config.schema import OptimConfig
from posttrain.data.batch import Batch
from posttrain.engine.engine_config import DTYPES, LossFn
from posttrain.engine.multi_lora import AdapterSpec, LoraAdapter, MultiLora
from posttrain.engine.train_engine import TrainEngine
from posttrain.errors import ConfigError

OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_STATE = "optimizer.json"


class AdapterModel:
    lora = True

    def __init__(
        self,
        base: TrainEngine,
        adapters: MultiLora,
        name: str,
        spec: AdapterSpec,
        seed: int | None,
        optim: OptimConfig | None = None,
    ) -> None:
        self.base = base
        self.adapters = adapters
        self.name = name
        self.config = base.config
        self.dp_size = base.dp_size
        # float32 whatever the base's dtype (as peft's autocast_adapter_dtype and tinker): in bf16 most of an
        # adapter's small updates rounded away (2,368 of 39,936 lora_A entries changed by 3 steps at 1e-5),
        # and the Adam moments live in the parameters' dtype
        self.adapter: LoraAdapter = adapters.add(name, spec, torch.float32, base.device, seed)
        self.default_optim = optim or OptimConfig()  # used by an `optim_step` given no parameters
        self.optimizer = torch.optim.AdamW(list(self.adapter.parameters()), lr=self.default_optim.lr)

    def close(self) -> None:
        self.adapters.remove(self.name)

    # ---- compute -------------------------------------------------------------------------------
    def compute_log_prob(self, batch: Batch, temperature: float = 1.0) -> torch.Tensor:
        with self.adapters.use(self.name):
            return self.base.compute_log_prob(batch, temperature)

    def forward_backward(self, batch: Batch, loss_fn: LossFn) -> dict[str, float]:
        with self.adapters.use(self.name):
            return self.base.forward_backward(batch, loss_fn)

    def optim_step(self, params: OptimConfig | None = None) -> dict[str, float]:
        """Average gradients over ranks, clip (0 = off), one AdamW step with `params` (by default the
        model's `optim`), zero gradients."""
        params = params or self.default_optim
        trainable = list(self.adapter.parameters())
        if self.dp_size > 1:
            for p in trainable:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        for group in self.optimizer.param_groups:
            group.update(lr=params.lr, betas=params.betas, eps=params.eps, weight_decay=params.weight_decay)
        clip = params.grad_clip if params.grad_clip > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(trainable, clip))
        if math.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {
            "grad_norm": grad_norm,
            "lr": params.lr,
            "skipped_nonfinite": float(not math.isfinite(grad_norm)),
        }

    # ---- weights out ---------------------------------------------------------------------------
    def named_tensors_for_rollout(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.adapters.merged_weights(self.name)

    def export_hf(self, out_dir: str | Path, merged: bool = True) -> None:
        """A Hugging Face directory from rank 0: the base with this adapter merged, or the adapter alone in
        peft's format (`merged=False`)."""
        if self.base.rank == 0:
            if merged:
                from posttrain.engine.lora import untie_output_embeddings
                from posttrain.models import load_causal_lm, save_tokenizer_as_is

                model = load_causal_lm(self.config.model_path, dtype=DTYPES[self.config.dtype])
                if "lm_head" in self.adapter.spec.target_modules:
                    untie_output_embeddings(model)  # an adapted head must not change the embeddings
                params = dict(model.named_parameters())
                with torch.no_grad():
                    for name, tensor in self.adapters.merged_weights(self.name):
                        params[name].copy_(tensor)
                model.save_pretrained(out_dir)
                save_tokenizer_as_is(self.config.model_path, out_dir)
                image_config = Path(self.config.model_path) / "preprocessor_config.json"  # a vision model's
                if image_config.exists():
                    (Path(out_dir) / image_config.name).write_text(image_config.read_text())
            else:
                self.adapter.save_peft(Path(out_dir), self.config.model_path)
        if dist.is_initialized():
            dist.barrier()

    # ---- state ---------------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """The adapter (peft's files) and the optimizer (moments as safetensors, hyper-parameters as JSON),
        written by rank 0 (adapters are replicated)."""
        folder = Path(path)
        if self.base.rank == 0:
            self.adapter.save_peft(folder, self.config.model_path)
            names = {id(p): n for n, p in self.adapter.named_parameters()}
            tensors: dict[str, torch.Tensor] = {}
            steps: dict[str, float] = {}
            for p, state in self.optimizer.state.items():
                name = names[id(p)]
                tensors[f"{name}.exp_avg"] = state["exp_avg"].detach().cpu().contiguous()
                tensors[f"{name}.exp_avg_sq"] = state["exp_avg_sq"].detach().cpu().contiguous()
                steps[name] = float(state["step"])
            safetensors.torch.save_file(tensors, str(folder / OPTIMIZER_TENSORS))
            hyper = {k: v for k, v in self.optimizer.param_groups[0].items() if k != "params"}
            (folder / OPTIMIZER_STATE).write_text(json.dumps({"steps": steps, "hyper": hyper}))
        if dist.is_initialized():
            dist.barrier()

    def load(self, path: str | Path, with_optimizer: bool = True) -> None:
        folder = Path(path)
        self.adapter.load_peft(folder)
        for p in self.adapter.parameters():  # gradients of the weights it had are not these weights'
            p.grad = None
        if not with_optimizer:  # tinker's load_state: the weights alone, the optimizer starts afresh
            self.optimizer.state.clear()
            return
        if not (folder / OPTIMIZER_TENSORS).exists():
            raise ConfigError(f"{folder} holds no optimizer state")
        tensors = safetensors.torch.load_file(str(folder / OPTIMIZER_TENSORS))
        meta = json.loads((folder / OPTIMIZER_STATE).read_text())
        self.optimizer.state.clear()
        for name, p in self.adapter.named_parameters():
            if name not in meta["steps"]:
                continue
            self.optimizer.state[p] = {
                "step": torch.tensor(meta["steps"][name], dtype=torch.float32),
                "exp_avg": tensors[f"{name}.exp_avg"].to(p.device, p.dtype),
                "exp_avg_sq": tensors[f"{name}.exp_avg_sq"].to(p.device, p.dtype),
            }
        for group in self.optimizer.param_groups:
            group.update({k: tuple(v) if isinstance(v, list) else v for k, v in meta["hyper"].items()})
