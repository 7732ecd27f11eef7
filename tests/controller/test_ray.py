"""Ray worker groups: loopback-only local Ray, split/gather, placement, and errors that name role and rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.controller.worker_group import LocalWorkerGroup, RayWorkerGroup
from posttrain.data import keys
from posttrain.engine.engine_config import EngineConfig
from posttrain.errors import WorkerError
from posttrain.workers.actor_rollout_ref import ActorRolloutRefSpec, ActorRolloutRefWorker

from ..engine.helpers import synthetic_rl_batch

FORWARD = [keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS, keys.RESPONSES]


def spec(model_dir: Path) -> ActorRolloutRefSpec:
    return ActorRolloutRefSpec(
        EngineConfig(model_path=str(model_dir), micro_batch_size=3), with_rollout=False, threads=1
    )


@pytest.fixture(scope="module")
def group(tiny_model_dir: Path, ray_cluster: None):
    g = RayWorkerGroup(ActorRolloutRefWorker, spec(tiny_model_dir), world_size=2, role="actor", device="cpu")
    yield g
    g.shutdown()


def test_local_ray_binds_only_to_loopback(ray_cluster: None) -> None:
    import ray

    nodes = ray.nodes()
    assert nodes and all(n["NodeManagerAddress"] == "127.0.0.1" for n in nodes)


def test_split_and_gather_preserve_row_order(group: RayWorkerGroup, tiny_model_dir: Path) -> None:
    full = synthetic_rl_batch(rows=8)
    batch, mask = full.select(FORWARD, []), full[keys.RESPONSE_MASK]
    distributed = group.call("forward", batch, "actor")[keys.OLD_LOG_PROBS]
    local = LocalWorkerGroup(ActorRolloutRefWorker, spec(tiny_model_dir)).call("forward", batch, "actor")
    assert distributed.shape == (8, batch[keys.RESPONSES].shape[1])
    # padding positions are not defined (each rank trims its own padding), so compare real tokens only
    torch.testing.assert_close(distributed * mask, local[keys.OLD_LOG_PROBS] * mask, atol=1e-5, rtol=0)


def test_placement_reports_each_rank(group: RayWorkerGroup) -> None:
    placement = group.placement()
    assert [p["rank"] for p in placement] == [0, 1]
    assert all(p["node_ip"] == "127.0.0.1" for p in placement)


def test_worker_exception_names_role_rank_and_cause(group: RayWorkerGroup) -> None:
    batch = synthetic_rl_batch(rows=4).select(FORWARD, [])
    with pytest.raises(
        WorkerError, match=r"actor rank [01] raised in forward: ValueError: .*unknown model 'bogus'"
    ):
        group.call("forward", batch, "bogus")


def test_uneven_split_is_rejected(group: RayWorkerGroup) -> None:
    with pytest.raises(WorkerError, match="5 rows cannot be split evenly across 2 workers"):
        group.call("forward", synthetic_rl_batch(rows=5).select(FORWARD, []), "actor")


def test_missing_resources_fail_fast_with_what_exists(tiny_model_dir: Path, ray_cluster: None) -> None:
    with pytest.raises(
        WorkerError, match=r"pool 'actor': asked for 1 node\(s\) with 64 CPU each .* free per node"
    ):
        RayWorkerGroup(ActorRolloutRefWorker, spec(tiny_model_dir), world_size=64, role="actor")


def test_dead_worker_is_reported_by_role_and_rank(tiny_model_dir: Path, ray_cluster: None) -> None:
    """SIGKILL to a worker process: the next call names the role and rank that died (not a raw traceback)."""
    import os
    import signal
    import time

    import ray

    g = RayWorkerGroup(
        ActorRolloutRefWorker, spec(tiny_model_dir), world_size=1, role="critic", device="cpu", timeout_s=60
    )
    os.kill(ray.get(g.workers[0].ping.remote())["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    with pytest.raises(WorkerError, match=r"critic rank 0 died during ping"):
        while time.monotonic() < deadline:  # the raylet notices the death within moments
            g.call("ping")
            time.sleep(0.2)


def test_local_mode_starts_its_own_ray_whatever_ray_address_says() -> None:
    """A user's exported RAY_ADDRESS (their cluster) must not hijack local mode: Ray refused to start with
    num_cpus given, or would have joined that cluster."""
    import os
    import subprocess
    import sys

    script = (
        "from posttrain.controller.ray_env import start_ray, stop_ray, node_addresses\n"
        f"start_ray(num_cpus=1, tmpdir='/tmp/pt-ray-addr-{os.getpid()}')\n"
        "print(node_addresses())\n"
        "stop_ray()\n"
    )
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:1"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "['127.0.0.1']"
