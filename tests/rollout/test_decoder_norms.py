"""The decoder's fused RMS norm equals the model's own norm module, for every architecture it decodes."""

from __future__ import annotations

import importlib

import pytest
import torch

from posttrain.rollout.decoder import _PLAIN_RMS_NORMS, rms_norm

MODULES = {
    "Qwen2RMSNorm": "qwen2",
    "Qwen3RMSNorm": "qwen3",
    "LlamaRMSNorm": "llama",
    "MistralRMSNorm": "mistral",
    "Qwen2MoeRMSNorm": "qwen2_moe",
    "Qwen3MoeRMSNorm": "qwen3_moe",
    "Qwen2VLRMSNorm": "qwen2_vl",
    "Qwen2_5_VLRMSNorm": "qwen2_5_vl",
}


@pytest.mark.parametrize("name", sorted(_PLAIN_RMS_NORMS))
def test_the_fused_norm_equals_the_models_own(name: str) -> None:
    module = importlib.import_module(f"transformers.models.{MODULES[name]}.modeling_{MODULES[name]}")
    norm = getattr(module, name)(48, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(5, 3, 48) * 3
    torch.testing.assert_close(rms_norm(norm, x), norm(x), atol=1e-6, rtol=1e-6)
    half = x.to(torch.bfloat16)  # another dtype: the module itself (its cast order is not the fused op's)
    norm = norm.to(torch.bfloat16)
    assert torch.equal(rms_norm(norm, half), norm(half))
