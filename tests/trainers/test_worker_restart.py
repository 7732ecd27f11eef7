"""Worker restarts on a full machine: a Ray of the driver's own with exactly as many CPUs as its 2 workers take,
ranks SIGKILLed from outside at named points (during sampling, forward/backward, a checkpoint save) and once
from the shell; every restart must wait for the dead group's resources and continue from the last checkpoint
with the metrics of the run that was never interrupted.

The deterministic kills use the test-only pause points of `posttrain/controller/pause_points.py`: a worker
stops inside the named call and writes its pid; this test kills it with SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from posttrain.controller.pause_points import PAUSE_ENV, marker
from posttrain.trainers.rl import RLTrainer
from tests.trainers.test_fault import LOCAL, assert_same_metrics, driver_env, metrics_by_step, own_ray
from tests.trainers.test_rl_e2e import reward_file, rl_config, rl_overrides

__all__ = ["own_ray"]  # the fixture, imported for the tests below

ROLE = "actor_rollout_ref"
# The job: 8 steps, a checkpoint every 2, validation every 2 (and before training).
JOB = [*LOCAL[1:], "trainer.total_steps=8", "trainer.save_every=2", "trainer.collective_timeout_s=60"]
# In the order they fire (each counts calls in the process of the workers that a restart started):
# sample #5 of the first workers = step 3's generation (after validation 0, steps 1-2, validation 2), with
# step_2 saved; then step 4's update; step 4's save (rank 0); step 6's save (rank 1, after step_4 was
# saved); validation after step 6 (rank 1); step 7's update (rank 0).
POINTS = [
    (f"{ROLE}:sample:0:5", "sample", 0),
    (f"{ROLE}:forward_backward:1:2", "forward_backward", 1),
    (f"{ROLE}:save_state:0:1", "save_state", 0),
    (f"{ROLE}:save_state:1:2", "save_state", 1),
    (f"{ROLE}:sample:1:3", "sample", 1),
    (f"{ROLE}:forward_backward:0:3", "forward_backward", 0),
]


@pytest.fixture(scope="module")
def straight_run(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path_factory: pytest.TempPathFactory, ray_cluster: None
) -> Path:
    """The uninterrupted run (2 workers on the session's Ray) that every restarted run must repeat."""
    folder = tmp_path_factory.mktemp("straight")
    run = folder / "run"
    job = [reward_file(folder), *JOB, "trainer.backend=ray", "trainer.n_workers_per_node=2"]
    RLTrainer(rl_config(tiny_model_dir, arithmetic_data, run, *job)).fit()
    return run


def start_train(overrides: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    """`posttrain train` as a driver subprocess (it starts the Ray of its own that `own_ray` configures)."""
    return subprocess.Popen(
        [sys.executable, "-m", "posttrain", "train", *overrides],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (its Ray's raylet and the raylet's workers included)."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit():
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(proc.name))
        except (OSError, IndexError, ValueError):
            continue
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def worker_hosts(driver: int) -> list[int]:
    hosts = []
    for pid in descendants(driver):
        try:
            if (Path("/proc") / str(pid) / "cmdline").read_bytes().startswith(b"ray::WorkerHost"):
                hosts.append(pid)
        except OSError:
            continue
    return hosts


def without_restart_count(run: Path) -> None:
    """Drop `fault/restarts` (the one metric a restarted run must differ in) from metrics.jsonl."""
    import json

    steps = metrics_by_step(run)
    for row in steps.values():
        row.pop("fault/restarts", None)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, **r}) + "\n" for s, r in steps.items()))


@pytest.mark.slow
def test_ranks_killed_at_named_points_restart_on_a_full_machine_and_repeat_the_run(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path, straight_run: Path, own_ray: list[str]
) -> None:
    pauses = tmp_path / "pauses"
    pauses.mkdir()
    run = tmp_path / "run"
    job = [reward_file(tmp_path), *JOB, *own_ray, f"trainer.max_restarts={len(POINTS)}"]
    env = {**driver_env(), PAUSE_ENV: f"{pauses};" + ",".join(point for point, _, _ in POINTS)}
    proc = start_train(rl_overrides(tiny_model_dir, arithmetic_data, run, *job), tmp_path, env)
    killed: list[int] = []
    deadline = time.monotonic() + 900
    try:
        while proc.poll() is None:
            assert time.monotonic() < deadline, "the restarted run did not finish"
            index = len(killed)
            if index < len(POINTS) and marker(pauses, index).exists():
                pid = int(marker(pauses, index).read_text())
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.05)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert len(killed) == len(POINTS), f"only {len(killed)} of the points were reached: {err[-3000:]}"
    failures = [line for line in err.splitlines() if line.startswith("worker failure:")]
    assert len(failures) == len(POINTS), failures
    for n, (line, (_, verb, rank), pid) in enumerate(zip(failures, POINTS, killed, strict=True), start=1):
        assert f"{ROLE} rank {rank} died during {verb}: process {pid}" in line, line
        assert f"restart {n} of {len(POINTS)}" in line, line
    assert "no room" not in err
    assert (run / "latest").read_text() == "step_8"
    assert metrics_by_step(run)[8]["fault/restarts"] == len(POINTS)
    without_restart_count(run)
    without_restart_count(straight_run)
    assert_same_metrics(straight_run, run, range(0, 9))


@pytest.mark.slow
def test_a_worker_killed_from_the_shell_restarts_on_a_full_machine(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path, straight_run: Path, own_ray: list[str]
) -> None:
    run = tmp_path / "run"
    job = [reward_file(tmp_path), *JOB, *own_ray, "trainer.max_restarts=1"]
    proc = start_train(rl_overrides(tiny_model_dir, arithmetic_data, run, *job), tmp_path, driver_env())
    try:
        deadline = time.monotonic() + 300
        while not (run / "metrics.jsonl").exists() or max(metrics_by_step(run), default=0) < 3:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "step 3 was never logged"
            time.sleep(0.1)
        hosts = worker_hosts(proc.pid)
        assert len(hosts) == 2, f"expected the 2 workers of the run, found {hosts}"
        subprocess.run(["kill", "-9", str(hosts[0])], check=True)
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    failures = [line for line in err.splitlines() if line.startswith("worker failure:")]
    assert len(failures) == 1 and f"process {hosts[0]}" in failures[0], err[-3000:]
    assert "restart 1 of 1" in failures[0]
    assert (run / "latest").read_text() == "step_8"
    without_restart_count(run)
    without_restart_count(straight_run)
    assert_same_metrics(straight_run, run, range(0, 9))
