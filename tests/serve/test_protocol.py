"""The wire and the guards of `posttrain serve`: proto round trips through the SDK's own codecs, keys,
unknown endpoints, retried requests, hostile paths and malformed bodies."""

from __future__ import annotations

import time

import numpy as np
import pytest
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

from posttrain.serve.wire import (
    decode_forward_backward,
    encode_forward_backward_output,
    encode_sample_response,
)

from .conftest import KEYS, SESSION, Running

ALICE, _ = list(KEYS)


def test_forward_backward_requests_and_results_round_trip_through_the_sdk_codecs() -> None:
    sparse = types.TensorData(
        data=[1.0, 2.0],
        dtype="float32",
        shape=[2, 2],
        sparse_crow_indices=[0, 1, 2],
        sparse_col_indices=[1, 0],
    )
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
        loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "mask": sparse},
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[datum], loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.7, "policy_loss": "gspo"}
        ),
        model_id="m",
        seq_id=3,
    )
    call = decode_forward_backward(forward_backward_request_to_proto(request).SerializeToString())
    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ("m", 3, "ppo", False)
    assert call.loss_fn_config == {"clip_low_threshold": 0.7, "policy_loss": "gspo"}
    assert call.data[0].model_input.to_ints() == [5, 6, 7, 8]
    assert call.data[0].loss_fn_inputs["target_tokens"].tolist() == [6, 7, 8, 9]
    assert call.data[0].loss_fn_inputs["mask"].to_numpy().tolist() == [[0.0, 1.0], [2.0, 0.0]]

    out = types.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord",
        loss_fn_outputs=[
            {"logprobs": types.TensorData.from_numpy(np.array([-1.0, -2.0], dtype=np.float32))},
            {"logprobs": types.TensorData.from_numpy(np.array([-3.0], dtype=np.float32))},
        ],
        metrics={"loss:sum": 6.0},
    )
    back = deserialize_forward_backward_output(encode_forward_backward_output(out))
    assert back.metrics == {"loss:sum": 6.0}
    assert [d["logprobs"].tolist() for d in back.loss_fn_outputs] == [[-1.0, -2.0], [-3.0]]

    sequence = types.SampledSequence(
        stop_reason="length",
        sequence_id="r:0",
        tokens_np=np.array([1, 2], dtype=np.int32),
        logprobs_np=np.array([-0.5, -0.25], dtype=np.float32),
    )
    sample = types.SampleResponse(
        sequences=[sequence], prompt_logprobs_np=np.array([np.nan, -1.5], np.float32)
    )
    decoded = deserialize_sample_response(encode_sample_response(sample))
    assert decoded.sequences[0].tokens == [1, 2] and decoded.sequences[0].stop_reason == "length"
    assert decoded.sequences[0].logprobs == [-0.5, -0.25]
    assert decoded.prompt_logprobs[1] == -1.5


def test_keys_health_schema_and_unimplemented_endpoints(server: Running) -> None:
    with server.client(None) as anonymous, server.client("tml-not-a-known-key-000000") as stranger:
        assert anonymous.get("/api/v1/healthz").json() == {"status": "ok"}
        assert anonymous.post("/api/v1/create_session", json=SESSION).status_code == 401
        assert stranger.post("/api/v1/create_session", json=SESSION).status_code == 401
        assert "/api/v1/retrieve_future" in anonymous.get("/openapi.json").json()["paths"]
    with server.client(ALICE) as alice:
        answer = alice.post("/api/v1/copy_weights", json={})
        # not 501: the SDK retries every 5xx for 5 minutes (test_sdk: it reports this one at once)
        assert answer.status_code == 404 and "copy_weights is not implemented" in answer.json()["detail"]


def test_the_sdks_telemetry_is_accepted_and_counted(server: Running) -> None:
    """On by default in every SDK process (every 10 s): refused, it warns with a traceback at each flush."""
    from tinker import types
    from tinker.types.generic_event import GenericEvent

    event = GenericEvent(
        event="GENERIC_EVENT", event_id="e1", event_name="test", event_session_index=0, severity="INFO",
        timestamp="2026-11-29T00:00:00Z",
    )  # fmt: skip
    body = types.TelemetrySendRequest(
        events=[event], platform="linux", sdk_version="0.38.0", session_id="s", process_uuid="p"
    )
    with server.client(ALICE) as alice, server.client(None) as anonymous:
        answer = alice.post("/api/v1/telemetry", json=body.model_dump(mode="json", exclude_none=True))
        assert answer.status_code == 200 and types.TelemetryResponse(**answer.json()).status == "accepted"
        assert anonymous.post("/api/v1/telemetry", json={}).status_code == 401
        metrics = alice.get("/metrics").text
        assert 'endpoint="/api/v1/telemetry",status="200"' in metrics


