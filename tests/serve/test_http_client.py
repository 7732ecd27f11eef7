"""posttrain's own `http` backend against a real `posttrain serve`: the same script gives the local backend's
losses, samples and restored states; a training request retried after its answer was lost is applied once;
the server's refusals arrive with its own words; a wrong key is told as such."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import torch
from tinker.proto import tinker_public_pb2 as pb

from posttrain import client as tinker
from posttrain.client import types
from posttrain.client.http_transport import (
    AiohttpTransport,
    ApiStatusError,
    AuthenticationError,
    HttpApiError,
    Reply,
    RetriesExhausted,
    RetryPolicy,
    TransportError,
    UserRequestFailed,
)

from .conftest import KEYS, Running

ALICE, BOB = list(KEYS)
ADAM = types.AdamParams(learning_rate=1e-2)
FAST = RetryPolicy(base_delay_s=0.01, max_delay_s=0.05)


def http_service(server: Running, key: str = ALICE, **kwargs: Any) -> tinker.ServiceClient:
    return tinker.ServiceClient(backend="http", base_url=server.url, api_key=key, **kwargs)


def sft_data(tokenizer: Any) -> list[types.Datum]:
    data = []
    for text in ("1+2=3", "4+4=8", "7+1=8"):
        ids = tokenizer.encode(text)
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(ids[:-1]),
                loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
            )
        )
    return data


def negative_logprob_sum(data: list[types.Datum], lps: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
    return -sum(lp.sum() for lp in lps), {"tokens": float(sum(len(lp) for lp in lps))}  # type: ignore[return-value]


def script(service: tinker.ServiceClient, base_model: str) -> dict[str, Any]:
    """One user script, unchanged across backends: train, custom loss, sample, save, restore, train on."""
    training = service.create_lora_training_client(base_model, rank=4, seed=0)
    tokenizer = training.get_tokenizer()
    data = sft_data(tokenizer)
    losses = []
    for _ in range(3):
        fb = training.forward_backward(data, "cross_entropy")  # pipelined: the step is sent before we wait
        step = training.optim_step(ADAM)
        losses.append(fb.result().metrics["loss:sum"])
        assert step.result().metrics["learning_rate:mean"] == pytest.approx(1e-2)
    rl = [
        types.Datum(
            model_input=d.model_input,
            loss_fn_inputs={
                "target_tokens": d.loss_fn_inputs["target_tokens"],
                **{
                    k: [v] * d.model_input.length
                    for k, v in (("logprobs", -2.0), ("advantages", 0.5), ("weights", 1.0))
                },
            },
        )
        for d in data
    ]
    gspo = {"policy_loss": "gspo", "loss_agg_mode": "seq-mean-token-mean"}  # a string config on the wire
    policy = training.forward(rl, "policy_loss", gspo)
    custom = training.forward_backward_custom(data, negative_logprob_sum)
    training.optim_step(ADAM)
    losses.append(custom.result().metrics["loss:sum"])
    sampler = training.save_weights_and_get_sampling_client()
    prompt = types.ModelInput.from_ints(tokenizer.encode("1+2="))
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=7)
    sample = sampler.sample(prompt, 3, params, include_prompt_logprobs=True).result()
    scored = sampler.compute_logprobs(prompt).result()
    ids = prompt.to_ints()
    targets = torch.full((len(ids) - 1, 2), -1, dtype=torch.long)
    targets[:, 1] = torch.tensor(ids[1:])
    options = sampler.sample(
        prompt, 1, params, include_prompt_logprobs=True, topk_prompt_logprobs=2, prompt_logprobs_last_n=2,
        target_prompt_logprobs=types.TensorData.from_torch(targets), prompt_alt_tokens_k=3,
    ).result()  # fmt: skip
    saved = training.save_state("after-four").result()
    restored = service.create_training_client_from_state_with_optimizer(saved.path)
    for client in (training, restored):  # one more identical step: the Adam moments came along
        client.forward_backward(data, "cross_entropy")
        client.optim_step(ADAM)
    after = [c.forward(data, "cross_entropy").result().metrics["loss:sum"] for c in (training, restored)]

    async def awaited() -> float:  # the futures are awaitable too
        return (await training.forward(data, "cross_entropy")).metrics["loss:sum"]

    return {
        "losses": losses,
        "custom_metrics": custom.result().metrics,
        "policy_loss": policy.result().metrics["loss:sum"],
        "samples": [list(s.tokens) for s in sample.sequences],
        "sample_logprobs": [list(s.logprobs or []) for s in sample.sequences],
        "sequence_ids": [s.sequence_id for s in sample.sequences],
        "prompt_logprobs": sample.prompt_logprobs,
        "scored": scored,
        "options": {
            "prompt_logprobs": options.prompt_logprobs,
            "topk": options.topk_prompt_logprobs,
            "targets": options.target_prompt_logprobs.to_torch().tolist(),
            "alt_tokens": options.prompt_alt_tokens.tokens.to_torch().tolist(),
            "alt_logprobs": options.prompt_alt_tokens.logprobs.to_torch().tolist(),
        },
        "path": saved.path,
        "after": after,
        "awaited": asyncio.run(awaited()),
        "info": training.get_info(),
    }


def test_one_script_gives_the_same_results_on_local_and_http(
    server: Running, tiny_model_dir: Path, tmp_path: Path
) -> None:
    with tinker.ServiceClient(backend="local", root_dir=tmp_path) as local:
        on_local = script(local, str(tiny_model_dir))
    with http_service(server) as remote:
        assert type(remote).__name__ == "HttpServiceClient" and isinstance(remote, tinker.ServiceClient)
        names = [m.model_name for m in remote.get_server_capabilities().supported_models]
        assert names == [server.model_name]
        on_http = script(remote, server.model_name)
    assert on_http["losses"] == pytest.approx(on_local["losses"], rel=1e-5, abs=1e-5)
    assert on_http["losses"][-2] < 0.8 * on_http["losses"][0]  # it learns
    custom, custom_local = on_http["custom_metrics"], on_local["custom_metrics"]
    assert custom["tokens"] == custom_local["tokens"] == 12.0
    assert custom["surrogate_loss:sum"] == pytest.approx(custom_local["surrogate_loss:sum"], abs=1e-5)
    assert on_http["policy_loss"] == pytest.approx(on_local["policy_loss"], rel=1e-5, abs=1e-6)
    assert on_http["samples"] == on_local["samples"]  # seeded samples repeat exactly
    for got, want in zip(on_http["sample_logprobs"], on_local["sample_logprobs"], strict=True):
        assert got == pytest.approx(want, abs=1e-5)
    assert len(set(on_http["sequence_ids"])) == 3 and all(on_http["sequence_ids"])
    for key in ("prompt_logprobs", "scored"):
        assert on_http[key][0] is None and on_local[key][0] is None
        assert on_http[key][1:] == pytest.approx(on_local[key][1:], abs=1e-5)
    got, want = on_http["options"], on_local["options"]  # the prompt-side options, through the wire
    assert got["alt_tokens"] == want["alt_tokens"] and got["topk"][:-2] == want["topk"][:-2] == [None] * 2
    for i in (-2, -1):
        assert [t for t, _ in got["topk"][i]] == [t for t, _ in want["topk"][i]]
        assert [v for _, v in got["topk"][i]] == pytest.approx([v for _, v in want["topk"][i]], abs=1e-5)
    for key in ("targets", "alt_logprobs"):
        assert torch.tensor(got[key]) == pytest.approx(torch.tensor(want[key]), abs=1e-5)
    assert got["prompt_logprobs"][-2:] == pytest.approx(on_http["prompt_logprobs"][-2:], abs=1e-5)
    assert on_http["path"].startswith("tinker://") and on_http["path"].endswith("/weights/after-four")
    trained, restored = on_http["after"]
    assert restored == pytest.approx(trained, rel=1e-4)
    assert on_http["after"] == pytest.approx(on_local["after"], rel=1e-5, abs=1e-5)
    assert on_http["awaited"] == pytest.approx(on_http["after"][0])
    info = on_http["info"]
    assert info.is_lora and info.lora_rank == 4 and info.model_name == server.model_name


class DropFirstAnswer:
    """Sends every request to the server; the first answer to each of `paths` is thrown away after the
    server has handled it (a connection lost on the way back), so the client has to send it again."""

    def __init__(self, *paths: str) -> None:
        self.inner = AiohttpTransport()
        self.seq_ids: dict[str, list[int]] = {path: [] for path in paths}

    async def send(
        self, method: str, url: str, body: bytes | None, headers: Mapping[str, str], timeout_s: float
    ) -> Reply:
        reply = await self.inner.send(method, url, body, headers, timeout_s)
        seen = self.seq_ids.get(urlsplit(url).path)
        if seen is not None:
            seen.append(seq_id_of(body, headers))
            if len(seen) == 1:
                raise TransportError("answer lost on the way back (test)")
        return reply

    async def aclose(self) -> None:
        await self.inner.aclose()


def seq_id_of(body: bytes | None, headers: Mapping[str, str]) -> int:
    assert body is not None
    if headers.get("Content-Type") == "application/x-protobuf":
        message = pb.ForwardBackwardRequest()
        message.ParseFromString(body)
        return message.seq_id
    return json.loads(body)["seq_id"]


def accepted(server: Running, kind: str) -> int:
    """How many `kind` requests the server has taken on (each is applied once): its futures, white-box."""
    return server.state.futures.accepted[kind]


def test_a_retried_training_request_is_applied_once(server: Running) -> None:
    dropping = DropFirstAnswer("/api/v1/forward_backward", "/api/v1/optim_step")
    steps_before = accepted(server, "optim_step")
    with http_service(server, transport=dropping, retry=FAST) as flaky, http_service(server) as steady:
        clients = [s.create_lora_training_client(server.model_name, rank=4, seed=3) for s in (flaky, steady)]
        data = sft_data(clients[0].get_tokenizer())
        before = clients[1].forward(data, "cross_entropy").result().metrics["loss:sum"]  # the same start
        grad_norms: list[list[float]] = [[], []]
        for _ in range(2):
            for client, norms in zip(clients, grad_norms, strict=True):
                client.forward_backward(data, "cross_entropy")
                norms.append(client.optim_step(ADAM).result().metrics["grad_norm:mean"])
        flaky_loss, steady_loss = [
            c.forward(data, "cross_entropy").result().metrics["loss:sum"] for c in clients
        ]
    # the first forward_backward and optim_step each went out twice with one seq_id (the last is a forward)
    assert dropping.seq_ids == {"/api/v1/forward_backward": [1, 1, 3, 5], "/api/v1/optim_step": [2, 2, 4]}
    assert accepted(server, "optim_step") - steps_before == 4  # two clients x two steps: no step twice
    assert grad_norms[0] == pytest.approx(grad_norms[1], rel=1e-6)  # a doubled backward would double these
    assert flaky_loss != pytest.approx(before, rel=1e-3)  # the steps did move the weights
    assert flaky_loss == pytest.approx(steady_loss, rel=1e-6, abs=1e-6)


class Unreachable:
    """Every request to `path` fails to connect; the rest reach the server."""

    def __init__(self, path: str) -> None:
        self.inner = AiohttpTransport()
        self.path = path
        self.attempts = 0

    async def send(
        self, method: str, url: str, body: bytes | None, headers: Mapping[str, str], timeout_s: float
    ) -> Reply:
        if urlsplit(url).path == self.path:
            self.attempts += 1
            raise TransportError("ClientConnectorError: connection refused (test)")
        return await self.inner.send(method, url, body, headers, timeout_s)

    async def aclose(self) -> None:
        await self.inner.aclose()


def test_retries_are_bounded_and_a_lost_sequence_stops_with_a_clear_error(server: Running) -> None:
    unreachable = Unreachable("/api/v1/optim_step")
    retry = RetryPolicy(max_attempts=3, base_delay_s=0.01, max_delay_s=0.02)
    with http_service(server, transport=unreachable, retry=retry) as service:
        training = service.create_lora_training_client(server.model_name, rank=4, seed=0)
        data = sft_data(training.get_tokenizer())
        training.forward_backward(data, "cross_entropy").result()
        with pytest.raises(
            RetriesExhausted, match=r"optim_step: gave up after 3 attempts.*ClientConnectorError"
        ):
            training.optim_step(ADAM).result()
        assert unreachable.attempts == 3
        with pytest.raises(HttpApiError, match=r"seq_id 2 .*got no answer.*cannot go on"):
            training.forward(data, "cross_entropy").result()


def test_no_server_at_the_address_is_a_clear_error_after_the_retries() -> None:
    """The default transport's own connection errors count as no answer: retried, then named."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    retry = RetryPolicy(max_attempts=2, base_delay_s=0.01, max_delay_s=0.02)
    with pytest.raises(RetriesExhausted, match=r"create_session: gave up after 2 attempts.*Connect"):
        tinker.ServiceClient(
            backend="http", base_url=f"http://127.0.0.1:{port}", api_key=ALICE, retry=retry, timeout_s=5
        )


