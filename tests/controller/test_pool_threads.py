"""Each resource pool's workers run with their own torch thread budget (`resources.pools.<name>.threads_per_worker`),
so a machine's cores can be split unevenly between the trainer and a rollout pool; by default a node's cores are
shared among the workers of every pool placed on it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from posttrain.config.schema import PoolConfig
from posttrain.controller.placement import (
    check_placement,
    pool_threads,
    start_rl_groups,
    threads_per_worker,
)
from posttrain.errors import ConfigError
from posttrain.trainers.setup import actor_spec
from tests.trainers.test_rl_e2e import rl_config

GEN_POOL = ["trainer.backend=ray", "resources.rollout=gen", "+resources.pools.gen.n_workers_per_node=1"]


@pytest.mark.slow  # the default suite's time on 2 cores (CI runs it with -m slow)
def test_a_pool_runs_with_its_own_threads_and_the_others_with_the_trainers(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path, ray_cluster: None
) -> None:
    cfg = rl_config(
        tiny_model_dir, arithmetic_data, tmp_path, *GEN_POOL, "trainer.threads_per_worker=2",
        "+resources.pools.gen.threads_per_worker=1",
    )  # fmt: skip
    check_placement(cfg)
    groups = start_rl_groups(cfg, actor_spec(cfg, threads_per_worker(cfg.trainer)), None)
    try:
        placement = groups.placement()
    finally:
        groups.shutdown()
    assert [rank["threads"] for rank in placement["actor_rollout_ref"]] == [2]
    assert [rank["threads"] for rank in placement["rollout"]] == [1]


def test_a_negative_thread_budget_is_refused(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    cfg = rl_config(
        tiny_model_dir, arithmetic_data, tmp_path, *GEN_POOL, "+resources.pools.gen.threads_per_worker=-1"
    )
    with pytest.raises(ConfigError, match=r"resources.pools.gen.threads_per_worker must be >= 0"):
        check_placement(cfg)


@pytest.mark.slow  # the default suite's time on 2 cores (CI runs it with -m slow)
def test_by_default_a_node_s_cores_are_shared_by_the_workers_of_every_pool_on_it(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path, ray_cluster: None
) -> None:
    cfg = rl_config(tiny_model_dir, arithmetic_data, tmp_path, *GEN_POOL)  # one trainer + one rollout worker
    groups = start_rl_groups(cfg, actor_spec(cfg, threads_per_worker(cfg.trainer)), None)
    try:
        placement = groups.placement()
    finally:
        groups.shutdown()
    shared = max(1, (os.cpu_count() or 1) // 2)
    assert [rank["threads"] for rank in placement["actor_rollout_ref"]] == [shared]
    assert [rank["threads"] for rank in placement["rollout"]] == [shared]


def test_a_set_budget_wins_over_the_shared_cores(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    trainer = rl_config(tiny_model_dir, arithmetic_data, tmp_path).trainer
    cores = os.cpu_count() or 1
    assert pool_threads(trainer, None, sharing=3) == max(1, cores // 3)
    # no placement known: the trainer's rule
    assert pool_threads(trainer, None) == threads_per_worker(trainer)
    assert pool_threads(trainer, PoolConfig(threads_per_worker=5), sharing=3) == 5
    two = rl_config(tiny_model_dir, arithmetic_data, tmp_path, "trainer.threads_per_worker=2").trainer
    assert pool_threads(two, None, sharing=8) == 2
