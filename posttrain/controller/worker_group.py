"""WorkerGroups: N SPMD workers behind one object; a Batch argument is split across ranks, results gathered.

With sequence parallelism (sp > 1) the training verbs split a Batch over the dp = N / sp data-parallel groups
instead (`call_data_parallel`): the sp consecutive ranks of a group (the engine's (dp, sp) mesh) get the same
rows, each works on a slice of every row's columns and returns the group's whole result, which is taken once.

`RayWorkerGroup` runs each rank as a Ray actor; `LocalWorkerGroup` runs one rank in this process with the
same interface, for tests and the degenerate single-process case. A worker error reaches the driver as a
`WorkerError` naming the role and rank.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from posttrain.controller.failures import raised_in, rank_failure
from posttrain.controller.pause_points import pause_if_asked
from posttrain.controller.resource_pool import PoolSpec, ResourcePool
from posttrain.data.batch import Batch
from posttrain.engine.distributed import DistInfo, free_port
from posttrain.errors import ConfigError, WorkerError

# Worker processes get at least this long to start (spawn, imports, model loading) whatever the
# collective timeout: a short collective timeout must not fail a start on a loaded machine.
START_TIMEOUT_S = 300.0


def _split_args(
    args: Sequence[Any], kwargs: dict[str, Any], world_size: int, replicas: int = 1, role: str = "worker"
) -> list[tuple[list[Any], dict[str, Any]]]:
    """Per-rank (args, kwargs): each Batch is chunked into `world_size / replicas` equal parts, part i going
    to the `replicas` consecutive ranks from i * replicas (a sequence-parallel group); everything else copied.
    A Batch that does not split evenly is the caller's error, the same after any restart (deterministic)."""
    parts_count = world_size // replicas
    for value in [*args, *kwargs.values()]:
        if isinstance(value, Batch) and len(value) % parts_count:
            groups = f"{parts_count} data-parallel groups" if replicas > 1 else f"{parts_count} workers"
            raise WorkerError(
                f"{role}: a batch of {len(value)} rows cannot be split evenly across {groups}; "
                "make batch sizes divisible by the number of workers (by the data-parallel size with "
                "sequence parallelism)",
                role=role,
                deterministic=True,
            )
    per_rank: list[tuple[list[Any], dict[str, Any]]] = [([], {}) for _ in range(world_size)]
    for value in args:
        parts = value.chunk(parts_count) if isinstance(value, Batch) else [value] * parts_count
        for rank in range(world_size):
            per_rank[rank][0].append(parts[rank // replicas])
    for key, value in kwargs.items():
        parts = value.chunk(parts_count) if isinstance(value, Batch) else [value] * parts_count
        for rank in range(world_size):
            per_rank[rank][1][key] = parts[rank // replicas]
    return per_rank


def gather(results: list[Any]) -> Any:
    """Concatenate Batches in rank order; average metric dicts over ranks (`*_max` keys: the maximum);
    otherwise return the list."""
    if results and all(isinstance(r, Batch) for r in results):
        return Batch.concat(results)
    if results and all(isinstance(r, dict) for r in results):
        merged: dict[str, float] = {}
        # every rank's keys (a metric only some ranks report, e.g. from rows only they held, is kept)
        for key in dict.fromkeys(key for r in results for key in r):
            values = [r[key] for r in results if key in r]
            if all(isinstance(v, int | float) for v in values):
                merged[key] = max(values) if key.endswith("_max") else sum(values) / len(values)
            else:
                merged[key] = values[0]
        return merged
    if all(r is None for r in results):
        return None
    return results


class LocalWorkerGroup:
    """One rank, in this process (world size 1): the same verbs as RayWorkerGroup, no Ray."""

    sequence_parallel_size = 1
    data_parallel_size = 1

    def __init__(
        self, worker_cls: Callable[..., Any], spec: Any, role: str = "worker", device: str = "auto"
    ) -> None:
        self.role = role
        self.world_size = 1
        self._start_args = (worker_cls, spec, device)
        self.restart()

    def restart(self) -> None:
        """A new worker from the same spec (the caller restores any state it needs)."""
        worker_cls, spec, device = self._start_args
        try:
            self.worker = worker_cls(spec, DistInfo(rank=0, world_size=1, device=device))
        except Exception as exc:
            raise WorkerError(f"{self.role} rank 0 failed to start: {type(exc).__name__}: {exc}") from exc

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The worker's `method`; an exception becomes a `WorkerError` classified as on Ray (`raised_in`)."""
        try:
            return gather([getattr(self.worker, method)(*args, **kwargs)])
        except Exception as exc:
            raise raised_in(self.role, method, 0, exc) from exc

    def call_data_parallel(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.call(method, *args, **kwargs)  # one rank: one data-parallel group of one

    def placement(self) -> list[dict[str, Any]]:
        return [{"rank": 0, "node_ip": "127.0.0.1", "threads": torch.get_num_threads()}]

    def ping(self) -> list[dict[str, Any]]:
        return [self.worker.ping() if hasattr(self.worker, "ping") else {"pid": os.getpid()}]

    def shutdown(self) -> None:
        self.worker = None


class WorkerHost:
    """The Ray actor behind one rank: tells where it runs, then builds the worker and forwards calls to it.

    Building the worker after placement lets rank 0's node address be the rendezvous of the group.
    """

    def __init__(self, role: str = "worker") -> None:
        self.role = role
        self.rank = 0
        self.worker: Any = None
        self.calls: Counter[str] = Counter()  # calls per verb in this process (for test pause points)

    def rendezvous(self) -> tuple[str, int]:
        import ray

        ip = ray.util.get_node_ip_address()
        return ip, free_port(ip)

    def where(self) -> dict[str, Any]:
        """This rank's node, and its torch thread budget (set by its worker once started)."""
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "threads": torch.get_num_threads(),
        }

    def start(self, worker_cls: Callable[..., Any], spec: Any, info: DistInfo) -> None:
        self.rank = info.rank
        self.worker = worker_cls(spec, info)

    def ping(self) -> dict[str, Any]:
        return self.worker.ping() if hasattr(self.worker, "ping") else {"pid": os.getpid()}

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self.calls[method] += 1
        pause_if_asked(self.role, method, self.rank, self.calls[method])
        return getattr(self.worker, method)(*args, **kwargs)


class RayWorkerGroup:
    """One Ray actor per rank of the same SPMD program, placed on the bundles of a resource pool.

    Without a `pool`, the group reserves its own (one node, `world_size` workers) and frees it on shutdown.
    `share` is this role's fraction of each bundle when several roles are colocated on one pool.
    `sequence_parallel_size`: the sp of the workers' engines (it must divide the world size), for
    `call_data_parallel`.
    """

    def __init__(
        self,
        worker_cls: type,
        spec: Any,
        world_size: int = 1,
        role: str = "worker",
        num_cpus_per_worker: float = 1.0,
        num_gpus_per_worker: float = 0.0,
        device: str = "auto",
        env_vars: dict[str, str] | None = None,
        timeout_s: float = 600.0,
        pool: ResourcePool | None = None,
        share: float = 1.0,
        sequence_parallel_size: int = 1,
    ) -> None:
        self.role = role
        self.timeout_s = timeout_s
        self._own_pool = pool is None
        placed = pool or ResourcePool(
            PoolSpec(role, 1, world_size, num_cpus_per_worker, num_gpus_per_worker), timeout_s=30.0
        )
        self.pool: ResourcePool | None = placed
        self.world_size = placed.spec.world_size
        if sequence_parallel_size < 1 or self.world_size % sequence_parallel_size:
            if self._own_pool:
                placed.remove()
            raise ConfigError(
                f"model.sequence_parallel_size={sequence_parallel_size} must divide the {self.world_size} "
                f"workers of {role}: world = dp x sp"
            )
        self.sequence_parallel_size = sequence_parallel_size
        self.data_parallel_size = self.world_size // sequence_parallel_size
        self._start_args = (worker_cls, spec, device, env_vars, share)
        self._submit_lock = threading.Lock()
        self.workers: list[Any] = []
        self._start_ranks()

    def _start_ranks(self) -> None:
        """One Ray actor per rank on the pool's bundles, each building its worker (a rendezvous on rank 0)."""
        import ray

        worker_cls, spec, device, env_vars, share = self._start_args
        placed, timeout_s = self.pool, self.timeout_s
        assert placed is not None
        bundle = placed.spec.bundle
        try:
            remote_cls = ray.remote(WorkerHost)
            self.workers = [
                remote_cls.options(
                    num_cpus=bundle["CPU"] * share,
                    num_gpus=bundle.get("GPU", 0.0) * share,
                    max_restarts=0,
                    scheduling_strategy=placed.scheduling(rank),
                    runtime_env={"env_vars": env_vars or {}},
                ).remote(self.role)
                for rank in range(self.world_size)
            ]
            master_addr, master_port = self._get(
                [self.workers[0].rendezvous.remote()], "start", max(timeout_s, START_TIMEOUT_S)
            )[0]
            infos = [
                DistInfo(
                    rank=rank,
                    world_size=self.world_size,
                    master_addr=master_addr,
                    master_port=master_port,
                    device=device,
                    timeout_s=timeout_s,
                )
                for rank in range(self.world_size)
            ]
            self._get(
                [w.start.remote(worker_cls, spec, info) for w, info in zip(self.workers, infos, strict=True)],
                "start",
                max(timeout_s, START_TIMEOUT_S),
            )
        except Exception:
            self.shutdown()
            raise

    def restart(self) -> None:
        """Kill every rank (a dead one included) and start the group again on the same bundles: new processes
        building their workers from the same spec (the caller restores any state they need)."""
        import ray

        for worker in self.workers:
            ray.kill(worker, no_restart=True)
        self.workers = []
        self._start_ranks()  # waits for the killed ranks' share of the bundles to come back

    def _get(self, refs: list[Any], method: str, timeout_s: float | None = None) -> list[Any]:
        """Results in rank order; the first failure (whichever rank) is raised at once, naming the rank."""
        import ray
        from ray.exceptions import RayActorError, RayError, RayTaskError

        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        timeout = timeout_s or self.timeout_s
        deadline = time.monotonic() + timeout  # one deadline for the whole call, not one per rank
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                ranks = sorted(rank_of[r] for r in pending)
                raise WorkerError(
                    f"{self.role} ranks {ranks}: {method} timed out after {timeout:g}s",
                    role=self.role,
                    rank=ranks[0],
                )
            rank = rank_of[done[0]]
            try:
                results[rank] = ray.get(done[0])
            except (RayTaskError, RayActorError) as exc:
                raise rank_failure(self.role, method, rank, exc, pending, rank_of) from None
            except RayError as exc:  # the object store, scheduling, a lost object: Ray's own failure
                raise WorkerError(
                    f"{self.role} rank {rank}: Ray failed during {method}: {type(exc).__name__}: "
                    f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
                    role=self.role,
                    rank=rank,
                ) from exc
        return results

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call `method` on every rank (Batch arguments split across ranks) and gather the results.

        Arguments that every rank gets whole (e.g. weights for samplers) go to the object store once.
        """
        return self._call(method, args, kwargs, replicas=1)

    def call_data_parallel(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call `method` on every rank with Batch arguments split over the data-parallel groups (the ranks
        of a sequence-parallel group get the same rows) and gather one result per group: its first rank's.
        Without sequence parallelism, `call`."""
        return self._call(method, args, kwargs, replicas=self.sequence_parallel_size)

    def _call(self, method: str, args: Sequence[Any], kwargs: dict[str, Any], replicas: int) -> Any:
        import ray

        shared: dict[int, Any] = {}

        def once(value: Any) -> Any:
            if isinstance(value, Batch) or value is None or isinstance(value, int | float | str | bool):
                return value
            if id(value) not in shared:
                shared[id(value)] = ray.put(value)
            return shared[id(value)]

        per_rank = _split_args(args, kwargs, self.world_size, replicas, self.role)
        try:
            # submitted to every rank under one lock: Ray runs a caller's calls to an actor in submission
            # order, so calls from two driver threads (e.g. the async producer's and the trainer's) reach
            # every rank in the same order and their collectives pair up
            with self._submit_lock:
                refs = [
                    w.call.remote(method, *[once(v) for v in a], **{key: once(v) for key, v in k.items()})
                    for w, (a, k) in zip(self.workers, per_rank, strict=True)
                ]
        except ray.exceptions.RayError as exc:  # e.g. the object store is full (the arguments of `method`)
            raise WorkerError(
                f"{self.role}: Ray could not send {method}'s arguments: {type(exc).__name__}: {exc}",
                role=self.role,
            ) from exc
        return gather(self._get(refs, method)[::replicas])

    def ping(self) -> list[dict[str, Any]]:
        """Each rank's answer (its worker's `ping()`: rank, pid), in rank order; a dead rank raises."""
        return self._get([w.ping.remote() for w in self.workers], "ping")

    def placement(self) -> list[dict[str, Any]]:
        """Which node each rank runs on (node id and IP) and with how many torch threads, for placement
        checks."""
        infos = self._get([w.where.remote() for w in self.workers], "placement")
        return [{"rank": rank, **info} for rank, info in enumerate(infos)]

    def shutdown(self) -> None:
        import ray

        for worker in self.workers:
            ray.kill(worker, no_restart=True)
        self.workers = []
        pool = getattr(self, "pool", None)
        if self._own_pool and pool is not None:
            pool.remove()
            self.pool = None
