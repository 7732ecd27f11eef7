"""Placing the RL roles on resource pools: colocated (one worker per rank holds actor, sampler, reference and
critic, taking turns) or split (the sampler, or the critic, on a pool of its own).

Pool `trainer` is `trainer.nnodes x trainer.n_workers_per_node` and always holds the actor; `resources.pools`
adds named pools, and `resources.rollout` / `resources.critic` say where those roles run.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from posttrain.config.schema import RLConfig
from posttrain.controller.resource_pool import PoolSpec, ResourcePool, make_pools
from posttrain.controller.worker_group import LocalWorkerGroup, RayWorkerGroup
from posttrain.errors import ConfigError
from posttrain.workers.actor_rollout_ref import ActorRolloutRefSpec, ActorRolloutRefWorker
from posttrain.workers.critic import CriticWorker
from posttrain.workers.rollout_worker import RolloutSpec, RolloutWorker

TRAINER_POOL = "trainer"


def split_rollout(cfg: RLConfig) -> bool:
    return cfg.resources.rollout != TRAINER_POOL


def pool_sizes(cfg: RLConfig) -> dict[str, int]:
    """World size of every pool, by name."""
    sizes = {TRAINER_POOL: cfg.trainer.world_size}
    sizes.update({name: p.nnodes * p.n_workers_per_node for name, p in cfg.resources.pools.items()})
    return sizes


def check_placement(cfg: RLConfig) -> None:
    """Pools that exist and are used, sizes that divide the batches, and no split placement without Ray."""
    r, t = cfg.resources, cfg.trainer
    if TRAINER_POOL in r.pools:
        raise ConfigError(
            f"resources.pools.{TRAINER_POOL} is reserved: size the trainer's pool with trainer.nnodes and "
            "trainer.n_workers_per_node"
        )
    for name, pool in [(TRAINER_POOL, None), *r.pools.items()]:
        nnodes, per_node = (
            (t.nnodes, t.n_workers_per_node) if pool is None else (pool.nnodes, pool.n_workers_per_node)
        )
        prefix = "trainer" if pool is None else f"resources.pools.{name}"
        if nnodes < 1 or per_node < 1:
            raise ConfigError(
                f"{prefix}: nnodes and n_workers_per_node must be >= 1, got {nnodes} and {per_node}"
            )
    if t.cpus_per_worker <= 0 or t.gpus_per_worker < 0:
        raise ConfigError(
            f"trainer.cpus_per_worker must be > 0 and trainer.gpus_per_worker >= 0, got "
            f"{t.cpus_per_worker} and {t.gpus_per_worker}"
        )
    roles = {"resources.rollout": r.rollout}
    if cfg.critic.enable:
        roles["resources.critic"] = r.critic
    elif r.critic != TRAINER_POOL:
        raise ConfigError(f"resources.critic={r.critic} but critic.enable=false")
    sizes = pool_sizes(cfg)
    for key, name in roles.items():
        if name not in sizes:
            raise ConfigError(f"{key}={name}: no such pool; pools: {', '.join(sizes)}")
    unused = set(r.pools) - set(roles.values())
    if unused:
        raise ConfigError(
            f"resources.pools {sorted(unused)} are not used by any role (resources.rollout/critic)"
        )
    if t.backend == "local" and (split_rollout(cfg) or r.critic != TRAINER_POOL):
        raise ConfigError(
            "split placement (resources.rollout/critic on their own pool) needs trainer.backend=ray"
        )
    samples = cfg.data.train_batch_prompts * cfg.rollout.n
    if samples % sizes[r.rollout]:
        raise ConfigError(
            f"the {samples} samples per step (data.train_batch_prompts * rollout.n) do not split evenly over "
            f"the {sizes[r.rollout]} workers of pool '{r.rollout}' (resources.rollout)"
        )
    if cfg.critic.enable:
        mini = cfg.actor.mini_batch_size or samples
        if mini % sizes[r.critic]:
            raise ConfigError(
                f"actor.mini_batch_size={mini} does not split evenly over the {sizes[r.critic]} workers of "
                f"pool '{r.critic}' (resources.critic)"
            )


@dataclass
class RLGroups:
    """The worker groups of a run, and the pools they were placed on (freed by `shutdown`)."""

    actor: Any
    sampler: Any  # the group that generates: the actor's own (colocated) or the rollout pool's
    critic: Any = None
    pools: dict[str, ResourcePool] = field(default_factory=dict)

    @property
    def split(self) -> bool:
        return self.sampler is not self.actor

    def placement(self) -> dict[str, list[dict[str, Any]]]:
        """Which node each rank of each role runs on."""
        roles = {"actor_rollout_ref": self.actor, "rollout": self.sampler if self.split else None}
        roles["critic"] = self.critic
        return {role: group.placement() for role, group in roles.items() if group is not None}

    def shutdown(self) -> None:
        for group in {id(g): g for g in (self.actor, self.sampler, self.critic) if g is not None}.values():
            group.shutdown()
        for pool in self.pools.values():
            pool.remove()
        self.pools = {}


def rollout_spec(cfg: RLConfig, threads: int) -> RolloutSpec:
    return RolloutSpec(
        model_path=cfg.model.path,
        name=cfg.rollout.name,
        dtype=cfg.model.dtype,
        attn_implementation=cfg.model.attn_implementation,
        max_batch_size=cfg.rollout.max_batch_size,
        seed=cfg.trainer.seed,
        threads=threads,
    )


def start_groups(
    cfg: RLConfig,
    actor_spec: ActorRolloutRefSpec,
    critic_spec: Any,
    use_gpu: bool,
    env_vars: dict[str, str],
    wait_s: float = 0.0,
) -> RLGroups:
    """Reserve the pools, then start every role's group on its pool (Ray backend).

    `wait_s`: how long to wait for the cluster to have room (a restart waits for the failed groups'
    resources to come back); 0 fails at once when it has none.
    """
    t, r = cfg.trainer, cfg.resources
    gpus = t.gpus_per_worker if use_gpu else 0.0
    specs = {TRAINER_POOL: PoolSpec(TRAINER_POOL, t.nnodes, t.n_workers_per_node, t.cpus_per_worker, gpus)}
    for name, pool in r.pools.items():
        specs[name] = PoolSpec(name, pool.nnodes, pool.n_workers_per_node, t.cpus_per_worker, gpus)
    # roles sharing a pool split each bundle; the colocated sampler lives inside the actor's worker
    tenants = Counter([TRAINER_POOL] + ([r.critic] if critic_spec is not None else []))
    if split_rollout(cfg):
        tenants[r.rollout] += 1
    pools = make_pools([specs[name] for name in specs if name in tenants], wait_s=wait_s)
    device = "cuda" if use_gpu else "cpu"
    groups = RLGroups(actor=None, sampler=None, pools=pools)
    try:

        def group(worker_cls: type, spec: Any, role: str, pool: str) -> RayWorkerGroup:
            return RayWorkerGroup(
                worker_cls,
                spec,
                role=role,
                device=device,
                env_vars=env_vars,
                timeout_s=t.collective_timeout_s,
                pool=pools[pool],
                share=1.0 / tenants[pool],
            )

        groups.actor = group(ActorRolloutRefWorker, actor_spec, "actor_rollout_ref", TRAINER_POOL)
        groups.sampler = (
            group(RolloutWorker, rollout_spec(cfg, actor_spec.threads), "rollout", r.rollout)
            if split_rollout(cfg)
            else groups.actor
        )
        if critic_spec is not None:
            groups.critic = group(CriticWorker, critic_spec, "critic", r.critic)
    except Exception:
        groups.shutdown()
        raise
    return groups


def start_local_groups(actor_spec: ActorRolloutRefSpec, critic_spec: Any, device: str) -> RLGroups:
    """World size 1 in this process: every role colocated, no Ray."""
    actor = LocalWorkerGroup(ActorRolloutRefWorker, actor_spec, role="actor_rollout_ref", device=device)
    critic = (
        LocalWorkerGroup(CriticWorker, critic_spec, role="critic", device=device)
        if critic_spec is not None
        else None
    )
    return RLGroups(actor=actor, sampler=actor, critic=critic)
