"""Where workers run: resource pools, each role's share of a pool's slots, thread budgets, worker environment.

Every trainer starts its workers through `start_role_groups` (SFT with one role, RL with up to three), so
both honour the same settings (`trainer.cpus_per_worker`, `gpus_per_worker`, `collective_timeout_s`,
`threads_per_worker`, `device`). With `backend=local` a role runs in this process (world size 1); with
`backend=ray` on the pool it names: pool `trainer` is `trainer.nnodes x trainer.n_workers_per_node`; more
pools are named in `resources.pools`. Roles on one pool share its slots (each asks for a fraction).

RL's layout (colocated: one worker per rank holds actor, rollout and reference, the critic and the reward model
sharing the slot; split: the rollout, the reference, the critic or the reward model on a pool of its own) is
`start_rl_groups`, checked by `check_placement`.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from posttrain.config.schema import PoolConfig, RayConfig, RLConfig
from posttrain.controller.pause_points import PAUSE_ENV
from posttrain.controller.ray_env import cluster_has_gpus, start_ray
from posttrain.controller.resource_pool import PoolSpec, ResourcePool, make_pools
from posttrain.controller.roles import (
    ActorGroup,
    CriticGroup,
    Dispatcher,
    ReferenceGroup,
    RewardModelGroup,
    Rollout,
    RolloutGroup,
)
from posttrain.controller.worker_group import LocalWorkerGroup, RayWorkerGroup
from posttrain.errors import ConfigError
from posttrain.workers.actor_rollout_ref import ActorRolloutRefSpec, ActorRolloutRefWorker
from posttrain.workers.critic import CriticSpec, CriticWorker
from posttrain.workers.reference import ReferenceSpec, ReferenceWorker
from posttrain.workers.reward_model import RewardModelSpec, RewardModelWorker
from posttrain.workers.rollout_worker import RolloutSpec, RolloutWorker

TRAINER_POOL = "trainer"


class WorkerSettings(Protocol):
    """The `trainer` section's placement settings (RL's and SFT's have them all)."""

    @property
    def backend(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def nnodes(self) -> int: ...
    @property
    def n_workers_per_node(self) -> int: ...
    @property
    def cpus_per_worker(self) -> float: ...
    @property
    def gpus_per_worker(self) -> float: ...
    @property
    def collective_timeout_s(self) -> float: ...
    @property
    def threads_per_worker(self) -> int: ...


@dataclass(frozen=True)
class RoleRequest:
    """One role to start: its worker class and spec, on the pool named `pool`; `sequence_parallel_size` is
    its engines' sp (its training verbs then split batches over world / sp data-parallel groups)."""

    role: str
    worker_cls: type
    spec: Any
    pool: str = TRAINER_POOL
    sequence_parallel_size: int = 1


def threads_per_worker(settings: WorkerSettings) -> int:
    """Torch intra-op threads per worker: as set, or the node's cores shared by its workers."""
    return settings.threads_per_worker or max(1, (os.cpu_count() or 1) // settings.n_workers_per_node)


def pool_threads(settings: WorkerSettings, pool: PoolConfig | None, sharing: int = 0) -> int:
    """The threads of a pool's workers: the pool's own `threads_per_worker`, else `trainer.threads_per_worker`,
    else the node's cores shared by `sharing` workers (every worker of every pool this run placed on the
    node; 0 = the trainer pool's workers per node, as `threads_per_worker`)."""
    if pool is not None and pool.threads_per_worker:
        return pool.threads_per_worker
    if settings.threads_per_worker or not sharing:
        return threads_per_worker(settings)
    return max(1, (os.cpu_count() or 1) // sharing)


def workers_by_node(pools: Iterable[ResourcePool]) -> Counter[str]:
    """How many workers (bundles) the given pools placed on each node."""
    placed: Counter[str] = Counter()
    for pool in pools:
        for node in pool.nodes:
            placed[node] += pool.spec.workers_per_node
    return placed


def with_threads(spec: Any, threads: int) -> Any:
    """`spec` with its worker's thread budget set to `threads` (specs without one are returned as they are)."""
    if dataclasses.is_dataclass(spec) and any(f.name == "threads" for f in dataclasses.fields(spec)):
        return dataclasses.replace(spec, threads=threads)  # type: ignore[type-var]
    return spec


def worker_env(threads: int) -> dict[str, str]:
    """Environment of every worker process: its thread budget, no tokenizer thread pools (and the test-only
    pause points of controller/pause_points.py when the driver has them)."""
    env = {"OMP_NUM_THREADS": str(threads or 1), "TOKENIZERS_PARALLELISM": "false"}
    if PAUSE_ENV in os.environ:
        env[PAUSE_ENV] = os.environ[PAUSE_ENV]
    return env


def uses_gpu(device: str) -> bool:
    """Whether Ray workers get GPUs: `cuda`, or `auto` on a cluster that has some (Ray must be running)."""
    return device == "cuda" or (device == "auto" and cluster_has_gpus())


def start_role_groups(
    settings: WorkerSettings,
    ray: RayConfig,
    requests: list[RoleRequest],
    pools: Mapping[str, PoolConfig] | None = None,
    wait_s: float = 0.0,
) -> tuple[dict[str, Dispatcher], dict[str, ResourcePool]]:
    """Start each requested role and return its dispatcher by role name, with the pools reserved for them.

    `pools`: the named pools besides `trainer`. `wait_s`: how long to wait for room on the cluster (a
    restart waits for the failed groups' resources to come back); 0 fails at once when there is none.
    """
    if settings.backend == "local":
        if any(r.sequence_parallel_size > 1 for r in requests):
            raise ConfigError(
                "model.sequence_parallel_size > 1 splits rows across workers: it needs trainer.backend=ray "
                "(trainer.backend=local runs one in-process worker)"
            )
        return {
            r.role: LocalWorkerGroup(r.worker_cls, r.spec, role=r.role, device=settings.device)
            for r in requests
        }, {}
    start_ray(ray.address, ray.num_cpus, ray.tmpdir)
    gpus = settings.gpus_per_worker if uses_gpu(settings.device) else 0.0
    specs = {
        TRAINER_POOL: PoolSpec(
            TRAINER_POOL, settings.nnodes, settings.n_workers_per_node, settings.cpus_per_worker, gpus
        )
    }
    for name, extra in (pools or {}).items():
        specs[name] = PoolSpec(name, extra.nnodes, extra.n_workers_per_node, settings.cpus_per_worker, gpus)
    tenants = Counter(r.pool for r in requests)  # roles sharing a pool split each of its slots
    reserved = make_pools([specs[name] for name in specs if name in tenants], wait_s=wait_s)
    device = "cuda" if gpus else "cpu"
    # the default thread budget shares a node's cores among every worker placed there, from all pools: a
    # rollout pool beside the trainer on one machine must not give each side all the cores
    placed = workers_by_node(reserved.values())
    started: dict[str, Dispatcher] = {}
    try:
        for r in requests:
            sharing = max(placed[node] for node in reserved[r.pool].nodes)
            threads = pool_threads(settings, (pools or {}).get(r.pool), sharing)
            started[r.role] = RayWorkerGroup(
                r.worker_cls,
                with_threads(r.spec, threads),
                role=r.role,
                device=device,
                env_vars=worker_env(threads),
                timeout_s=settings.collective_timeout_s,
                pool=reserved[r.pool],
                share=1.0 / tenants[r.pool],
                sequence_parallel_size=r.sequence_parallel_size,
            )
    except Exception:
        for group in started.values():
            group.shutdown()
        for pool in reserved.values():
            pool.remove()
        raise
    return started, reserved


# ---- RL ------------------------------------------------------------------------------------------
@dataclass
class RLGroups:
    """The worker groups of an RL run, and the pools they were placed on (freed by `shutdown`)."""

    actor: ActorGroup
    rollout: Rollout  # the group that generates: the actor's own (colocated) or the rollout pool
    rollout_pool: RolloutGroup | None = None  # the rollout role on a pool of its own (split placement)
    critic: CriticGroup | None = None
    reward_model: RewardModelGroup | None = None  # reward.model.path: scores responses
    ref: ReferenceGroup | None = None  # the reference on a pool of its own (resources.ref); else the actor's
    pools: dict[str, ResourcePool] = field(default_factory=dict)

    @property
    def split(self) -> bool:
        return self.rollout_pool is not None

    def placement(self) -> dict[str, list[dict[str, Any]]]:
        """Which node each rank of each role runs on."""
        groups = {
            "actor_rollout_ref": self.actor,
            "rollout": self.rollout_pool,
            "critic": self.critic,
            "ref": self.ref,
            "reward_model": self.reward_model,
        }
        return {role: group.placement() for role, group in groups.items() if group is not None}

    def shutdown(self) -> None:
        for group in (self.actor, self.rollout_pool, self.critic, self.ref, self.reward_model):
            if group is not None:
                group.shutdown()
        for pool in self.pools.values():
            pool.remove()
        self.pools = {}


def split_rollout(cfg: RLConfig) -> bool:
    return cfg.resources.rollout != TRAINER_POOL


def uses_reference(cfg: RLConfig) -> bool:
    """Whether the run needs the reference policy's log-probs (KL in the loss or in the reward)."""
    return cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward


def split_reference(cfg: RLConfig) -> bool:
    """The reference on workers of its own (`resources.ref` names a pool other than the trainer's)."""
    return uses_reference(cfg) and cfg.resources.ref != TRAINER_POOL


def rollout_spec(cfg: RLConfig, threads: int) -> RolloutSpec:
    return RolloutSpec(
        model_path=cfg.model.path,
        name=cfg.rollout.name,
        vllm=cfg.rollout.vllm,
        dtype=cfg.model.dtype,
        attn_implementation=cfg.model.attn_implementation,
        max_batch_size=cfg.rollout.max_batch_size,
        seed=cfg.trainer.seed,
        threads=threads,
        record_routing=cfg.actor.router_replay.mode == "R3",
        adapted_head=cfg.model.lora.adapts_output_head,
    )


def start_rl_groups(
    cfg: RLConfig,
    actor_spec: ActorRolloutRefSpec,
    critic_spec: CriticSpec | None,
    wait_s: float = 0.0,
    reward_model_spec: RewardModelSpec | None = None,
    reference_spec: ReferenceSpec | None = None,
) -> RLGroups:
    """Every role of an RL run, placed as `resources` (and `reward.model.pool`) says (see `start_role_groups`
    for `wait_s`). `reference_spec`: the reference's own workers on pool `resources.ref`."""
    sp = actor_spec.engine.sequence_parallel_size
    requests = [
        RoleRequest("actor_rollout_ref", ActorRolloutRefWorker, actor_spec, sequence_parallel_size=sp)
    ]
    if split_rollout(cfg):
        spec = rollout_spec(cfg, actor_spec.threads)
        requests.append(RoleRequest("rollout", RolloutWorker, spec, cfg.resources.rollout))
    if critic_spec is not None:
        critic_sp = critic_spec.engine.sequence_parallel_size
        requests.append(RoleRequest("critic", CriticWorker, critic_spec, cfg.resources.critic, critic_sp))
    if reward_model_spec is not None:
        requests.append(
            RoleRequest("reward_model", RewardModelWorker, reward_model_spec, cfg.reward.model.pool)
        )
    if reference_spec is not None:
        ref_sp = reference_spec.engine.sequence_parallel_size
        requests.append(RoleRequest("ref", ReferenceWorker, reference_spec, cfg.resources.ref, ref_sp))
    started, pools = start_role_groups(cfg.trainer, cfg.ray, requests, cfg.resources.pools, wait_s)
    actor = ActorGroup(started["actor_rollout_ref"])
    pool = RolloutGroup(started["rollout"]) if "rollout" in started else None
    if pool is not None and cfg.async_rl.staleness:  # a dead rollout worker is restarted in place
        pool.enable_restarts(cfg.trainer.max_restarts)
    critic = CriticGroup(started["critic"]) if "critic" in started else None
    reward_model = RewardModelGroup(started["reward_model"]) if "reward_model" in started else None
    ref = ReferenceGroup(started["ref"]) if "ref" in started else None
    return RLGroups(
        actor=actor,
        rollout=pool or actor,
        rollout_pool=pool,
        critic=critic,
        reward_model=reward_model,
        ref=ref,
        pools=pools,
    )


def pool_sizes(cfg: RLConfig) -> dict[str, int]:
    """World size of every pool, by name."""
    sizes = {TRAINER_POOL: cfg.trainer.world_size}
    sizes.update({name: p.nnodes * p.n_workers_per_node for name, p in cfg.resources.pools.items()})
    return sizes


def check_worker_settings(settings: WorkerSettings, prefix: str = "trainer") -> None:
    """Sizes, resources and timeouts every trainer's workers need."""
    if settings.nnodes < 1 or settings.n_workers_per_node < 1:
        raise ConfigError(
            f"{prefix}: nnodes and n_workers_per_node must be >= 1, got {settings.nnodes} and "
            f"{settings.n_workers_per_node}"
        )
    if settings.cpus_per_worker <= 0 or settings.gpus_per_worker < 0:
        raise ConfigError(
            f"{prefix}.cpus_per_worker must be > 0 and {prefix}.gpus_per_worker >= 0, got "
            f"{settings.cpus_per_worker} and {settings.gpus_per_worker}"
        )
    if settings.collective_timeout_s <= 0:
        raise ConfigError(f"{prefix}.collective_timeout_s must be > 0, got {settings.collective_timeout_s}")
    if settings.backend == "local" and settings.nnodes * settings.n_workers_per_node != 1:
        raise ConfigError(
            f"{prefix}.backend=local runs one in-process worker; set {prefix}.n_workers_per_node=1 and "
            f"{prefix}.nnodes=1, or backend=ray"
        )


def check_placement(cfg: RLConfig) -> None:
    """Pools that exist and are used, sizes that divide the batches, and no split placement without Ray."""
    r, t = cfg.resources, cfg.trainer
    if TRAINER_POOL in r.pools:
        raise ConfigError(
            f"resources.pools.{TRAINER_POOL} is reserved: size the trainer's pool with trainer.nnodes and "
            "trainer.n_workers_per_node"
        )
    for name, pool in r.pools.items():
        if pool.nnodes < 1 or pool.n_workers_per_node < 1:
            raise ConfigError(
                f"resources.pools.{name}: nnodes and n_workers_per_node must be >= 1, got {pool.nnodes} and "
                f"{pool.n_workers_per_node}"
            )
        if pool.threads_per_worker < 0:
            raise ConfigError(
                f"resources.pools.{name}.threads_per_worker must be >= 0 (0: trainer.threads_per_worker), got "
                f"{pool.threads_per_worker}"
            )
    rm_pool = cfg.reward.model.pool
    split = split_rollout(cfg) or r.critic != TRAINER_POOL or r.ref != TRAINER_POOL or rm_pool != TRAINER_POOL
    if t.backend == "local" and split:
        raise ConfigError(
            "split placement (resources.rollout/critic/ref or reward.model.pool on their own pool) needs "
            "trainer.backend=ray"
        )
    check_worker_settings(t)
    roles = {"resources.rollout": r.rollout}
    if cfg.critic.enable:
        roles["resources.critic"] = r.critic
    elif r.critic != TRAINER_POOL:
        raise ConfigError(f"resources.critic={r.critic} but critic.enable=false")
    if uses_reference(cfg):
        roles["resources.ref"] = r.ref
    elif r.ref != TRAINER_POOL:
        raise ConfigError(
            f"resources.ref={r.ref} but nothing uses the reference (actor.use_kl_loss and "
            "algorithm.use_kl_in_reward are both false)"
        )
    if cfg.reward.model.path:
        roles["reward.model.pool"] = rm_pool
    elif rm_pool != TRAINER_POOL:
        raise ConfigError(f"reward.model.pool={rm_pool} but reward.model.path is empty (no reward model)")
    sizes = pool_sizes(cfg)
    for key, name in roles.items():
        if name not in sizes:
            raise ConfigError(f"{key}={name}: no such pool; pools: {', '.join(sizes)}")
    unused = set(r.pools) - set(roles.values())
    if unused:
        raise ConfigError(
            f"resources.pools {sorted(unused)} are not used by any role (resources.rollout/critic/ref, "
            "reward.model.pool)"
        )
    samples = cfg.data.train_batch_prompts * cfg.rollout.n
    if samples % sizes[r.rollout]:
        raise ConfigError(
            f"the {samples} samples per step (data.train_batch_prompts * rollout.n) do not split evenly over "
            f"the {sizes[r.rollout]} workers of pool '{r.rollout}' (resources.rollout)"
        )
    sp = cfg.model.sequence_parallel_size
    trained = {"the actor": TRAINER_POOL, **({"resources.critic": r.critic} if cfg.critic.enable else {})}
    if split_reference(cfg):  # its forward splits rows as the actor's does
        trained["resources.ref"] = r.ref
    for key, name in trained.items():  # generation and the reward model do not use sequence parallelism
        if sizes[name] % sp:
            raise ConfigError(
                f"model.sequence_parallel_size={sp} must divide the {sizes[name]} workers of pool '{name}' "
                f"({key}): world = dp x sp"
            )
    if cfg.critic.enable:
        mini = cfg.critic.mini_batch_size or samples
        critic_dp = sizes[r.critic] // sp
        if mini % critic_dp:
            groups = f"{critic_dp} data-parallel groups (workers / model.sequence_parallel_size)"
            raise ConfigError(
                f"critic.mini_batch_size={mini} does not split evenly over the "
                f"{groups if sp > 1 else f'{critic_dp} workers'} of pool '{r.critic}' (resources.critic)"
            )
