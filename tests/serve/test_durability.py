"""`posttrain serve` as a real process, killed with SIGKILL mid-request and stopped with SIGTERM, then
started again on the same state folder: what was durable is there, what was lost says so."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

from .conftest import KEYS, SESSION, free_port, logprobs, result, training

ALICE, BOB = list(KEYS)


class ServeProcess:
    """`python -m posttrain.cli serve` on 127.0.0.1, its log in a file."""

    def __init__(self, model_dir: Path, work: Path) -> None:
        self.model_dir, self.work = model_dir, work
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (work / "keys.json").write_text(json.dumps(KEYS))
        (work / "limits.yaml").write_text("shutdown_grace_seconds: 20\nadapters_per_tenant: 8\n")
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        self.log = self.work / f"serve-{self.starts}.log"
        command = [
            sys.executable, "-m", "posttrain.cli", "--log-level", "INFO", "serve", "--model", str(self.model_dir),
            "--model-name", "tiny", "--keys", str(self.work / "keys.json"), "--state-dir", str(self.work / "state"),
            "--port", str(self.port), "--config", str(self.work / "limits.yaml"),
        ]  # fmt: skip
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
        while True:
            assert self.process.poll() is None, self.log.read_text()[-3000:]
            assert time.time() < deadline, "the server did not start"
            try:
                if httpx.get(f"{self.url}/api/v1/healthz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)

    def stop(self, sig: int) -> int:
        assert self.process is not None
        self.process.send_signal(sig)
        return self.process.wait(timeout=60)

    def client(self, key: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"X-API-Key": key}, timeout=60)


@pytest.fixture
def serve_process(tiny_model_dir: Path, tmp_path: Path) -> Iterator[ServeProcess]:
    running = ServeProcess(tiny_model_dir, tmp_path)
    yield running
    if running.process is not None and running.process.poll() is None:
        running.process.kill()
        running.process.wait()


def new_model(client: httpx.Client, session_id: str, model_seq_id: int) -> str:
    create = {"session_id": session_id, "model_seq_id": model_seq_id, "base_model": "tiny"}
    create["lora_config"] = {"rank": 2, "seed": 0}
    answer = client.post("/api/v1/create_model", json=create).json()
    return result(client, answer["request_id"])["model_id"]


def prompt_logprobs(client: httpx.Client, sampler_id: str) -> list[float]:
    """The sampler's log-probs of a fixed prompt (which weights it samples from, deterministically)."""
    body = {
        "sampling_session_id": sampler_id, "num_samples": 1, "prompt_logprobs": True,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 9, 14, 7, 11]}]},
        "sampling_params": {"max_tokens": 2, "temperature": 1.0, "seed": 0},
    }  # fmt: skip
    answer = client.post("/api/v1/asample", json=body)
    assert answer.status_code == 200, answer.text
    return [
        float(x)
        for x in deserialize_sample_response(result(client, answer.json()["request_id"])).prompt_logprobs[1:]
    ]


