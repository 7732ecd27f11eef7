"""The backend's call queue: per-model order kept, other models' waiting passes shared, failures isolated;
and, end to end, two LoRA clients' requests sharing one pass give what each gives alone."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from tinker import types

from posttrain.client import ServiceClient
from posttrain.client.call_queue import CallQueue, SharedCall


class Recorder:
    def __init__(self) -> None:
        self.passes: list[list[str]] = []

    def run(self, calls: Sequence[SharedCall]) -> list[str]:
        if any(c.payload == "bad" for c in calls):
            raise ValueError("a bad request")
        self.passes.append([c.payload for c in calls])
        return [f"done {c.payload}" for c in calls]


def blocked_queue(max_tokens: int = 100) -> tuple[CallQueue, Recorder, threading.Event, list[str]]:
    """A queue whose thread waits on a gate, so the calls submitted next are all waiting together."""
    recorder, gate, log = Recorder(), threading.Event(), []
    queue = CallQueue(recorder.run, max_tokens)
    queue.submit(gate.wait)
    return queue, recorder, gate, log


def shared(kind: str, key: str, payload: str, tokens: int = 10) -> SharedCall:
    return SharedCall(kind, key, tokens, payload)


def test_waiting_passes_of_other_models_share_and_each_model_keeps_its_order() -> None:
    queue, recorder, gate, log = blocked_queue()
    futures = [
        queue.submit_shared(shared("fb", "a", "a1")),
        queue.submit(lambda: log.append("a optim"), "a"),
        queue.submit_shared(shared("fb", "b", "b1")),
        queue.submit_shared(shared("fb", "a", "a2")),  # behind a's optim: may not join a1's pass
        queue.submit_shared(shared("fwd", "c", "c1")),  # another kind: its own pass
        queue.submit_shared(shared("fb", "c", "c2")),  # behind c1 (same model): stays behind it
        queue.submit(lambda: log.append("barrier")),
        queue.submit_shared(shared("fb", "d", "d1")),  # behind a barrier: never moves ahead of it
    ]
    gate.set()
    results = [f.result(timeout=10) for f in futures]
    assert results == ["done a1", None, "done b1", "done a2", "done c1", "done c2", None, "done d1"]
    assert recorder.passes == [["a1", "b1"], ["a2"], ["c1"], ["c2"], ["d1"]]
    assert log == ["a optim", "barrier"]
    queue.close()


def test_a_model_that_floods_the_queue_does_not_hold_back_another() -> None:
    """Passes each filling the token budget cannot share: the waiting models take turns (least recently
    served first), each model's own calls still in order."""
    queue, recorder, gate, _ = blocked_queue(max_tokens=25)
    futures = [queue.submit_shared(shared("fb", "a", f"a{i}", tokens=25)) for i in range(4)]
    futures.append(queue.submit_shared(shared("fb", "b", "b0", tokens=5)))
    futures.append(queue.submit_shared(shared("fb", "b", "b1", tokens=25)))
    gate.set()
    [f.result(timeout=10) for f in futures]
    assert recorder.passes == [["a0"], ["b0"], ["a1"], ["b1"], ["a2"], ["a3"]]
    queue.close()


def test_a_shared_pass_stops_at_its_token_budget() -> None:
    queue, recorder, gate, _ = blocked_queue(max_tokens=25)
    futures = [queue.submit_shared(shared("fb", k, k)) for k in "abcd"]
    gate.set()
    [f.result(timeout=10) for f in futures]
    assert recorder.passes == [["a", "b"], ["c", "d"]]
    queue.close()


def test_a_failing_request_fails_alone() -> None:
    queue, recorder, gate, _ = blocked_queue()
    good, bad, other = (
        queue.submit_shared(shared("fb", k, p)) for k, p in zip("abc", ["a", "bad", "c"], strict=True)
    )
    gate.set()
    assert good.result(timeout=10) == "done a" and other.result(timeout=10) == "done c"
    with pytest.raises(ValueError, match="a bad request"):
        bad.result(timeout=10)
    assert recorder.passes == [["a"], ["c"]]  # the shared pass failed; each ran again alone
    queue.close()


def test_no_sharing_when_the_budget_is_zero() -> None:
    queue, recorder, gate, _ = blocked_queue(max_tokens=0)
    futures = [queue.submit_shared(shared("fb", k, k)) for k in "ab"]
    gate.set()
    [f.result(timeout=10) for f in futures]
    assert recorder.passes == [["a"], ["b"]]
    queue.close()


def sft_data(seed: int) -> list[types.Datum]:
    gen = torch.Generator().manual_seed(seed)
    data = []
    for n in (9, 12, 7):
        tokens = torch.randint(4, 200, (n + 1,), generator=gen).tolist()
        data.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * n},
            )
        )
    return data


def test_two_lora_clients_share_a_pass_and_train_as_if_alone(tiny_model_dir: Path, tmp_path: Path) -> None:
    adam = types.AdamParams(learning_rate=1e-2)

    def run(together: bool) -> tuple[list[float], dict[int, int]]:
        with ServiceClient("local", root_dir=tmp_path / str(together), seed=0) as service:
            clients = [
                service.create_lora_training_client(str(tiny_model_dir), rank=4, seed=s) for s in (1, 2)
            ]
            losses = []
            for step in range(3):
                if together:  # both submitted before either runs: one pass for both
                    gate = threading.Event()
                    service.backend.submit(gate.wait)
                    futures = [
                        c.forward_backward(sft_data(step + i), "cross_entropy") for i, c in enumerate(clients)
                    ]
                    steps = [c.optim_step(adam) for c in clients]
                    gate.set()
                else:
                    futures, steps = [], []
                    for i, c in enumerate(clients):
                        futures.append(c.forward_backward(sft_data(step + i), "cross_entropy"))
                        futures[-1].result()
                        steps.append(c.optim_step(adam))
                        steps[-1].result()
                losses += [f.result().metrics["loss:sum"] for f in futures]
                [s.result() for s in steps]
            return losses, dict(service.backend.calls.shared_passes)

    alone, alone_passes = run(together=False)
    shared_losses, shared_passes = run(together=True)
    assert alone_passes == {1: 6} and shared_passes.get(2) == 3
    torch.testing.assert_close(torch.tensor(shared_losses), torch.tensor(alone), atol=1e-4, rtol=1e-5)