def test_the_servers_refusals_arrive_with_its_message(server: Running) -> None:
    with http_service(server, retry=FAST) as service:
        with pytest.raises(
            ApiStatusError, match=r"/api/v1/create_model answered 404: base model 'nope'"
        ) as e:
            service.create_lora_training_client("nope", rank=4)
        assert e.value.status == 404 and "served: tiny" in e.value.detail
        with pytest.raises(
            ValueError, match=r"answered 400: LoRA rank 512 is over the limit max_lora_rank=64"
        ):
            service.create_lora_training_client(server.model_name, rank=512)
        with pytest.raises(ApiStatusError, match="needs a lora_config"):
            service.create_training_client(server.model_name)
        training = service.create_lora_training_client(server.model_name, rank=4, seed=0)
        data = sft_data(training.get_tokenizer())
        with pytest.raises(ValueError, match="unknown loss|not a loss|loss"):  # checked here, as locally
            training.forward_backward(data, "no_such_loss")
        # refused (404): the seq_id is spent on both sides (the server consumes it, as for the SDK), so the
        # model's next requests go through
        with pytest.raises(ApiStatusError, match=r"load_weights answered 404"):
            training.load_state("tinker://abcdefgh:train:0/weights/missing").result()
        # accepted, then failed on the server: the failure and its category arrive with the result
        with pytest.raises(UserRequestFailed, match="ttl_seconds must be > 0"):
            training.save_state("x", ttl_seconds=0).result()
        fb = training.forward_backward(data, "cross_entropy")
        assert training.optim_step(ADAM).result().metrics["grad_norm:mean"] > 0
        assert fb.result().metrics["loss:sum"] > 0


