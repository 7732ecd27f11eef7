"""Many tenants' samplers on one engine: LoRA samplers are frozen adapter copies on one shared base, and the
`sample` calls waiting together run as one batch; each result equals the call run alone."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from posttrain import client as tinker
from posttrain.client import types

from .test_client import sft_datum

GREEDY = types.SamplingParams(max_tokens=8, temperature=0.0)
SEEDED = types.SamplingParams(max_tokens=8, temperature=1.0, seed=7)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tinker.ServiceClient]:
    with tinker.ServiceClient(backend="local", root_dir=tmp_path_factory.mktemp("api")) as svc:
        yield svc


def trained_client(service: tinker.ServiceClient, model_dir: Path, text: str, seed: int):  # noqa: ANN201
    tc = service.create_lora_training_client(str(model_dir), rank=4, seed=seed)
    data = [sft_datum(tc.get_tokenizer(), text)]
    for _ in range(3):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=5e-2))
    return tc


def outcome(response: types.SampleResponse) -> list[tuple[list[int], list[float]]]:
    return [(s.tokens, s.logprobs or []) for s in response.sequences]


def assert_same(together: types.SampleResponse, alone: types.SampleResponse) -> None:
    for (t1, lp1), (t2, lp2) in zip(outcome(together), outcome(alone), strict=True):
        assert t1 == t2
        torch.testing.assert_close(torch.tensor(lp1), torch.tensor(lp2), atol=2e-5, rtol=0)


def test_tenants_sample_in_one_batch_and_get_what_each_gets_alone(
    service: tinker.ServiceClient, tiny_model_dir: Path
) -> None:
    a = trained_client(service, tiny_model_dir, "12+34=46", seed=1)
    b = trained_client(service, tiny_model_dir, "99+1=100", seed=2)
    sa, sb = a.save_weights_and_get_sampling_client(), b.save_weights_and_get_sampling_client()
    base = service.create_sampling_client(base_model=str(tiny_model_dir))
    prompt = types.ModelInput.from_ints(a.get_tokenizer().encode("7+8="))
    worker = service.backend.group.dispatcher.worker
    shared = worker.samplers.samplers
    # sampler creation is queued: wait for it, then hold the queue so the calls below wait together
    (
        sa.compute_logprobs(prompt).result(),
        sb.compute_logprobs(prompt).result(),
        base.compute_logprobs(prompt).result(),
    )
    assert (
        shared[sa.sampler_id].engine is shared[sb.sampler_id].engine
    )  # one base copy for every LoRA sampler
    assert shared[base.sampler_id].engine is not shared[sa.sampler_id].engine
    gate = threading.Event()
    service.backend.submit(lambda: gate.wait(30))
    batches_before = service.backend.sample_passes.copy()
    futures = [
        sa.sample(prompt, 3, GREEDY),
        sb.sample(prompt, 2, SEEDED),
        base.sample(prompt, 2, SEEDED),
        sa.sample(prompt, 2, SEEDED, include_prompt_logprobs=True),
    ]
    gate.set()
    together = [f.result() for f in futures]
    assert service.backend.sample_passes - batches_before == {4: 1}  # the four calls: one batch
    alone = [
        sa.sample(prompt, 3, GREEDY).result(),
        sb.sample(prompt, 2, SEEDED).result(),
        base.sample(prompt, 2, SEEDED).result(),
        sa.sample(prompt, 2, SEEDED, include_prompt_logprobs=True).result(),
    ]
    for t, s in zip(together, alone, strict=True):
        assert_same(t, s)
    # the tenants' adapters differ, so their samples do (else the test could not see a routing error)
    assert outcome(together[0]) != outcome(sb.sample(prompt, 3, GREEDY).result())
    assert together[3].prompt_logprobs == pytest.approx(alone[3].prompt_logprobs, nan_ok=True, abs=2e-5)


def test_a_lora_sampler_is_a_snapshot_scored_as_its_training_model(
    service: tinker.ServiceClient, tiny_model_dir: Path
) -> None:
    tc = trained_client(service, tiny_model_dir, "5+5=10", seed=3)
    tok = tc.get_tokenizer()
    sampler = tc.save_weights_and_get_sampling_client()
    ids = tok.encode("3+4=7")
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
    )
    trained = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result()
    torch.testing.assert_close(torch.tensor(scored[1:]), trained, atol=2e-5, rtol=0)
    # training on does not reach the snapshot
    tc.forward_backward([datum], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    assert sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result() == scored
    # a dropped sampler's adapter leaves the shared engine
    worker = service.backend.group.dispatcher.worker
    sampler_id = sampler.sampler_id
    assert sampler_id in worker.samplers.samplers
    del sampler
    gc.collect()
    tc.forward([datum], "cross_entropy").result()  # after the queued close
    service.backend.submit(lambda: None).result()
    assert sampler_id not in worker.samplers.samplers
    assert sampler_id not in worker.samplers._router.adapters