def wait(client, request_id: str) -> dict:  # noqa: ANN001
    for _ in range(100):
        body = client.post("/api/v1/retrieve_future", json={"request_id": request_id}).json()
        if body.get("type") != "try_again":
            return body
        time.sleep(0.05)
    raise AssertionError(f"{request_id} never finished")


@pytest.fixture(scope="module")
def alice_model(server: Running) -> tuple[str, str]:
    with server.client(ALICE) as alice:
        session_id = alice.post("/api/v1/create_session", json=SESSION).json()["session_id"]
        create = {
            "session_id": session_id,
            "model_seq_id": 0,
            "base_model": "tiny",
            "lora_config": {"rank": 2},
        }
        done = wait(alice, alice.post("/api/v1/create_model", json=create).json()["request_id"])
        return session_id, done["model_id"]


def test_a_retried_request_is_applied_once_and_order_is_kept(server: Running, alice_model: tuple) -> None:
    _, model_id = alice_model
    step = {"model_id": model_id, "adam_params": {"learning_rate": 1e-3}, "type": "optim_step"}
    with server.client(ALICE) as alice:
        later = alice.post("/api/v1/optim_step", json={**step, "seq_id": 2}).json()["request_id"]
        first = alice.post("/api/v1/optim_step", json={**step, "seq_id": 1}).json()["request_id"]
        again = alice.post("/api/v1/optim_step", json={**step, "seq_id": 1}).json()["request_id"]
        assert again == first  # the retry is the same request, not a second step
        assert "metrics" in wait(alice, first) and "metrics" in wait(alice, later)
        unknown = alice.post("/api/v1/retrieve_future", json={"request_id": "nope-1"})
        assert unknown.status_code == 404 and "unknown" in unknown.json()["detail"]


@pytest.mark.parametrize(
    "path",
    [
        "/etc/passwd",
        "../../etc/passwd",
        "tinker://../../etc/weights/x",
        "tinker://abcdefgh:train:0/weights/../../../etc",
        "tinker://abcdefgh:train:0/weights/%2e%2e",
        "tinker://abcdefgh:train:0/sampler_weights/x",
        "file:///etc/passwd",
    ],
)
def test_hostile_paths_never_reach_the_filesystem(
    server: Running, alice_model: tuple, path: str, request: pytest.FixtureRequest
) -> None:
    session_id, model_id = alice_model
    seq_id = 1000 + request.node.callspec.indices["path"]
    with server.client(ALICE) as alice:
        load = {"session_id": session_id, "model_seq_id": 7, "path": path, "optimizer": False}
        assert alice.post("/api/v1/load_weights", json=load).status_code == 404
        sample = {"session_id": session_id, "sampling_session_seq_id": 7, "model_path": path}
        assert alice.post("/api/v1/create_sampling_session", json=sample).status_code == 404
        # a save under a hostile name fails by the name rules (never written); its seq_id then counts as used
        state = server.state.sequencer._models[model_id]  # type: ignore[attr-defined]
        state.next_seq = seq_id  # pretend the steps before it were sent: this test is about the name
        save = {"model_id": model_id, "seq_id": seq_id, "path": path, "type": "save_weights"}
        answer = wait(alice, alice.post("/api/v1/save_weights", json=save).json()["request_id"])
        assert answer["category"] == "user" and "checkpoint name" in answer["error"]


def test_malformed_bodies_are_400s_naming_the_problem(server: Running, alice_model: tuple) -> None:
    session_id, _ = alice_model
    with server.client(ALICE) as alice:
        bad = alice.post(
            "/api/v1/create_model", json={"session_id": session_id, "base_model": "tiny", "x": 1}
        )
        assert bad.status_code == 400 and "model_seq_id" in bad.text and "x" in bad.text
        garbage = alice.post("/api/v1/forward_backward", content=b"\xff\x00garbage")
        assert garbage.status_code == 400 and "ForwardBackwardRequest" in garbage.text
        unknown = {
            "session_id": session_id,
            "model_seq_id": 9,
            "base_model": "Qwen/none",
            "lora_config": {"rank": 2},
        }
        missing = alice.post("/api/v1/create_model", json=unknown)
        assert missing.status_code == 404 and "tiny" in missing.text
        metadata = {**unknown, "base_model": "tiny", "user_metadata": {"k": "v" * 5000}}
        too_long = alice.post("/api/v1/create_model", json=metadata)
        assert too_long.status_code == 400 and "user_metadata" in too_long.text
        other_account = {"session_id": session_id, "model_seq_id": 10, "path": "tinker://x/weights/y"}
        other_account["weights_access_token"] = "someone-elses"
        refused = alice.post("/api/v1/load_weights", json=other_account)
        assert refused.status_code == 400 and "weights_access_token" in refused.text