def test_a_wrong_or_missing_key_is_said_plainly(server: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    started = time.perf_counter()
    with pytest.raises(AuthenticationError, match=r"create_session answered 401.*Check the API key"):
        http_service(server, key="tml-not-a-known-key-000000")
    assert time.perf_counter() - started < 5  # a 401 is not retried
    for name in ("TINKER_API_KEY", "POSTTRAIN_API_KEY", "TINKER_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="needs api_key"):
        tinker.ServiceClient(backend="http", base_url=server.url)
    with pytest.raises(ValueError, match="needs base_url"):
        tinker.ServiceClient(backend="http", api_key=ALICE)
    with pytest.raises(ValueError, match="root_dir: settings of the local and ray backends"):
        tinker.ServiceClient(backend="http", base_url=server.url, api_key=ALICE, root_dir="/tmp/x")
    monkeypatch.setenv("TINKER_BASE_URL", server.url)
    monkeypatch.setenv("POSTTRAIN_API_KEY", BOB)  # the environment is enough; the session heartbeats
    with tinker.ServiceClient(backend="http", heartbeat_s=0.05) as service:
        time.sleep(0.3)
        assert service.get_server_capabilities().supported_models
    beats = server.state.meter.requests[("bob", "/api/v1/session_heartbeat", 200)]  # type: ignore[attr-defined]
    assert beats >= 2
