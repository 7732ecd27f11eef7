"""Several LoRA adapters sampling in one batch on the built-in engine equal each adapter alone (merged)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.engine.lora import untie_output_embeddings
from posttrain.engine.multi_lora import AdapterSpec, MultiLora
from posttrain.models import load_causal_lm
from posttrain.rollout.base import GenerationRequest, SamplingParams
from posttrain.rollout.native import NativeRolloutEngine

from .test_native import prompts

SPECS = {
    "a": AdapterSpec(4, 8.0, ("q_proj", "v_proj", "down_proj")),
    "b": AdapterSpec(2, 4.0, ("q_proj", "v_proj", "down_proj")),  # another rank: another matmul group
    "c": AdapterSpec(4, 4.0, ("k_proj", "o_proj", "up_proj", "lm_head")),  # the LM head routed too
}


@pytest.fixture(scope="module")
def trained(tiny_model_dir: Path) -> MultiLora:
    """Adapters of a training model, with B != 0 (B = 0 would hide any routing error)."""
    model = load_causal_lm(tiny_model_dir)
    untie_output_embeddings(model)
    lora = MultiLora(model)
    for k, (name, spec) in enumerate(SPECS.items()):
        adapter = lora.add(name, spec, torch.float32, torch.device("cpu"), seed=k)
        with torch.no_grad():
            for b in adapter.lora_b.values():
                b.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(k))
    return lora


def merged_engine(model_dir: Path, trained: MultiLora, name: str | None) -> NativeRolloutEngine:
    engine = NativeRolloutEngine(str(model_dir), seed=0)
    if name is not None:
        untie_output_embeddings(engine.model)
        engine.load_weights(trained.merged_weights(name))
    return engine


def test_mixed_adapter_batch_equals_each_adapter_alone(tiny_model_dir: Path, trained: MultiLora) -> None:
    shared = NativeRolloutEngine(str(tiny_model_dir), seed=0)
    router = MultiLora(shared.model)
    for name in SPECS:
        router.add_frozen_copy(f"sampler-{name}", trained.adapters[name])
    shared.enable_adapters(router)
    ps = prompts(tiny_model_dir, n=4)
    greedy = SamplingParams(max_tokens=10, temperature=0.0)
    names = [None, "a", "b", "c"]
    # every prompt under every adapter, interleaved, with the same prompt under several adapters (which
    # must not share a prefill) and a row of the base weights in the same batch
    requests = [
        GenerationRequest(p, greedy, adapter=None if n is None else f"sampler-{n}") for p in ps for n in names
    ]
    together = shared.generate_requests(requests)
    for name in names:
        alone = merged_engine(tiny_model_dir, trained, name).generate(ps, greedy)
        mine = [
            r for r, q in zip(together, requests, strict=True) if q.adapter == (name and f"sampler-{name}")
        ]
        for a, b in zip(alone, mine, strict=True):
            assert a.token_ids == b.token_ids, name
            torch.testing.assert_close(
                torch.tensor(b.log_probs), torch.tensor(a.log_probs), atol=2e-5, rtol=0
            )
    # the adapters changed what is sampled (the test would pass vacuously otherwise)
    outputs = {tuple(r.token_ids) for r in together[:4]}
    assert len(outputs) > 1


def test_a_frozen_copy_does_not_follow_training(tiny_model_dir: Path, trained: MultiLora) -> None:
    shared = NativeRolloutEngine(str(tiny_model_dir), seed=0)
    router = MultiLora(shared.model)
    copy = router.add_frozen_copy("snap", trained.adapters["a"])
    before = {k: v.clone() for k, v in copy.lora_b.items()}
    with torch.no_grad():
        for b in trained.adapters["a"].lora_b.values():
            b.add_(1.0)
    try:
        for k, v in copy.lora_b.items():
            assert torch.equal(v, before[k]) and not v.requires_grad
    finally:
        with torch.no_grad():
            for b in trained.adapters["a"].lora_b.values():
                b.sub_(1.0)


def test_an_unknown_adapter_is_an_error_result(tiny_model_dir: Path) -> None:
    engine = NativeRolloutEngine(str(tiny_model_dir), seed=0)
    result = engine.generate_requests(
        [GenerationRequest([5, 6, 7], SamplingParams(max_tokens=3), adapter="x")]
    )
    assert result[0].stop_reason == "error" and "no adapter 'x'" in (result[0].error or "")
