"""Model FLOP formulas against a hand count and against the parameters of real HF models; the peak benchmark."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForTokenClassification,
)

from posttrain.tracking.flops import (
    forward_flops,
    generation_flops,
    matmul_params,
    measure_matmul_flops,
    train_flops,
)

# hidden 8, 2 layers, MLP 12, 2 heads of 4 dims, 1 KV head, vocab 10, tied head
HAND = {
    "hidden_size": 8,
    "num_hidden_layers": 2,
    "intermediate_size": 12,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 10,
    "tie_word_embeddings": True,
}
# per layer: q 8*8 + k 8*4 + v 8*4 + o 8*8 = 192, MLP 3*8*12 = 288 -> 480; x2 layers = 960; head 8*10 = 80
BODY, HEAD = 960, 80
PAIR = 4 * 2 * 2 * 4  # 2*2 * layers * heads * head_dim FLOPs per attended (query, key) pair


def test_hand_counted_matmul_params() -> None:
    assert matmul_params(HAND) == BODY + HEAD
    assert matmul_params(HAND, head="value") == BODY + 8
    with pytest.raises(ValueError, match="valid: lm, value"):
        matmul_params(HAND, head="classifier")


def test_hand_counted_forward_train_and_generation_flops() -> None:
    # sequences of 3 and 1 real tokens: 4 tokens, 3*4/2 + 1 = 7 causal pairs
    matmul, attention = 2 * (BODY + HEAD) * 4, PAIR * 7
    assert forward_flops(HAND, [3, 1]) == matmul + attention == 8768
    assert train_flops(HAND, [3, 1]) == 3 * (matmul + attention)
    assert train_flops(HAND, [3, 1], frozen_weights=True) == 2 * matmul + 3 * attention
    # scoring passes: prompt 3 shared by 2 samples with responses 2 and 1. Body: 3 prompt positions once + 1
    # (the 2-token response's first token; last tokens are never inputs); pairs: 6 (prompt, once) + 4; head: the
    # 3 positions that predict a response token
    scored = 2 * BODY * 4 + PAIR * (6 + 4) + 2 * HEAD * 3
    shared = {"prompt_lens": [3, 3], "samples_per_prompt": 2}
    assert forward_flops(HAND, [5, 4], **shared) == scored
    assert scored == generation_flops(HAND, [3, 3], [2, 1], samples_per_prompt=2), "scoring = generating"
    body_part = 2 * BODY * 4 + 2 * HEAD * 3
    assert train_flops(HAND, [5, 4], **shared) == 3 * scored
    assert train_flops(HAND, [5, 4], frozen_weights=True, **shared) == 2 * body_part + 3 * (
        scored - body_part
    )
    # without sharing, each sample's prompt counts
    assert forward_flops(HAND, [5, 4], prompt_lens=[3, 3]) == scored + 2 * BODY * 3 + PAIR * 6
    # prompt 3, response 2: positions 0..3 run through the body (the last token is never fed back),
    # the head runs for the 2 generated tokens only
    one = 2 * BODY * 4 + PAIR * (1 + 2 + 3 + 4) + 2 * HEAD * 2
    assert generation_flops(HAND, [3], [2]) == one == 8640
    prefill = 2 * BODY * 3 + PAIR * 6
    assert generation_flops(HAND, [3, 3], [2, 2], samples_per_prompt=2) == prefill + 2 * (one - prefill)


def linear_weights(model: nn.Module) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


@pytest.mark.parametrize(
    "config",
    [
        Qwen2Config(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=300,
            tie_word_embeddings=True,
        ),
        LlamaConfig(
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,  # heads * head_dim != hidden
            vocab_size=200,
            tie_word_embeddings=False,
        ),
    ],
    ids=["qwen2_tied", "llama_untied_gqa"],
)
def test_matmul_params_match_a_built_model(config) -> None:
    model = (Qwen2ForCausalLM if isinstance(config, Qwen2Config) else LlamaForCausalLM)(config)
    d = config.to_dict()
    assert matmul_params(d) == linear_weights(model)
    # the rest of the parameters are the embedding table, norms and biases: nothing else multiplies
    hidden, layers = config.hidden_size, config.num_hidden_layers
    norms = (2 * layers + 1) * hidden
    biases = sum(m.bias.numel() for m in model.modules() if isinstance(m, nn.Linear) and m.bias is not None)
    embedding = 0 if config.tie_word_embeddings else config.vocab_size * hidden  # tied: it is the head
    assert sum(p.numel() for p in model.parameters()) == matmul_params(d) + embedding + norms + biases


def test_value_head_params_match_a_critic() -> None:
    config = Qwen2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=100
    )
    critic = Qwen2ForTokenClassification(Qwen2Config(**{**config.to_dict(), "num_labels": 1}))
    assert matmul_params(config.to_dict(), head="value") == linear_weights(critic)


def test_measure_matmul_flops_is_positive_and_restores_threads() -> None:
    before = torch.get_num_threads()
    flops = measure_matmul_flops(seconds=0.05, size=256, threads=1)
    assert 1e6 < flops < 1e15
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("shared", [0, 24], ids=["qwen2_moe_no_shared", "qwen2_moe_shared_expert"])
def test_a_mixture_of_experts_counts_the_weights_a_token_multiplies(shared: int) -> None:
    """Top-k of the routed experts, the shared expert and its gate, the router (not a dense MLP of
    intermediate_size, which a Qwen2-MoE layer does not have: MFU read 24% high on tiny-moe)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        hidden_size=16, intermediate_size=40, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
        shared_expert_intermediate_size=shared, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=50, tie_word_embeddings=True, mlp_only_layers=[1],
    )  # fmt: skip
    model = Qwen2MoeForCausalLM(config)
    active = 0
    for name, p in model.named_parameters():
        if p.ndim < 2 or "embed_tokens" in name or (not shared and "shared_expert" in name):
            continue
        routed = ".experts." in name or name.endswith((".experts.gate_up_proj", ".experts.down_proj"))
        active += p.numel() * config.num_experts_per_tok // config.num_experts if routed else p.numel()
    active += config.hidden_size * config.vocab_size  # the tied head
    assert matmul_params(config.to_dict()) == active
