"""A rank's failure reaches the driver as one line naming role, rank and cause; a dead rank is named as the
cause even when a peer's error (its collective broke) arrives first."""

from __future__ import annotations

import os
import signal
import time

import pytest

from posttrain.controller.failures import death_reason
from posttrain.errors import WorkerError

RAY_DEATH = """The actor died unexpectedly before finishing this task.
\tclass_name: WorkerHost
\tactor_id: 87683d5f908de51ccb19031601000000
\tpid: 6834
\tnamespace: 29939c16
\tip: 127.0.0.1
The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: \
Worker unexpectedly exits with a connection error code 2. End of file. Some common causes include: (1) ..."""


def test_death_reason_says_which_process_and_how_in_a_few_words() -> None:
    reason = death_reason(RuntimeError(RAY_DEATH))
    assert reason.startswith(
        "process 6834 on 127.0.0.1 exited unexpectedly: killed by a signal (e.g. SIGKILL, the OOM killer) or crashed"
    )
    assert reason.endswith("lower actor.micro_batch_size (or set actor.max_token_len_per_worker) and "
                           "rollout.max_batch_size, or set model.gradient_checkpointing=true")  # fmt: skip
    assert death_reason(RuntimeError("The actor is dead because it was killed by `ray.kill`.\n\tpid: 7")) == (
        "process 7 was killed by ray.kill"
    )


def test_a_dead_rank_is_the_reported_cause_even_when_its_peer_fails_first(ray_cluster: None) -> None:
    from posttrain.controller.worker_group import RayWorkerGroup

    class Peer:
        """Rank 0 fails as a survivor of a broken collective would; rank 1 is killed a moment later."""

        def __init__(self, spec: object, info: object) -> None:
            self.rank = info.rank  # type: ignore[attr-defined]

        def ping(self) -> dict:
            return {"rank": self.rank, "pid": os.getpid()}

        def collective(self) -> None:
            if self.rank == 0:
                time.sleep(0.3)
                raise RuntimeError("Connection closed by peer [127.0.0.1]:4242")
            time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGKILL)

    group = RayWorkerGroup(Peer, None, world_size=2, role="peer", num_cpus_per_worker=0.5, device="cpu")
    try:
        start = time.monotonic()
        with pytest.raises(WorkerError) as info:
            group.call("collective")
        assert time.monotonic() - start < 10
        error = info.value
        assert (error.role, error.rank, error.died) == ("peer", 1, True)
        assert str(error).startswith("peer rank 1 died during collective: process ")
        assert "(rank 0 then failed: RuntimeError: Connection closed by peer" in str(error)
        assert "\n" not in str(error)
    finally:
        group.shutdown()


def test_a_rank_that_raises_alone_is_reported_as_raising(ray_cluster: None) -> None:
    from posttrain.controller.worker_group import RayWorkerGroup

    class Raiser:
        def __init__(self, spec: object, info: object) -> None:
            self.rank = info.rank  # type: ignore[attr-defined]

        def boom(self) -> None:
            if self.rank == 1:
                raise ValueError("bad input on rank 1")

    group = RayWorkerGroup(Raiser, None, world_size=2, role="peer", num_cpus_per_worker=0.5, device="cpu")
    try:
        with pytest.raises(
            WorkerError, match=r"^peer rank 1 raised in boom: ValueError: bad input on rank 1$"
        ) as info:
            group.call("boom")
        assert (info.value.rank, info.value.died) == (1, False)
    finally:
        group.shutdown()


def test_a_collective_without_its_peer_times_out_after_the_configured_seconds(ray_cluster: None) -> None:
    """The group's timeout_s (trainer.collective_timeout_s) is the process group's: no collective waits forever."""
    import ray

    from posttrain.controller.worker_group import RayWorkerGroup

    class Reducer:
        def __init__(self, spec: object, info: object) -> None:
            from posttrain.engine.distributed import init_distributed

            init_distributed(info)  # type: ignore[arg-type]

        def all_reduce(self) -> float:
            import torch
            import torch.distributed as dist

            value = torch.ones(1)
            dist.all_reduce(value)
            return float(value)

    group = RayWorkerGroup(
        Reducer, None, world_size=2, role="peer", num_cpus_per_worker=0.5, device="cpu", timeout_s=6.0
    )
    try:
        assert group.call("all_reduce") == [2.0, 2.0]
        start = time.monotonic()
        with pytest.raises(ray.exceptions.RayTaskError, match="(?i)timed out|timeout"):
            ray.get(group.workers[0].call.remote("all_reduce"), timeout=60)  # rank 1 never joins
        assert 5.5 < time.monotonic() - start < 30
    finally:
        group.shutdown()
