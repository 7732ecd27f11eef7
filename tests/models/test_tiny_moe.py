"""The tiny-moe preset: a Qwen2-MoE at toy sizes, its parameter count, and `make-model` writing it."""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2MoeForCausalLM

from posttrain.cli import main
from posttrain.models import MoePreset, build_tiny_model, load_causal_lm, load_tokenizer
from posttrain.models.tiny import PRESETS

# The count written in the tiny.py module docstring table; keep it true.
DOCUMENTED = 1_217_152


def test_tiny_moe_parameter_count_and_shapes():
    model = build_tiny_model("tiny-moe")
    assert isinstance(model, Qwen2MoeForCausalLM)
    assert sum(p.numel() for p in model.parameters()) == DOCUMENTED  # tied lm_head counted once
    assert model.lm_head.weight is model.model.embed_tokens.weight
    spec = PRESETS["tiny-moe"]
    assert isinstance(spec, MoePreset)
    block = model.model.layers[0].mlp
    # transformers stores the routed experts as fused 3-D parameters (experts, out, in)
    assert block.experts.gate_up_proj.shape == (4, 2 * spec.moe_intermediate_size, spec.hidden_size)
    assert block.experts.down_proj.shape == (4, spec.hidden_size, spec.moe_intermediate_size)
    assert model.config.num_experts_per_tok == 2
    assert model.config.router_aux_loss_coef == 0.001
    assert all(type(layer.mlp).__name__ == "Qwen2MoeSparseMoeBlock" for layer in model.model.layers)


def test_make_model_tiny_moe_loads_with_from_pretrained(tmp_path: Path):
    out = tmp_path / "moe"
    assert main(["make-model", "--preset", "tiny-moe", "--out", str(out), "--corpus-size", "300"]) == 0
    plain = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    ours = load_causal_lm(out)
    tokenizer = load_tokenizer(out)
    assert isinstance(ours, Qwen2MoeForCausalLM)
    assert ours.config.model_type == "qwen2_moe"
    pad = tokenizer.pad_token_id
    reference = build_tiny_model("tiny-moe", seed=0, bos_token_id=pad, eos_token_id=pad, pad_token_id=pad)
    ids = torch.tensor([tokenizer.encode("Question: what is 12 + 30? Answer: 42.")])
    with torch.no_grad():
        logits = ours(ids).logits
        torch.testing.assert_close(plain(ids).logits, logits)
        torch.testing.assert_close(reference(ids).logits, logits)  # the seeded build, saved and loaded back
