"""Model FLOPs of a decoder-only transformer (Llama/Qwen2 family, dense or a mixture of experts: the weights a
token multiplies) and a matmul peak-FLOP/s benchmark.

The FLOP counts are pure functions of a Hugging Face config dict (`config.json` / `PretrainedConfig.to_dict()`),
so the trainer's MFU and the benchmarks use one definition. Conventions (PaLM, Chowdhery et al. 2022, App. B):
- matmuls: 2 FLOPs per weight per token (forward); biases, norms, activations and the embedding lookup
  are not counted; a tied LM head is counted once, as a matmul.
- attention: 2 * 2 * n_layers * (heads * head_dim) FLOPs per (query, key) pair (QK^T and AV), over the
  causal pairs only: a sequence of T tokens has T(T+1)/2 of them (PaLM counts T^2, i.e. no causal halving).
- backward = 2 x forward (input and weight gradients), so a training pass is 3 x forward; with frozen
  matmul weights (LoRA; the adapters' own FLOPs are ignored) the matmuls' backward is 1 x forward.
  Recomputation (gradient checkpointing) is not counted: these are model FLOPs, for MFU.
Must not import anything from posttrain except errors (tracking is the bottom layer).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch


def _dims(config: Mapping[str, Any]) -> tuple[int, int, int, int, int, int]:
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    return (
        hidden,
        int(config["num_hidden_layers"]),
        int(config["intermediate_size"]),
        heads,
        kv_heads,
        head_dim,
    )


def matmul_params(config: Mapping[str, Any], head: str = "lm") -> int:
    """Weights that take part in a matmul: q, k, v, o and the gated MLP (gate, up, down) of every layer,
    plus the output head: `lm` (hidden x vocab, tied or not) or `value` (hidden x 1, a critic's head)."""
    hidden, layers, ffn, heads, kv_heads, head_dim = _dims(config)
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    return layers * attention + sum(_mlp_params(config, i) for i in range(layers)) + head_params(config, head)


def _mlp_params(config: Mapping[str, Any], layer: int) -> int:
    """The gated MLP weights a token multiplies in `layer`: the dense MLP (gate, up, down), or in a mixture of
    experts its top-k experts' (`moe_intermediate_size` wide; Mixtral's `intermediate_size`), the shared
    expert and its gate (Qwen2-MoE) and the router. Qwen-MoE's dense layers (`mlp_only_layers`, or off
    `decoder_sparse_step`) count as dense."""
    hidden, ffn = int(config["hidden_size"]), int(config["intermediate_size"])
    experts = int(config.get("num_experts") or config.get("num_local_experts") or 0)
    step = int(config.get("decoder_sparse_step") or 1)
    if not experts or layer in (config.get("mlp_only_layers") or []) or (layer + 1) % step:
        return 3 * hidden * ffn
    top_k = int(config.get("num_experts_per_tok") or 1)
    expert_ffn = int(config.get("moe_intermediate_size") or ffn)
    shared = int(config.get("shared_expert_intermediate_size") or 0)
    return (
        top_k * 3 * hidden * expert_ffn + 3 * hidden * shared + (hidden if shared else 0) + hidden * experts
    )


def head_params(config: Mapping[str, Any], head: str = "lm") -> int:
    """Weights of the output head: `lm` hidden x vocab, `value` hidden x 1."""
    if head == "lm":
        return int(config["hidden_size"]) * int(config["vocab_size"])
    if head == "value":
        return int(config["hidden_size"])
    raise ValueError(f"unknown head {head!r}; valid: lm, value")


def _attention_flops_per_pair(config: Mapping[str, Any]) -> int:
    _, layers, _, heads, _, head_dim = _dims(config)
    return 4 * layers * heads * head_dim


def _matmul_and_attention(
    config: Mapping[str, Any],
    seq_lens: Sequence[int] | torch.Tensor,
    head: str,
    prompt_lens: Sequence[int] | torch.Tensor | None,
    samples_per_prompt: int,
) -> tuple[float, float]:
    lens = torch.as_tensor(seq_lens, dtype=torch.float64)
    if prompt_lens is None:
        pairs = float((lens * (lens + 1) / 2).sum())
        attention = _attention_flops_per_pair(config) * pairs
        return 2.0 * matmul_params(config, head) * float(lens.sum()), attention
    prompts = torch.as_tensor(prompt_lens, dtype=torch.float64)
    return _prompt_and_response_work(config, prompts, lens - prompts, samples_per_prompt, head)


def _prompt_and_response_work(
    config: Mapping[str, Any],
    prompts: torch.Tensor,
    responses: torch.Tensor,
    samples_per_prompt: int,
    head: str,
) -> tuple[float, float]:
    """(matmul, attention) FLOPs that turn prompts into the distributions of their responses' tokens.

    Each prompt's P positions run once per group; then each sample needs R - 1 more positions (its last
    token is never an input), position p attending p + 1 keys; the head runs at the R positions that
    predict a response token. Generating and scoring a response are the same work.
    """
    n = float(samples_per_prompt)
    body = matmul_params(config, head) - head_params(config, head)
    steps = (responses - 1).clamp(min=0)
    positions = float(prompts.sum()) / n + float(steps.sum())
    pairs = float((prompts * (prompts + 1) / 2).sum()) / n
    pairs += float((steps * (prompts + 1) + steps * (steps - 1) / 2).sum())
    matmul = 2.0 * body * positions + 2.0 * head_params(config, head) * float(responses.sum())
    return matmul, _attention_flops_per_pair(config) * pairs


def forward_flops(
    config: Mapping[str, Any],
    seq_lens: Sequence[int] | torch.Tensor,
    head: str = "lm",
    prompt_lens: Sequence[int] | torch.Tensor | None = None,
    samples_per_prompt: int = 1,
) -> float:
    """Forward FLOPs of sequences of `seq_lens` real tokens.

    Without `prompt_lens` every position runs through the head:
    sum_T [2 * N_matmul * T + 4 * n_layers * heads * head_dim * T(T+1)/2]. With them (an RL pass scoring
    responses), the work the scores need: each prompt once per group of `samples_per_prompt` samples, the head
    only at the positions that predict a response token: the same work as `generation_flops`.
    """
    return sum(_matmul_and_attention(config, seq_lens, head, prompt_lens, samples_per_prompt))


def train_flops(
    config: Mapping[str, Any],
    seq_lens: Sequence[int] | torch.Tensor,
    head: str = "lm",
    frozen_weights: bool = False,
    prompt_lens: Sequence[int] | torch.Tensor | None = None,
    samples_per_prompt: int = 1,
) -> float:
    """Forward + backward FLOPs of one training pass (positions counted as in `forward_flops`): 3 x forward,
    or with `frozen_weights` (LoRA) 2 x the matmul part (no weight gradients) + 3 x the attention part."""
    matmul, attention = _matmul_and_attention(config, seq_lens, head, prompt_lens, samples_per_prompt)
    return (2.0 if frozen_weights else 3.0) * matmul + 3.0 * attention


def generation_flops(
    config: Mapping[str, Any],
    prompt_lens: Sequence[int] | torch.Tensor,
    response_lens: Sequence[int] | torch.Tensor,
    samples_per_prompt: int = 1,
) -> float:
    """Forward FLOPs of generating `response_lens[i]` tokens after `prompt_lens[i]` with a KV cache.

    Rows are samples. Prefill runs the P prompt positions and gives the first token; each further token
    takes one decode position, so R tokens need P + R - 1 positions, a position p attending p + 1 keys.
    The LM head runs once per generated token. The `samples_per_prompt` samples of a prompt need its
    prefill once, so the prompts' cost is divided by it.
    """
    prompts = torch.as_tensor(prompt_lens, dtype=torch.float64)
    responses = torch.as_tensor(response_lens, dtype=torch.float64)
    return sum(_prompt_and_response_work(config, prompts, responses, samples_per_prompt, "lm"))


def measure_matmul_flops(
    seconds: float = 0.4,
    size: int = 2048,
    threads: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> float:
    """Achieved FLOP/s of a square `size` x `size` matmul loop run for about `seconds` (after one warm-up
    matmul), with `threads` torch intra-op threads (0 = as set); the thread count is restored afterwards."""
    device = torch.device(device)
    previous = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        a @ b
        sync()
        count, start = 0, time.perf_counter()
        while True:
            a @ b
            count += 1
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                break
        return 2.0 * size**3 * count / elapsed
    finally:
        torch.set_num_threads(previous)