def samplers(client: httpx.Client, session_id: str, model_id: str) -> dict[str, str]:
    """Three sampling sessions: on the base model, on named sampler weights, on a snapshot (seq_ids 8, 9)."""
    base = {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": "tiny"}
    ids = {"base": client.post("/api/v1/create_sampling_session", json=base).json()["sampling_session_id"]}
    named = {"model_id": model_id, "seq_id": 8, "path": "for-sampling"}
    path = result(client, client.post("/api/v1/save_weights_for_sampler", json=named).json()["request_id"])[
        "path"
    ]
    on_path = {"session_id": session_id, "sampling_session_seq_id": 1, "model_path": path}
    ids["named"] = client.post("/api/v1/create_sampling_session", json=on_path).json()["sampling_session_id"]
    snapshot = {"model_id": model_id, "seq_id": 9, "sampling_session_seq_id": 2}
    answer = client.post("/api/v1/save_weights_for_sampler", json=snapshot).json()["request_id"]
    ids["snapshot"] = result(client, answer)["sampling_session_id"]
    return ids


@pytest.mark.slow  # the default suite's time on 2 cores (CI runs it with -m slow)
def test_a_killed_server_restarts_with_what_was_durable(serve_process: ServeProcess) -> None:
    server = serve_process
    server.start()
    with server.client(ALICE) as alice:
        session_id = alice.post("/api/v1/create_session", json=SESSION).json()["session_id"]
        create = {
            "session_id": session_id,
            "model_seq_id": 0,
            "base_model": "tiny",
            "lora_config": {"rank": 2},
        }
        created = alice.post("/api/v1/create_model", json=create).json()["request_id"]
        model_id = result(alice, created)["model_id"]
        for seq_id, verb in ((1, "forward_backward"), (2, "optim_step")):
            result(alice, training(alice, model_id, seq_id, verb))
        save = {"model_id": model_id, "seq_id": 3, "path": "ckpt"}
        saved = result(alice, alice.post("/api/v1/save_weights", json=save).json()["request_id"])["path"]
        forward_id = training(alice, model_id, 4, "forward")
        at_save = result(alice, forward_id)
        for seq_id, verb in ((5, "forward_backward"), (6, "optim_step")):  # steps after the save: not durable
            result(alice, training(alice, model_id, seq_id, verb))
        assert logprobs(result(alice, training(alice, model_id, 7, "forward"))) != logprobs(at_save)
        unsaved = new_model(alice, session_id, 1)  # never saved
        sampler_ids = samplers(alice, session_id, model_id)
        sampled = {kind: prompt_logprobs(alice, sampler_ids[kind]) for kind in ("base", "named")}
        assert sampled["base"] != pytest.approx(sampled["named"], abs=1e-4)  # the trained weights differ
        in_flight = training(alice, model_id, 11, "optim_step")  # waits for seq_id 10, which never comes
    server.process.kill()  # type: ignore[union-attr]
    server.process.wait()  # type: ignore[union-attr]

    server.start()
    assert "recovered from the journal" in server.log.read_text()
    with server.client(ALICE) as alice, server.client(BOB) as bob:
        assert result(alice, created)["model_id"] == model_id  # finished results are still there
        # the SDK sending create_model again (its answer lost in the restart) gets the first request, not a 409
        assert alice.post("/api/v1/create_model", json=create).json()["request_id"] == created
        assert result(alice, forward_id) == at_save
        lost = result(alice, in_flight)
        assert (
            lost["error"].startswith("the server restarted while this request ran") and saved in lost["error"]
        )
        assert training(alice, model_id, 4, "forward") == forward_id  # a seq_id seen before: the same request
        # the model comes back from its save, with the same id, and its seq_ids go on
        assert logprobs(result(alice, training(alice, model_id, 12, "forward"))) == pytest.approx(
            logprobs(at_save), abs=1e-6
        )
        # sampling sessions on the base model and on saved sampler weights are opened again; a snapshot is
        # lost and says so; another tenant still cannot reach them
        assert bob.get(f"/api/v1/samplers/{sampler_ids['named']}").status_code == 404
        for kind in ("base", "named"):
            assert prompt_logprobs(alice, sampler_ids[kind]) == pytest.approx(sampled[kind], abs=1e-5)
        snapshot = alice.get(f"/api/v1/samplers/{sampler_ids['snapshot']}")
        assert snapshot.status_code == 410 and "snapshot" in snapshot.text and model_id in snapshot.text
        gone = alice.post("/api/v1/get_info", json={"model_id": unsaved, "type": "get_info"})
        assert gone.status_code == 410 and unsaved in gone.text and "save_state" in gone.text
        # ownership holds after the restart
        assert bob.post("/api/v1/retrieve_future", json={"request_id": forward_id}).status_code == 404
        assert (
            bob.post("/api/v1/get_info", json={"model_id": model_id, "type": "get_info"}).status_code == 404
        )
        beat = {"session_id": session_id, "type": "session_heartbeat"}
        assert bob.post("/api/v1/session_heartbeat", json=beat).status_code == 404
        assert alice.post("/api/v1/session_heartbeat", json=beat).status_code == 200
        load = {"session_id": bob.post("/api/v1/create_session", json=SESSION).json()["session_id"]}
        load |= {"model_seq_id": 0, "path": saved, "optimizer": True}
        assert bob.post("/api/v1/load_weights", json=load).status_code == 404

        # a graceful stop: the running request finishes, the waiting one fails, unsaved models are kept
        third = new_model(alice, session_id, 2)
        for seq_id, verb in ((1, "forward_backward"), (2, "optim_step")):
            result(alice, training(alice, third, seq_id, verb))
        third_now = logprobs(result(alice, training(alice, third, 3, "forward")))
        running = training(alice, model_id, 13, "forward_backward")
        waiting = training(alice, model_id, 15, "optim_step")  # seq_id 14 never comes
    assert server.stop(signal.SIGTERM) == 0
    assert "stopped:" in server.log.read_text()

    server.start()
    with server.client(ALICE) as alice:
        assert "loss:sum" in deserialize_forward_backward_output(result(alice, running)).metrics
        assert "the server stopped while this request waited" in result(alice, waiting)["error"]
        assert logprobs(result(alice, training(alice, third, 4, "forward"))) == pytest.approx(
            third_now, abs=1e-6
        )
        # a session reopened after a restart is journaled still: it survives the next one too
        assert prompt_logprobs(alice, sampler_ids["named"]) == pytest.approx(sampled["named"], abs=1e-5)
    assert server.stop(signal.SIGTERM) == 0


def test_a_seq_id_missing_longer_than_the_gap_limit_is_skipped() -> None:
    """The SDK spends a seq_id before sending; after a 429 it retried for its whole window it never sends
    it again: the model's later requests go on without it, and the late one is refused as used."""
    import concurrent.futures

    from posttrain.serve.futures import Sequencer

    sequencer = Sequencer()
    ran: list[int] = []

    def start(n: int):  # noqa: ANN202
        def begin() -> concurrent.futures.Future:
            ran.append(n)
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(n)
            return done

        return begin

    assert sequencer.submit("m", 1, start(1)).result() == 1
    later = [sequencer.submit("m", n, start(n)) for n in (3, 4)]  # seq_id 2 never comes
    assert sequencer.skip_gaps(older_than_s=60) == [] and ran == [1]  # not waited long enough
    assert sequencer.skip_gaps(older_than_s=0) == [("m", 2)]
    assert [f.result(timeout=5) for f in later] == [3, 4] and ran == [1, 3, 4]
    with pytest.raises(ValueError, match="seq_id 2 of m was already used"):
        sequencer.submit("m", 2, start(2)).result()
