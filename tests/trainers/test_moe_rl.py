"""Mixture-of-experts policies end to end: GRPO and SFT on tiny-moe with the router's load-balancing loss, LoRA on
the experts, routing replay (R3 colocated and with a rollout pool; R2 with the hf engine, agents, async RL, and
with sequence parallelism and the aux loss on 2 workers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.config.load import load_config
from posttrain.config.schema import SFTConfig
from posttrain.trainers.rl import RLTrainer
from posttrain.trainers.sft import SFTTrainer

from .test_agent_rl import agent_config, tool_data  # noqa: F401 (tool_data: a fixture)
from .test_rl_e2e import reward_file, rl_config, rows

LOCAL = ["trainer.backend=local", "trainer.threads_per_worker=1", "trainer.val_before_train=false"]


def test_grpo_two_steps_on_tiny_moe_with_the_aux_loss(
    tiny_moe_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    extra = ["trainer.total_steps=2", "model.router_aux_loss_coef=0.01", *LOCAL, reward_file(tmp_path)]
    RLTrainer(rl_config(tiny_moe_dir, arithmetic_data, run, *extra)).fit()
    steps = [r for r in rows(run) if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["rollout/logprob_diff_max"] < 1e-4  # the native sampler runs the MoE as the trainer does
        assert r["actor/grad_norm"] > 0
        assert 1.9 < r["actor/router_aux_loss"] < 4.0  # k = 2 when balanced, up to k x experts
        assert "actor/replayed_tokens" not in r  # no routing replay configured
    assert (run / "step_2").exists()


def test_grpo_step_with_lora_on_the_experts(
    tiny_moe_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    """Adapters on the fused experts (and attention) train; the sampler gets the merged weights each step, so
    its log-probs stay the trainer's; the reference is the adapter switched off (KL loss on)."""
    run = tmp_path / "run"
    lora = [
        "model.lora.rank=4",
        "model.lora.target_modules=[q_proj]",
        "model.lora.target_parameters=[gate_up_proj]",
    ]
    extra = ["trainer.total_steps=2", "actor.optim.lr=0.01", *lora, *LOCAL, reward_file(tmp_path)]
    RLTrainer(rl_config(tiny_moe_dir, arithmetic_data, run, *extra)).fit()
    steps = [r for r in rows(run) if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["rollout/logprob_diff_max"] < 1e-4
        assert r["actor/grad_norm"] > 0
    assert steps[1]["actor/kl_loss"] > 0  # the update moved the policy away from the base (adapter off)


def test_grpo_with_routing_replay(
    tiny_model_dir: Path, tiny_moe_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    """R3: the sampler records its experts, the old-log-prob pass and the update replay them (two mini-batches,
    so the second update runs routed by the sampler after the policy moved); refusals name the key."""

    from posttrain.errors import ConfigError

    run = tmp_path / "run"
    r3 = ["actor.router_replay.mode=R3", "actor.mini_batch_size=8", "actor.reuse_log_probs_on_policy=false"]
    RLTrainer(rl_config(tiny_moe_dir, arithmetic_data, run, "trainer.total_steps=2", *r3, *LOCAL)).fit()
    steps = [r for r in rows(run) if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["rollout/logprob_diff_max"] < 1e-4 and r["actor/grad_norm"] > 0
        assert r["actor/replayed_tokens"] > 0  # the update ran routed by the sampler's experts
    with pytest.raises(
        ConfigError, match="actor.router_replay.mode=R3 is not supported with rollout.name=hf"
    ):
        RLTrainer(rl_config(tiny_moe_dir, arithmetic_data, tmp_path / "a", *r3, "rollout.name=hf"))
    with pytest.raises(ConfigError, match="R3 needs a mixture-of-experts model"):
        RLTrainer(rl_config(tiny_model_dir, arithmetic_data, tmp_path / "b", *r3))


def test_grpo_with_r2_through_posttrain_train(
    tiny_model_dir: Path, tiny_moe_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    """R2: the actor's old-log-prob pass records its experts and the two mini-batch updates replay them, with
    the hf rollout engine (which records nothing: R2 needs no sampler support); refusals name the key."""

    from posttrain.cli import main
    from posttrain.errors import ConfigError

    from .test_rl_e2e import rl_overrides

    run = tmp_path / "run"
    r2 = ["actor.router_replay.mode=R2", "actor.mini_batch_size=8", "rollout.name=hf"]
    overrides = rl_overrides(
        tiny_moe_dir, arithmetic_data, run, "trainer.total_steps=2", *r2, *LOCAL, reward_file(tmp_path)
    )
    assert main(["train", *overrides]) == 0
    steps = [r for r in rows(run) if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["actor/grad_norm"] > 0 and r["timing/old_log_prob"] > 0  # the recording pass ran
        assert r["actor/replayed_tokens"] > 0  # and the update replayed what it recorded
    with pytest.raises(
        ConfigError, match="R2 is not supported with algorithm.rollout_correction.bypass_mode"
    ):
        bypass = "algorithm.rollout_correction.bypass_mode=true"
        RLTrainer(rl_config(tiny_moe_dir, arithmetic_data, tmp_path / "a", *r2, bypass))
    with pytest.raises(ConfigError, match="R2 needs a mixture-of-experts model"):
        RLTrainer(rl_config(tiny_model_dir, arithmetic_data, tmp_path / "c", *r2))
    with pytest.raises(ConfigError, match=r"R3 is not supported with agent.enable=true .*R2 works with it"):
        r3_agents = ["actor.router_replay.mode=R3", "agent.enable=true"]
        RLTrainer(rl_config(tiny_moe_dir, arithmetic_data, tmp_path / "d", *r3_agents))


def test_r2_on_tool_episodes(tiny_moe_dir: Path, tool_data: dict, tmp_path: Path) -> None:  # noqa: F811
    """R2 with agents (refused for R3): episodes with tool tokens the sampler never routed train with the
    experts the old-log-prob pass recorded (two mini-batches: the second update replays after a step)."""
    run = tmp_path / "run"
    r2 = ["actor.router_replay.mode=R2", "actor.mini_batch_size=2", "trainer.val_every=0", *LOCAL[1:]]
    RLTrainer(agent_config(tiny_moe_dir, tool_data, run, *r2)).fit()
    steps = [r for r in rows(run) if "agent/turns_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["timing/old_log_prob"] > 0 and r["actor/replayed_tokens"] > 0 for r in steps)


@pytest.mark.slow  # Ray: a trainer worker and a rollout pool of one
def test_grpo_with_r3_sampled_by_a_rollout_pool_of_its_own(
    tiny_moe_dir: Path, arithmetic_data: dict, tmp_path: Path, ray_cluster: None
) -> None:
    """R3 with split placement: the pool's built-in engine records the experts and the batch carries them to the
    actor's old-log-prob and update passes (both select the column, so a batch without it fails the step)."""
    run = tmp_path / "run"
    split = ["trainer.backend=ray", "resources.rollout=gen", "+resources.pools.gen.n_workers_per_node=1"]
    r3 = [
        "actor.router_replay.mode=R3",
        "actor.mini_batch_size=8",
        "trainer.total_steps=2",
        *split,
        *LOCAL[1:],
    ]
    RLTrainer(rl_config(tiny_moe_dir, arithmetic_data, run, *r3, reward_file(tmp_path))).fit()
    steps = [r for r in rows(run) if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["rollout/logprob_diff_max"] < 1e-4 and r["actor/grad_norm"] > 0
        assert r["actor/replayed_tokens"] > 0


@pytest.mark.slow  # Ray: a trainer worker and a rollout pool sampling one step ahead
def test_grpo_with_r2_and_asynchronous_rollouts(
    tiny_moe_dir: Path, arithmetic_data: dict, tmp_path: Path, ray_cluster: None
) -> None:
    """R2 with async RL (refused for R3): batches sampled by older weights get their experts recorded by the
    trainer's old-log-prob pass, and the two mini-batch updates replay them."""
    run = tmp_path / "run"
    split = ["trainer.backend=ray", "resources.rollout=gen", "+resources.pools.gen.n_workers_per_node=1"]
    r2 = [
        "actor.router_replay.mode=R2",
        "actor.mini_batch_size=8",
        "async_rl.staleness=1",
        "trainer.val_every=0",
    ]
    r2 += ["trainer.total_steps=2", *split, *LOCAL[1:], reward_file(tmp_path)]
    cfg = rl_config(tiny_moe_dir, arithmetic_data, run, *r2)
    RLTrainer(cfg).fit()
    steps = [r for r in rows(run) if "async/staleness" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["actor/grad_norm"] > 0 and r["timing/old_log_prob"] > 0 for r in steps)
    assert all(r["actor/replayed_tokens"] > 0 for r in steps)


@pytest.mark.slow  # Ray: 2 workers, one sp group
@pytest.mark.parametrize("mode", ["R2", "R3"])
def test_grpo_with_routing_replay_and_the_aux_loss_under_sequence_parallelism(
    tiny_moe_dir: Path, arithmetic_data: dict, tmp_path: Path, ray_cluster: None, mode: str
) -> None:
    """MoE end to end on 2 workers with sp=2 (each rank holds half of every packed row): the aux loss summed over
    the sp group, routing replayed in two mini-batch updates (R2: recorded by the old-log-prob pass, each
    rank's slice gathered; R3: the sampler's), the native sampler's log-probs still the trainer's."""
    run = tmp_path / "run"
    sp = ["model.sequence_parallel_size=2", "trainer.backend=ray", "trainer.n_workers_per_node=2"]
    extra = [f"actor.router_replay.mode={mode}", "actor.mini_batch_size=8", "model.router_aux_loss_coef=0.01"]
    extra += ["trainer.total_steps=2", "trainer.val_every=0", *sp, *LOCAL[1:], reward_file(tmp_path)]
    RLTrainer(rl_config(tiny_moe_dir, arithmetic_data, run, *extra)).fit()
    steps = [r for r in rows(run) if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["rollout/logprob_diff_max"] < 1e-4
        assert r["actor/grad_norm"] > 0 and r["actor/replayed_tokens"] > 0
        assert 1.9 < r["actor/router_aux_loss"] < 4.0


def test_sft_on_tiny_moe_logs_the_aux_loss(tiny_moe_dir: Path, arithmetic_data: dict, tmp_path: Path) -> None:
    cfg = load_config(
        SFTConfig,
        "sft",
        [
            f"model.path={tiny_moe_dir}",
            f"data.train_files=[{arithmetic_data['train']}]",
            f"trainer.run_dir={tmp_path}",
            "trainer.total_steps=2",
            "trainer.val_every=0",
            "trainer.threads_per_worker=1",
            "optim.batch_size=8",
            "optim.micro_batch_size=8",
        ],
    )
    SFTTrainer(cfg).fit()
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    aux = [r["actor/router_aux_loss"] for r in logged if "actor/router_aux_loss" in r]
    assert len(aux) == 2 and all(a > 1.9 for a in aux)  # the config's own coefficient, 0.001, by default


def test_aux_loss_settings_fail_at_start(
    tiny_model_dir: Path, tiny_moe_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:

    from posttrain.errors import ConfigError

    with pytest.raises(ConfigError, match="model.router_aux_loss_coef=0.1 needs a mixture-of-experts"):
        RLTrainer(
            rl_config(tiny_model_dir, arithmetic_data, tmp_path / "a", "model.router_aux_loss_coef=0.1")
        )
    experts = ["model.lora.rank=4", "model.lora.target_modules=[q_proj,gate_up_proj]"]
    with pytest.raises(ConfigError, match=r"\['gate_up_proj'\]: fused 3-D expert parameters"):
        RLTrainer(rl_config(tiny_moe_dir, arithmetic_data, tmp_path / "b", *experts))


def test_aux_loss_with_sequence_parallelism_passes_the_checks(
    tiny_model_dir: Path, tiny_moe_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    """The load-balancing loss under sp > 1 is computed over the sp group (tests/engine/test_moe.py), so the
    start-up checks accept it; a positive coefficient on a dense model is still refused."""
    from posttrain.errors import ConfigError
    from posttrain.trainers.checks import check_rl_config

    sp = ["model.sequence_parallel_size=2", "trainer.backend=ray", "trainer.n_workers_per_node=2"]
    aux = "model.router_aux_loss_coef=0.01"
    check_rl_config(rl_config(tiny_moe_dir, arithmetic_data, tmp_path / "a", *sp, aux))
    with pytest.raises(ConfigError, match="model.router_aux_loss_coef=0.01 needs a mixture-of-experts"):
        check_rl_config(rl_config(tiny_model_dir, arithmetic_data, tmp_path / "b", *sp, aux))
