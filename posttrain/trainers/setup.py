"""Start-up for the driver loops: checks that fail fast (before any model loads) and worker-group creation."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from posttrain.algorithms.registry import get_advantage_estimator, get_kl_estimator, get_policy_loss
from posttrain.config.schema import RayConfig, RLConfig
from posttrain.controller.ray_env import cluster_has_gpus, start_ray
from posttrain.controller.worker_group import LocalWorkerGroup, RayWorkerGroup
from posttrain.errors import ConfigError, DataError
from posttrain.models import check_model_dir
from posttrain.rewards.user import load_reward_function
from posttrain.workers.actor_rollout_ref import ActorRolloutRefSpec, ActorRolloutRefWorker

LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def check_files(files: Sequence[str], key: str) -> None:
    if not files:
        raise ConfigError(f"{key} is empty: give at least one parquet or jsonl file")
    for f in files:
        if not Path(f).is_file():
            raise DataError(f"{key}: file not found: {f}")


def check_rl_config(cfg: RLConfig) -> None:
    """Every check that needs no model: names in registries, sizes that divide, files that exist."""
    check_model_dir(cfg.model.path)
    check_files(cfg.data.train_files, "data.train_files")
    if cfg.trainer.val_every or cfg.trainer.val_before_train:
        check_files(cfg.data.val_files, "data.val_files")
    get_advantage_estimator(cfg.algorithm.adv_estimator)
    get_policy_loss(cfg.actor.policy_loss)
    if cfg.actor.use_kl_loss:
        get_kl_estimator(cfg.actor.kl_loss_type)
    if cfg.actor.loss_agg_mode not in LOSS_AGG_MODES:
        raise ConfigError(
            f"unknown actor.loss_agg_mode '{cfg.actor.loss_agg_mode}'; valid: {', '.join(LOSS_AGG_MODES)}"
        )
    if cfg.rollout.name != "native":
        raise ConfigError(f"unknown rollout.name '{cfg.rollout.name}'; valid: native")
    if cfg.algorithm.adv_estimator == "grpo" and cfg.rollout.n < 2:
        raise ConfigError(
            "algorithm.adv_estimator=grpo needs rollout.n >= 2 (advantages are relative to a group)"
        )
    if cfg.trainer.backend not in ("ray", "local"):
        raise ConfigError(f"unknown trainer.backend '{cfg.trainer.backend}'; valid: ray, local")
    if cfg.trainer.backend == "local" and cfg.trainer.n_workers != 1:
        raise ConfigError(
            "trainer.backend=local runs one in-process worker; set trainer.n_workers=1 or backend=ray"
        )
    samples = cfg.data.train_batch_prompts * cfg.rollout.n
    mini = cfg.actor.mini_batch_size or samples
    workers = cfg.trainer.n_workers
    if samples % mini:
        raise ConfigError(
            f"actor.mini_batch_size={mini} must divide the samples per step "
            f"(data.train_batch_prompts * rollout.n = {samples})"
        )
    if mini % workers:
        raise ConfigError(f"actor.mini_batch_size={mini} must be divisible by trainer.n_workers={workers}")
    if cfg.actor.micro_batch_size <= 0:
        raise ConfigError(f"actor.micro_batch_size must be > 0, got {cfg.actor.micro_batch_size}")
    if cfg.data.overlong_prompts not in ("filter", "error"):
        raise ConfigError(f"data.overlong_prompts must be filter or error, got '{cfg.data.overlong_prompts}'")
    if cfg.reward.gsm8k_method not in ("strict", "flexible"):
        raise ConfigError(f"reward.gsm8k_method must be strict or flexible, got '{cfg.reward.gsm8k_method}'")
    if cfg.reward.custom_function_path:
        load_reward_function(cfg.reward.custom_function_path, cfg.reward.custom_function_name)
    for backend in cfg.trainer.loggers:
        if backend not in ("console", "jsonl", "tensorboard"):
            raise ConfigError(
                f"unknown trainer.loggers entry '{backend}'; valid: console, jsonl, tensorboard"
            )


def threads_per_worker(requested: int, n_workers: int) -> int:
    return requested or max(1, (os.cpu_count() or 1) // n_workers)


def make_actor_group(
    spec: ActorRolloutRefSpec,
    n_workers: int,
    backend: str,
    ray_cfg: RayConfig,
    run_dir: str | Path,
    device: str = "auto",
) -> LocalWorkerGroup | RayWorkerGroup:
    """The actor's worker group on Ray (one actor per rank) or in-process (world size 1)."""
    if backend == "local":
        return LocalWorkerGroup(ActorRolloutRefWorker, spec, role="actor_rollout_ref", device=device)
    start_ray(ray_cfg.address, ray_cfg.num_cpus, ray_cfg.tmpdir)
    use_gpu = device == "cuda" or (device == "auto" and cluster_has_gpus())
    return RayWorkerGroup(
        ActorRolloutRefWorker,
        spec,
        world_size=n_workers,
        role="actor_rollout_ref",
        num_cpus_per_worker=1.0,
        num_gpus_per_worker=1.0 if use_gpu else 0.0,
        device="cuda" if use_gpu else "cpu",
        env_vars={"OMP_NUM_THREADS": str(spec.threads or 1), "TOKENIZERS_PARALLELISM": "false"},
    )
