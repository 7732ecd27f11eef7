"""A training engine's state on disk: sharded checkpoints with torch.distributed.checkpoint (DCP), and the
trained model as a Hugging Face directory.

With LoRA the frozen base is the model directory itself, so checkpoints hold the adapters and the optimizer
only, and an export writes either the merged model or the adapter alone (peft's layout). Every function here
is a collective: all ranks call it together.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from posttrain.engine.engine_config import DTYPES, EngineConfig
from posttrain.engine.lora import export_peft_model

SCHEDULER_FILE = "scheduler.pt"


def state_options(lora: bool) -> StateDictOptions:
    """LoRA: frozen tensors are skipped (strict=False on load is safe: dcp.load already failed on any requested
    key it did not find)."""
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)


def trainable_only(model: nn.Module, model_sd: dict[str, Any], lora: bool) -> dict[str, Any]:
    """With LoRA, drop frozen tensors that survive `ignore_frozen_params` (a tied LM head does)."""
    if not lora:
        return model_sd
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in model_sd.items() if k in trainable}


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None, lora: bool) -> dict[str, Any]:
    """What a checkpoint holds: the model's (trainable) state, and the optimizer's when there is one."""
    options = state_options(lora)
    if optimizer is None:
        return {"model": trainable_only(model, get_model_state_dict(model, options=options), lora)}
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    return {"model": trainable_only(model, model_sd, lora), "optim": optim_sd}


def save_sharded(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    path: Path,
    *,
    lora: bool,
    rank: int,
) -> None:
    """Model (+ optimizer) state, every rank writing its shard; rank 0 writes the LR schedule's state."""
    dcp.save(_state(model, optimizer, lora), checkpoint_id=str(path))
    if rank == 0 and scheduler is not None:
        torch.save({"scheduler": scheduler.state_dict()}, path / SCHEDULER_FILE)
    dist.barrier()


def load_sharded(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    path: Path,
    *,
    lora: bool,
) -> None:
    """Load what `save_sharded` wrote (same world size, or any other DCP can reshard to). `optimizer` None: the
    weights alone (an optimizer, if any, keeps its state, e.g. fresh); else the optimizer and schedule too."""
    state = _state(model, optimizer, lora)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model,
        optimizer if optimizer is not None else [],
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
        options=state_options(lora),
    )
    if optimizer is not None and scheduler is not None:
        extra = torch.load(path / SCHEDULER_FILE, weights_only=False)
        scheduler.load_state_dict(extra["scheduler"])


def export_hf_directory(
    model: nn.Module, config: EngineConfig, out_dir: Path, *, merged: bool, lora: bool, rank: int
) -> None:
    """Write a Hugging Face directory from rank 0: the full model (config, safetensors, tokenizer, and the
    image processor's and generation configs when the model directory has them), or with LoRA and
    `merged=False` the adapter alone (adapter_config.json + adapter_model.safetensors)."""
    from posttrain.models import load_config, save_tokenizer_as_is

    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=lora)
    )
    if rank == 0 and lora:
        peft_model = export_peft_model(config.model_path, config.lora, full, DTYPES[config.dtype])
        (peft_model.merge_and_unload() if merged else peft_model).save_pretrained(str(out_dir))
        save_tokenizer_as_is(config.model_path, str(out_dir))
    elif rank == 0:
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        from posttrain.models import is_vision_language

        hf_config = load_config(config.model_path)
        auto = AutoModelForImageTextToText if is_vision_language(hf_config) else AutoModelForCausalLM
        hf_model = auto.from_config(hf_config, dtype=DTYPES[config.dtype])
        missing, unexpected = hf_model.load_state_dict(full, strict=False)
        tied = {"lm_head.weight"} if getattr(hf_config, "tie_word_embeddings", False) else set()
        if unexpected or set(missing) - tied:
            raise RuntimeError(f"export_hf: state dict mismatch: missing {missing}, unexpected {unexpected}")
        hf_model.tie_weights()
        hf_model.save_pretrained(str(out_dir))
        save_tokenizer_as_is(config.model_path, str(out_dir))
    image_config = Path(config.model_path) / "preprocessor_config.json"  # a vision model's processor
    if rank == 0 and image_config.exists():
        (out_dir / image_config.name).write_text(image_config.read_text())
    # the model's own generation config (its eos list, pad id, sampling defaults) replaces the one save_pretrained
    # derives from config.json, which keeps a single eos: a Qwen-Instruct export stopped at <|im_end|> only
    gen_config = Path(config.model_path) / "generation_config.json"
    exported = out_dir / "generation_config.json"
    if rank == 0 and (lora and merged or not lora) and gen_config.exists():
        exported.write_text(gen_config.read_text())
    dist.barrier()
