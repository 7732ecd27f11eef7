"""The reference policy on workers of its own (`resources.ref`): the same log-probs as on the actor's workers,
and in an asynchronous run computed by the producer beside the update."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.controller.placement import check_placement
from posttrain.errors import ConfigError
from posttrain.trainers.rl import RLTrainer
from tests.trainers.test_rl_e2e import reward_file, rl_config, rows

QUIET = [
    "trainer.backend=ray",
    "trainer.val_every=0",
    "trainer.val_before_train=false",
    "trainer.save_every=0",
    "trainer.threads_per_worker=1",  # the same budget in both placements (the default shares a node's cores)
]
OWN_POOL = ["resources.ref=refpool", "+resources.pools.refpool.n_workers_per_node=1"]


def test_a_reference_pool_is_placed_or_refused(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    def cfg(*extra: str):  # noqa: ANN202
        return rl_config(tiny_model_dir, arithmetic_data, tmp_path, *extra)

    with pytest.raises(ConfigError, match="resources.ref=gen but nothing uses the reference"):
        check_placement(
            cfg(
                "trainer.backend=ray",
                "resources.ref=gen",
                "actor.use_kl_loss=false",
                "+resources.pools.gen.nnodes=1",
            )
        )
    with pytest.raises(ConfigError, match="needs trainer.backend=ray"):
        check_placement(cfg("trainer.backend=local", "resources.ref=gen", "+resources.pools.gen.nnodes=1"))
    with pytest.raises(ConfigError, match="resources.ref=gen: no such pool"):
        check_placement(cfg("trainer.backend=ray", "resources.ref=gen"))
    with pytest.raises(ConfigError, match="sequence_parallel_size=2 must divide the 1 workers of pool 'gen'"):
        check_placement(
            cfg("trainer.backend=ray", "trainer.n_workers_per_node=2", "model.sequence_parallel_size=2",
                "resources.ref=gen", "+resources.pools.gen.n_workers_per_node=1")
        )  # fmt: skip
    check_placement(cfg("trainer.backend=ray", *OWN_POOL))  # KL in the loss by default


@pytest.mark.slow  # the default suite's time on 2 cores (CI runs it with -m slow)
def test_the_reference_on_its_own_pool_gives_the_same_run(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path, ray_cluster: None
) -> None:
    """Synchronous: the reference's log-probs from a worker of its own equal the actor worker's, so the KL
    loss, and with it the whole run, are the same; the actor's workers hold no reference copy."""
    runs = {}
    for name, extra in {"colocated": [], "own_pool": OWN_POOL}.items():
        run = tmp_path / name
        RLTrainer(
            rl_config(
                tiny_model_dir,
                arithmetic_data,
                run,
                "trainer.total_steps=2",
                *QUIET,
                *extra,
                reward_file(tmp_path),
            )
        ).fit()
        runs[name] = {r["step"]: r for r in rows(run) if "actor/kl_loss" in r}
        placement = json.loads((run / "placement.json").read_text())
        assert ("ref" in placement) == (name == "own_pool"), placement.keys()
    a, b = runs["colocated"], runs["own_pool"]
    assert a[2]["actor/kl_loss"] > 0, "the policy moved away from the reference after one update"
    for step in (1, 2):
        for key in ("reward/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-5, abs=1e-9), (step, key)
        assert b[step]["timing/ref"] > 0, "the synchronous loop asks the reference's pool"


@pytest.mark.slow  # the default suite's time on 2 cores (CI runs it with -m slow)
@pytest.mark.parametrize("streaming", [False, True])
def test_an_async_producer_computes_the_reference_beside_the_update(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path, ray_cluster: None, streaming: bool
) -> None:
    """The reference on the rollout's pool: every batch reaches the trainer with its reference log-probs, so
    the trainer's step has no reference pass, and the KL loss is live."""
    run = tmp_path / "run"
    async_rl = ["async_rl.staleness=2", "async_rl.streaming=true"] if streaming else ["async_rl.staleness=1"]
    cfg = rl_config(
        tiny_model_dir, arithmetic_data, run, *QUIET, "resources.rollout=gen", "resources.ref=gen",
        "+resources.pools.gen.n_workers_per_node=1", *async_rl, "algorithm.rollout_correction.rollout_is=token",
        "trainer.total_steps=4", reward_file(tmp_path),
    )  # fmt: skip
    RLTrainer(cfg).fit()
    train = [r for r in rows(run) if "async/staleness" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for r in train:
        assert "timing/ref" not in r, "the trainer computed the reference's log-probs itself"
        assert r["async/ref_s"] > 0 or streaming, "the producer's reference pass is timed per batch"
    assert sum(r["async/ref_s"] for r in train) > 0
    # step 1 trains the initial weights, which are the reference: the log-probs line up row for row and token
    # for token only if the producer's reference pass kept every row with its own
    assert abs(train[0]["actor/kl_loss"]) < 1e-6
    assert max(r["actor/kl_loss"] for r in train[1:]) > 0
    placement = json.loads((run / "placement.json").read_text())
    assert set(placement) == {"actor_rollout_ref", "rollout", "ref"}
