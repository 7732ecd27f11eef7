"""Run in a subprocess by test_multinode.py: a simulated 2-node Ray cluster on loopback (ray.cluster_utils),
an RL run whose FSDP group spans both nodes, and one PPO update at world size 1, 2 (1 per node) and 4 (2 per
node) on the same global batch. Writes what it saw as JSON for the test to check.

Usage: python cluster_job.py MODEL_DIR TRAIN_FILE OUT_DIR [split]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def start_cluster(tmpdir: str):
    from posttrain.controller.ray_env import loopback_env

    os.environ.update(loopback_env(tmpdir))  # before ray is imported: every node binds to 127.0.0.1
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=4)  # logical CPUs: room for a pool while the last one is freed
    cluster.wait_for_nodes()
    return cluster


def rl_run(model: str, train: str, run_dir: Path, address: str, *extra: str) -> dict:
    from posttrain.config.load import load_config
    from posttrain.config.schema import RLConfig
    from posttrain.trainers.rl import RLTrainer

    cfg = load_config(
        RLConfig,
        "rl",
        [
            f"model.path={model}",
            f"data.train_files=[{train}]",
            f"trainer.run_dir={run_dir}",
            f"ray.address={address}",
            "trainer.backend=ray",
            "trainer.nnodes=2",
            "trainer.n_workers_per_node=1",
            "trainer.total_steps=2",
            "trainer.val_every=0",
            "trainer.val_before_train=false",
            "trainer.loggers=[jsonl]",
            "data.train_batch_prompts=4",
            "data.max_response_length=6",
            "rollout.n=4",
            "actor.optim.lr=1e-3",
            *extra,
        ],
    )
    RLTrainer(cfg).fit()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"placement": json.loads((run_dir / "placement.json").read_text()), "rows": rows}


def one_update(model: str, pool_nodes: int, per_node: int, out: Path) -> dict:
    """One PPO step of world size nodes x per_node on a fixed global batch; loss and exported weights."""
    import torch
    from safetensors.torch import load_file

    from posttrain.config.schema import OptimConfig
    from posttrain.controller.resource_pool import PoolSpec, ResourcePool
    from posttrain.controller.worker_group import RayWorkerGroup
    from posttrain.data import keys
    from posttrain.engine.engine_config import EngineConfig
    from posttrain.workers.actor_rollout_ref import ActorRolloutRefSpec, ActorRolloutRefWorker
    from posttrain.workers.losses import LossSpec

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from engine.helpers import synthetic_rl_batch, with_global_totals

    spec = ActorRolloutRefSpec(
        EngineConfig(optim=OptimConfig(lr=1e-3, grad_clip=1e9), model_path=model, micro_batch_size=2),
        with_rollout=False,
        with_ref=False,
        threads=1,
    )
    pool = ResourcePool(PoolSpec(f"ws{pool_nodes * per_node}", pool_nodes, per_node, 1.0))
    group = RayWorkerGroup(ActorRolloutRefWorker, spec, role="actor", device="cpu", pool=pool)
    try:
        batch = synthetic_rl_batch(rows=8, prompt_width=6, response_width=5, vocab=1000, seed=7)
        fwd = batch.select([keys.INPUT_IDS, keys.ATTENTION_MASK, keys.POSITION_IDS, keys.RESPONSES], [])
        batch = batch.union(group.call("forward", fwd, "actor"))
        batch.set(keys.OLD_LOG_PROBS, batch[keys.OLD_LOG_PROBS] + 0.1 * batch[keys.ADVANTAGES].sign())
        loss = LossSpec("ppo", {"use_kl_loss": False, "loss_agg_mode": "seq-mean-token-mean"})
        metrics = group.call("forward_backward", with_global_totals(batch), loss)
        metrics.update(group.call("optim_step"))
        export = out / f"ws{pool_nodes * per_node}"
        group.call("export_hf", str(export))
        nodes = sorted({p["node_id"] for p in group.placement()})
        weights = load_file(export / "model.safetensors")
        torch.save(weights, out / f"weights_ws{pool_nodes * per_node}.pt")
        return {"loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "nodes": len(nodes)}
    finally:
        group.shutdown()
        pool.remove()


def main() -> None:
    model, train, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    modes = sys.argv[4:] or ["rl", "equivalence"]
    out.mkdir(parents=True, exist_ok=True)
    cluster = start_cluster(f"/tmp/ptc-{os.getpid()}")  # short: Ray socket paths must stay < 108 bytes
    import ray

    ray.init(address=cluster.address)
    report: dict = {"nodes": [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]}
    if "rl" in modes:
        report["rl"] = rl_run(model, train, out / "rl", cluster.address)
    if "split" in modes:
        report["split"] = rl_run(
            model,
            train,
            out / "split",
            cluster.address,
            "trainer.nnodes=1",
            "+resources.pools.gen.nnodes=1",
            "+resources.pools.gen.n_workers_per_node=1",
            "resources.rollout=gen",
        )
    if "equivalence" in modes:
        report["equivalence"] = {
            str(n * k): one_update(model, n, k, out) for n, k in ((1, 1), (2, 1), (2, 2))
        }
    (out / "report.json").write_text(json.dumps(report, indent=1))
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main()
