"""Image chunks over `backend="http"` against a real `posttrain serve` of tiny-vl: the client checks lengths
with the chunks' `expected_tokens` where they are given (the server counts the images where they are not),
the server processes the images, and the answers are the local backend's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain import client as tinker
from posttrain.client import types
from posttrain.client.http_transport import HttpApiError

from ..client.test_image_chunks import image_bytes, logprobs, prompt_chunks, sft_datum
from .conftest import KEYS, Running

ALICE = next(iter(KEYS))


def with_expected(datum: types.Datum, expected: int) -> types.Datum:
    chunks = list(datum.model_input.chunks)
    chunks[1] = types.ImageChunk(data=chunks[1].data, format="png", expected_tokens=expected)
    return types.Datum(model_input=types.ModelInput(chunks=chunks), loss_fn_inputs=datum.loss_fn_inputs)


def test_image_chunks_over_http_give_the_local_answers(
    vl_server: Running, vl_dir: Path, tmp_path: Path
) -> None:
    remote = tinker.ServiceClient(backend="http", base_url=vl_server.url, api_key=ALICE)
    request = remote.create_lora_training_client(vl_server.model_name, rank=4, seed=0)
    try:
        check_over_http(request, vl_dir, tmp_path)
    finally:
        remote.close()


def check_over_http(training: tinker.TrainingClient, vl_dir: Path, tmp_path: Path) -> None:
    tok = training.get_tokenizer()
    data = [with_expected(sft_datum(tok, image_bytes(c), 4), 4) for c in ("red", "blue")]
    on_http = logprobs(training.forward(data, "cross_entropy").result())
    with tinker.ServiceClient(backend="local", root_dir=tmp_path) as local:
        here = local.create_lora_training_client(str(vl_dir), rank=4, seed=0)
        expected = logprobs(here.forward(data, "cross_entropy").result())
    for a, b in zip(on_http, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert training.forward_backward(data, "cross_entropy").result().metrics["loss:sum"] > 0
    sampler = training.save_weights_and_get_sampling_client()
    prompt = types.ModelInput(chunks=prompt_chunks(tok, image_bytes("red"), expected=4))
    out = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=3, seed=0)).result()
    assert [len(s.tokens) for s in out.sequences] == [3, 3]
    assert all(len(s.logprobs) == 3 for s in out.sequences)
    # an image without expected_tokens (advisory in tinker): the client cannot count it, the server does
    unsized = [sft_datum(tok, image_bytes(c), 4) for c in ("red", "blue")]
    assert all(c.expected_tokens is None for d in unsized for c in d.model_input.chunks if hasattr(c, "data"))
    for a, b in zip(logprobs(training.forward(unsized, "cross_entropy").result()), on_http, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    # ... and checks the lengths once it has: targets one short are the server's refusal, naming the datum
    short = types.Datum(
        model_input=unsized[1].model_input,
        loss_fn_inputs={k: v.to_numpy()[:-1].tolist() for k, v in unsized[1].loss_fn_inputs.items()},
    )
    with pytest.raises(
        (ValueError, HttpApiError), match=r"datum 1: model_input has length \d+ but target_tokens has"
    ):
        training.forward([unsized[0], short], "cross_entropy").result()
    # a wrong count: the server's refusal, with both numbers
    wrong = prompt_chunks(tok, image_bytes("red", (112, 56)), expected=4)  # 8 tokens
    n = sum(c.length for c in wrong)
    datum = types.Datum(
        model_input=types.ModelInput(chunks=wrong),
        loss_fn_inputs={"target_tokens": [0] * n, "weights": [0.0] * n},
    )
    with pytest.raises((ValueError, HttpApiError), match=r"expected_tokens=4.* 8 tokens"):
        training.forward([datum], "cross_entropy").result()
