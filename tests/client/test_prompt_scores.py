"""tinker's prompt-side `sample` options on the local backend, checked against a plain transformers forward of
the same model: top-k, target and alternative-token prompt log-probs, and the last n positions only."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain import client as tinker
from posttrain.client import types


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tinker.ServiceClient]:
    with tinker.ServiceClient(backend="local", root_dir=tmp_path_factory.mktemp("api")) as svc:
        yield svc


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> AutoModelForCausalLM:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def next_token_logits(model: AutoModelForCausalLM, ids: list[int]) -> torch.Tensor:
    """(T - 1, V): row i is the distribution over prompt token i + 1."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, :-1].float()


def test_topk_targets_and_last_n_equal_a_plain_forward(
    service: tinker.ServiceClient, tiny_model_dir: Path, reference: AutoModelForCausalLM
) -> None:
    sampler = service.create_sampling_client(base_model=str(tiny_model_dir))
    ids = sampler.get_tokenizer().encode("12+34=46 and 7+8=15")
    prompt = types.ModelInput.from_ints(ids)
    log_p = torch.log_softmax(next_token_logits(reference, ids), -1)  # (T-1, V)
    length = len(ids)
    targets = torch.full((length - 1, 8), -1, dtype=torch.long)  # sparse enough for the SDK to keep it CSR
    targets[:, 0] = torch.tensor(ids[1:])  # the prompt's own tokens: equal to its log-probs
    targets[2, 1], targets[5, 2] = 7, 11
    params = types.SamplingParams(max_tokens=2, seed=0)
    out = sampler.sample(
        prompt, 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=4,
        target_prompt_logprobs=types.TensorData.from_torch(targets),
    ).result()  # fmt: skip
    top = out.topk_prompt_logprobs
    assert top is not None and top[0] is None and len(top) == length
    want_values, want_ids = log_p.topk(4, dim=-1)
    for i in range(1, length):
        assert [t for t, _ in top[i]] == want_ids[i - 1].tolist()
        np.testing.assert_allclose([v for _, v in top[i]], want_values[i - 1].numpy(), atol=1e-5)
    got = out.target_prompt_logprobs.to_torch()
    assert got.shape == targets.shape and got.dtype == torch.float32
    want = torch.where(targets >= 0, log_p.gather(-1, targets.clamp(min=0)), torch.zeros(()))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got[:, 0].numpy(), np.array(out.prompt_logprobs[1:]), atol=1e-6)

    # a sparse table comes back sparse, its cells only; the last n positions only
    sparse = types.TensorData.from_torch_sparse(targets, pad_value=-1)
    assert sparse.sparse_crow_indices is not None
    last = sampler.sample(
        prompt, 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=2, target_prompt_logprobs=sparse,
        prompt_logprobs_last_n=3,
    ).result()  # fmt: skip
    answer = last.target_prompt_logprobs
    assert answer.sparse_crow_indices == sparse.sparse_crow_indices
    assert answer.sparse_col_indices == sparse.sparse_col_indices
    torch.testing.assert_close(answer.to_torch(), want, atol=1e-5, rtol=0)
    assert last.prompt_logprobs[: length - 3] == [None] * (length - 3)
    np.testing.assert_allclose(last.prompt_logprobs[-3:], out.prompt_logprobs[-3:], atol=1e-6)
    assert last.topk_prompt_logprobs[: length - 3] == [None] * (length - 3)
    assert [t for t, _ in last.topk_prompt_logprobs[-1]] == want_ids[-1, :2].tolist()


def test_alternative_prompt_tokens_are_draws_of_the_tempered_distribution(
    service: tinker.ServiceClient, tiny_model_dir: Path, reference: AutoModelForCausalLM
) -> None:
    sampler = service.create_sampling_client(base_model=str(tiny_model_dir))
    ids = sampler.get_tokenizer().encode("5+6=11")
    prompt = types.ModelInput.from_ints(ids)
    logits = next_token_logits(reference, ids)
    seeded = types.SamplingParams(max_tokens=1, temperature=0.7, seed=3)
    first = sampler.sample(prompt, 1, seeded, prompt_alt_tokens_k=64).result().prompt_alt_tokens
    again = sampler.sample(prompt, 1, seeded, prompt_alt_tokens_k=64).result().prompt_alt_tokens
    tokens, logprobs = first.tokens.to_torch(), first.logprobs.to_torch()
    assert tokens.shape == (len(ids) - 1, 64) and torch.equal(tokens, again.tokens.to_torch())  # seeded
    tempered = torch.log_softmax(logits / 0.7, -1)
    torch.testing.assert_close(logprobs, tempered.gather(-1, tokens), atol=1e-5, rtol=0)
    # draws follow the distribution: the likeliest token is drawn about as often as its probability says
    top_p = tempered.exp().max(-1)
    share = (tokens == tempered.argmax(-1, keepdim=True)).float().mean(-1)
    assert (share - top_p.values).abs().max() < 0.25
    greedy = types.SamplingParams(max_tokens=1, temperature=0.0)
    argmax = sampler.sample(prompt, 1, greedy, prompt_alt_tokens_k=2).result().prompt_alt_tokens
    assert torch.equal(argmax.tokens.to_torch(), logits.argmax(-1, keepdim=True).expand(-1, 2))


def test_bad_prompt_options_name_the_problem(service: tinker.ServiceClient, tiny_model_dir: Path) -> None:
    sampler = service.create_sampling_client(base_model=str(tiny_model_dir))
    ids = sampler.get_tokenizer().encode("1+2=")
    prompt, params = types.ModelInput.from_ints(ids), types.SamplingParams(max_tokens=1)
    with pytest.raises(ValueError, match="prompt_logprobs_last_n needs prompt_logprobs"):
        sampler.sample(prompt, 1, params, prompt_logprobs_last_n=1)
    with pytest.raises(ValueError, match=f"prompt_logprobs_last_n must be in 1..{len(ids) - 1}"):
        sampler.sample(prompt, 1, params, include_prompt_logprobs=True, prompt_logprobs_last_n=len(ids))
    wrong_rows = types.TensorData.from_torch(torch.zeros(len(ids), 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[len\(prompt\) - 1, K\]"):
        sampler.sample(prompt, 1, params, target_prompt_logprobs=wrong_rows)
    too_big = types.TensorData.from_torch(torch.full((len(ids) - 1, 1), 10**7, dtype=torch.long))
    with pytest.raises(ValueError, match="token ids are 0.."):
        sampler.sample(prompt, 1, params, target_prompt_logprobs=too_big)
    with pytest.raises(ValueError, match="topk_prompt_logprobs must be in 0..1024"):
        sampler.sample(prompt, 1, params, topk_prompt_logprobs=5000)
