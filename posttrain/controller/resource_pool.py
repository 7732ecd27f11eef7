"""Resource pools: a Ray placement group reserving `nnodes x workers_per_node` worker slots, pinned per node.

Each slot (bundle) holds one worker's CPUs/GPUs; roles colocated on a pool share its slots (each asks for a
fraction), so the actor, reference, rollout and critic of one rank land on the same node and device. Bundles
are pinned to chosen nodes with label selectors, so `workers_per_node` slots really sit on each node (an
FSDP group spanning nodes, ranks ordered node by node).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from posttrain.errors import WorkerError

log = logging.getLogger(__name__)

NODE_LABEL = "ray.io/node-id"


@dataclass(frozen=True)
class PoolSpec:
    name: str
    nnodes: int = 1
    workers_per_node: int = 1
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0

    @property
    def world_size(self) -> int:
        return self.nnodes * self.workers_per_node

    @property
    def bundle(self) -> dict[str, float]:
        resources = {"CPU": self.cpus_per_worker}
        if self.gpus_per_worker:
            resources["GPU"] = self.gpus_per_worker
        return resources


def _alive_nodes() -> list[dict[str, Any]]:
    """Alive nodes, with `Resources` replaced by what is still free where Ray tells (a private API)."""
    import ray

    nodes = [dict(n) for n in ray.nodes() if n.get("Alive")]
    try:
        from ray._private.state import available_resources_per_node

        free = available_resources_per_node()
    except Exception:  # the totals are then an upper bound; placement itself is still bounded in time
        return nodes
    for node in nodes:
        node["Resources"] = free.get(node["NodeID"], node.get("Resources", {}))
    return nodes


def choose_nodes(spec: PoolSpec, taken: dict[str, dict[str, float]] | None = None) -> list[str]:
    """`spec.nnodes` node ids that each have room for `workers_per_node` slots; an error says what exists.

    `taken` is what earlier pools reserved per node (they are not placed yet when several pools are made).
    """
    taken = taken or {}
    need = {k: v * spec.workers_per_node for k, v in spec.bundle.items()}
    fits, seen = [], []
    for node in _alive_nodes():
        node_id, total = node["NodeID"], node.get("Resources", {})
        free = {k: total.get(k, 0.0) - taken.get(node_id, {}).get(k, 0.0) for k in need}
        seen.append(
            f"{node['NodeManagerAddress']}/{node_id[:8]}: " + ", ".join(f"{free[k]:g} {k}" for k in need)
        )
        if all(free[k] >= need[k] - 1e-9 for k in need):
            fits.append(node_id)
    if len(fits) < spec.nnodes:
        asked = ", ".join(f"{v:g} {k}" for k, v in need.items())
        raise WorkerError(
            f"resource pool '{spec.name}': asked for {spec.nnodes} node(s) with {asked} each "
            f"({spec.workers_per_node} workers x {spec.bundle}), but only {len(fits)} node(s) have room; "
            f"free per node: {'; '.join(seen) or 'no alive nodes'}"
        )
    return fits[: spec.nnodes]


class ResourcePool:
    """A placement group of `spec.world_size` bundles, bundle i on node i // workers_per_node."""

    def __init__(self, spec: PoolSpec, timeout_s: float = 30.0, nodes: list[str] | None = None) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        self.spec = spec
        self.nodes = nodes or choose_nodes(spec)
        selectors = [{NODE_LABEL: self.nodes[i // spec.workers_per_node]} for i in range(spec.world_size)]
        self.group = placement_group(
            [dict(spec.bundle) for _ in range(spec.world_size)],
            strategy="PACK",
            name=f"posttrain-{spec.name}-{uuid.uuid4().hex[:8]}",  # names are cluster-wide
            bundle_label_selector=selectors,
        )
        ready, _ = ray.wait([self.group.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(self.group)
            raise WorkerError(
                f"resource pool '{spec.name}': could not reserve {spec.world_size} x {spec.bundle} on "
                f"{spec.nnodes} node(s) within {timeout_s:g}s (cluster resources: {ray.available_resources()})"
            )
        log.info("pool %s: %d workers on nodes %s", spec.name, spec.world_size, [n[:8] for n in self.nodes])

    def scheduling(self, rank: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank)

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)


def choose_all_nodes(specs: list[PoolSpec]) -> dict[str, list[str]]:
    """Nodes for every pool at once, each pool counting what the pools before it take from a node."""
    taken: dict[str, dict[str, float]] = {}
    chosen: dict[str, list[str]] = {}
    for spec in specs:
        nodes = choose_nodes(spec, taken)
        chosen[spec.name] = nodes
        for node in nodes:
            used = taken.setdefault(node, {})
            for k, v in spec.bundle.items():
                used[k] = used.get(k, 0.0) + v * spec.workers_per_node
    return chosen


def wait_for_room(specs: list[PoolSpec], wait_s: float, poll_s: float = 0.5) -> dict[str, list[str]]:
    """`choose_all_nodes`, retried for up to `wait_s` seconds while the cluster lacks room.

    After a worker failure the old groups' resources come back only once Ray has seen their processes end
    and their placement groups removed (both asynchronous), so a restart waits for them instead of failing
    at once; `wait_s=0` is the fail-fast check of a first start.
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return choose_all_nodes(specs)
        except WorkerError as exc:
            if time.monotonic() >= deadline:
                if wait_s <= 0:
                    raise
                raise WorkerError(f"{exc} (still no room after waiting {wait_s:g}s)") from None
        time.sleep(poll_s)


def make_pools(
    specs: list[PoolSpec], timeout_s: float = 30.0, wait_s: float = 0.0
) -> dict[str, ResourcePool]:
    """Reserve every pool, choosing nodes for all before placing any, so pools never compete for a node.

    `wait_s`: how long to wait for room (resources still held by groups being torn down) before failing.
    """
    chosen = wait_for_room(specs, wait_s)
    pools: dict[str, ResourcePool] = {}
    try:
        for spec in specs:
            pools[spec.name] = ResourcePool(spec, timeout_s, nodes=chosen[spec.name])
    except Exception:
        for pool in pools.values():
            pool.remove()
        raise
    return pools
