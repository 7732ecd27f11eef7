"""Several LoRA adapters in one pass over the shared base (ApiWorker.*_routed): the same log-probs, losses and
gradients as each adapter run alone, including rows that are identical across adapters (which must not
share a prefix) and rows of one adapter that do."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tinker import types

from posttrain.client.batching import datums_to_batch, loss_inputs, merge_batches, split_output
from posttrain.data import keys
from posttrain.engine.adapter_model import AdapterModel
from posttrain.workers.api_worker import ApiLossSpec, ApiWorker, ApiWorkerSpec, ModelSpec

PROMPT = [5, 17, 23, 42, 8, 9, 31]


def datum(tokens: list[int], **inputs: list[float]) -> types.Datum:
    targets = tokens[1:] + [3]
    loss_inputs = {"target_tokens": types.TensorData(data=targets, dtype="int64", shape=[len(tokens)])}
    for name, values in inputs.items():
        loss_inputs[name] = types.TensorData(data=values, dtype="float32", shape=[len(tokens)])
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=loss_inputs)


def requests() -> list[tuple[list[types.Datum], ApiLossSpec]]:
    gen = torch.Generator().manual_seed(0)

    def tail(n: int) -> list[int]:
        return torch.randint(4, 200, (n,), generator=gen).tolist()

    def weights(n: int) -> list[float]:
        return torch.rand(n, generator=gen).tolist()

    sft = [datum(t, weights=weights(len(t))) for t in (PROMPT + tail(5), PROMPT + tail(3), tail(9), PROMPT)]
    rl = []
    for t in (PROMPT + tail(4), PROMPT, tail(6)):  # PROMPT alone: the same tokens as a row of `sft`
        n = len(t)
        rl.append(datum(t, logprobs=(-torch.rand(n, generator=gen)).tolist(), advantages=weights(n)))
    ppo = [datum(PROMPT + tail(2), logprobs=[-1.0] * 9, advantages=[0.5] * 9)]
    return [
        (sft, ApiLossSpec("cross_entropy")),
        (rl, ApiLossSpec("importance_sampling")),
        (ppo, ApiLossSpec("ppo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})),
    ]


@pytest.fixture()
def worker(tiny_model_dir: Path) -> ApiWorker:
    # several micro-batches in the shared pass; two ranks: two groups of batched matmuls
    worker = ApiWorker(ApiWorkerSpec(micro_batch_size=4))
    for k in range(3):
        worker.create_model(f"m{k}", ModelSpec(str(tiny_model_dir), lora_rank=4 if k < 2 else 2, seed=k))
        model = worker.models[f"m{k}"]
        assert isinstance(model, AdapterModel)
        with torch.no_grad():
            for b in model.adapter.lora_b.values():
                b.normal_(0.0, 0.2)  # B = 0 would hide a delta applied to the wrong tokens
    return worker


def grads(worker: ApiWorker, model_id: str) -> dict[str, torch.Tensor]:
    model = worker.models[model_id]
    assert isinstance(model, AdapterModel)
    out = {n: p.grad.clone() for n, p in model.adapter.named_parameters() if p.grad is not None}
    model.optimizer.zero_grad(set_to_none=True)
    return out


def topk_requests() -> list[tuple[list[types.Datum], ApiLossSpec]]:
    """cross_entropy with K = 3 targets per position (top-K distillation), two requests of different widths."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for lengths in ((12, 5), (7, 9, 3)):
        data = []
        for n in lengths:
            tokens = (PROMPT + torch.randint(4, 200, (n,), generator=gen).tolist())[:n]
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokens),
                    loss_fn_inputs={
                        "target_tokens": types.TensorData.from_torch(
                            torch.randint(4, 200, (n, 3), generator=gen)
                        ),
                        "weights": types.TensorData.from_torch(
                            torch.softmax(torch.randn(n, 3, generator=gen), -1)
                        ),
                    },
                )
            )
        out.append((data, ApiLossSpec("cross_entropy")))
    return out


@pytest.mark.parametrize("verb", ["forward", "forward_backward"])
@pytest.mark.parametrize("k_targets", [False, True])
def test_a_shared_pass_equals_each_adapter_alone(worker: ApiWorker, verb: str, k_targets: bool) -> None:
    made = topk_requests() if k_targets else requests()
    ids = ["m0", "m1", "m2"][: len(made)]
    batches = [datums_to_batch(data) for data, _ in made]
    losses = [spec for _, spec in made]
    alone = [getattr(worker, verb)(m, b, spec) for m, b, spec in zip(ids, batches, losses, strict=True)]
    alone_grads = [grads(worker, m) for m in ids]

    merged = merge_batches(batches)
    specs = [ApiLossSpec(s.name, s.config, loss_inputs(b)) for s, b in zip(losses, batches, strict=True)]
    together = split_output(getattr(worker, f"{verb}_routed")(ids, merged, specs), merged, batches)
    for one, shared, batch in zip(alone, together, batches, strict=True):
        valid = batch[keys.ATTENTION_MASK].bool()
        assert one[keys.API_LOGPROBS][valid].abs().sum() > 0
        torch.testing.assert_close(
            shared[keys.API_LOGPROBS][valid], one[keys.API_LOGPROBS][valid], atol=2e-5, rtol=0
        )
        torch.testing.assert_close(shared[keys.API_LOSS], one[keys.API_LOSS], atol=2e-5, rtol=1e-5)
    for m, before in zip(ids, alone_grads, strict=True):
        after = grads(worker, m)
        assert after.keys() == before.keys()
        assert (verb == "forward") == (not after)
        for name in before:
            if k_targets:  # gradients in the 100s: float32's summation order (the single-target case's
                # relative differences in norm reach 8e-6 too) shows elementwise
                assert float((after[name] - before[name]).norm()) <= 5e-5 * float(before[name].norm()) + 1e-6
            else:
                torch.testing.assert_close(after[name], before[name], atol=1e-5, rtol=1e-4)


def test_a_shared_pass_takes_distinct_adapters_only(worker: ApiWorker) -> None:
    (data, spec), *_ = requests()
    batch = datums_to_batch(data)
    merged = merge_batches([batch, batch])
    with pytest.raises(Exception, match="distinct LoRA adapters"):
        worker.forward_routed(["m0", "m0"], merged, [spec, spec])


def test_the_api_samples_with_the_built_in_or_hf_engine_only() -> None:
    """vLLM is the RL trainer's rollout engine; the explicit API makes sampler engines per snapshot and shares
    LoRA adapters on one base, which it does not do: refused at once, naming the choices."""
    from posttrain.errors import ConfigError

    with pytest.raises(ConfigError, match="rollout_name='vllm'.*rollout_name='native'"):
        ApiWorker(ApiWorkerSpec(rollout_name="vllm"))
