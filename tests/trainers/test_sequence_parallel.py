"""model.sequence_parallel_size in the trainers: impossible settings fail at start with the key named; SFT and
GRPO with sp=2 on 2 Ray workers (one data-parallel group) give what sp=1 gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.config.load import load_config
from posttrain.config.schema import DPOConfig, RLConfig, RMConfig, SFTConfig
from posttrain.errors import ConfigError
from posttrain.trainers.checks import check_rl_config
from posttrain.trainers.dpo import check_dpo_config
from posttrain.trainers.rl import RLTrainer
from posttrain.trainers.rm import check_rm_config
from posttrain.trainers.sft import SFTTrainer

from .test_rl_e2e import reward_file, rl_overrides

RAY2 = ["trainer.backend=ray", "trainer.n_workers_per_node=2", "trainer.threads_per_worker=1"]


def rl_config(model: Path, data: dict, *extra: str) -> RLConfig:
    return load_config(
        RLConfig,
        "rl",
        [f"model.path={model}", f"data.train_files=[{data['train']}]", "trainer.val_before_train=false",
         "trainer.val_every=0", *extra],
    )  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.sequence_parallel_size=2", "trainer.backend=local"], "needs trainer.backend=ray"),
        (["model.sequence_parallel_size=2", "trainer.backend=ray", "trainer.n_workers_per_node=3",
          "data.train_batch_prompts=3"], r"must divide the ranks of the role \(3\)"),
        (["model.sequence_parallel_size=3", "trainer.backend=ray", "trainer.n_workers_per_node=3",
          "data.train_batch_prompts=3"], "must divide the model's 4 attention heads"),
        (["model.sequence_parallel_size=2", *RAY2, "model.attn_implementation=eager"],
         "needs model.remove_padding=true and model.attn_implementation=sdpa"),
        (["model.sequence_parallel_size=0"], "must be >= 1"),
        # world 4 = dp 2 x sp 2: a mini-batch is split over the 2 groups, so 2 divides it, 3 does not
        (["model.sequence_parallel_size=2", "trainer.backend=ray", "trainer.n_workers_per_node=4",
          "data.train_batch_prompts=3", "rollout.n=4", "actor.mini_batch_size=3"],
         r"divisible by the 2 data-parallel groups \(workers / model.sequence_parallel_size\)"),
        # the critic on a pool of 3 workers cannot hold groups of 2
        (["model.sequence_parallel_size=2", *RAY2, "algorithm.adv_estimator=gae", "critic.enable=true",
          "resources.critic=crit", "+resources.pools.crit.n_workers_per_node=3"],
         r"must divide the 3 workers of pool 'crit' \(resources.critic\)"),
    ],
)  # fmt: skip
def test_rl_rejects_impossible_sequence_parallel_settings(
    tiny_model_dir: Path, arithmetic_data: dict, overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        check_rl_config(rl_config(tiny_model_dir, arithmetic_data, *overrides))


def test_rl_mini_batches_need_only_divide_the_data_parallel_groups(
    tiny_model_dir: Path, arithmetic_data: dict
) -> None:
    # 4 workers, sp=2: mini-batches of 2 samples go to 2 groups (they could not go to 4 workers)
    check_rl_config(
        rl_config(
            tiny_model_dir,
            arithmetic_data,
            "model.sequence_parallel_size=2",
            "trainer.backend=ray",
            "trainer.n_workers_per_node=4",
            "actor.mini_batch_size=2",
        )
    )


def sft_config(model: Path, data: dict, run_dir: Path, *extra: str) -> SFTConfig:
    return load_config(
        SFTConfig,
        "sft",
        [
            f"model.path={model}",
            f"data.train_files=[{data['train']}]",
            f"trainer.run_dir={run_dir}",
            "trainer.total_steps=2",
            "trainer.loggers=[jsonl]",
            "trainer.plots=false",
            "optim.batch_size=16",
            "optim.micro_batch_size=8",
            "optim.warmup_steps=0",
            "model.pack_row_tokens=64",  # several sequences per packed row, of widths not all even
            *extra,
        ],
    )


def test_sft_rejects_impossible_sequence_parallel_settings(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path
) -> None:
    local = sft_config(tiny_model_dir, arithmetic_data, tmp_path, "model.sequence_parallel_size=2")
    with pytest.raises(ConfigError, match="needs trainer.backend=ray"):
        SFTTrainer(local)
    # 4 workers = 2 groups of 2
    odd = sft_config(tiny_model_dir, arithmetic_data, tmp_path, "model.sequence_parallel_size=2", *RAY2,
                     "trainer.n_workers_per_node=4", "optim.batch_size=15")  # fmt: skip
    with pytest.raises(ConfigError, match="optim.batch_size=15 must be divisible by the 2 data-parallel"):
        SFTTrainer(odd)
    unpacked = sft_config(tiny_model_dir, arithmetic_data, tmp_path, "model.sequence_parallel_size=2", *RAY2,
                          "model.remove_padding=false")  # fmt: skip
    with pytest.raises(ConfigError, match="needs model.remove_padding=true"):
        SFTTrainer(unpacked)


def test_dpo_and_rm_reject_sequence_parallelism(tiny_model_dir: Path, arithmetic_data: dict) -> None:
    sp2 = [f"model.path={tiny_model_dir}", "model.sequence_parallel_size=2", *RAY2]
    files = f"data.train_files=[{arithmetic_data['train']}]"  # read only after the checks
    with pytest.raises(ConfigError, match="posttrain dpo does not support sequence parallelism"):
        check_dpo_config(load_config(DPOConfig, "dpo", [*sp2, files]))
    with pytest.raises(ConfigError, match="the reward model runs right-padded rows"):
        check_rm_config(load_config(RMConfig, "rm", [*sp2, files]))


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # 18-29 s of worker processes on 2 cores; CI runs it with -m slow
def test_sft_with_sp2_on_two_workers_equals_one_worker(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path, ray_cluster: None
) -> None:
    SFTTrainer(
        sft_config(tiny_model_dir, arithmetic_data, tmp_path / "sp1", "trainer.threads_per_worker=1")
    ).fit()
    SFTTrainer(
        sft_config(tiny_model_dir, arithmetic_data, tmp_path / "sp2", "model.sequence_parallel_size=2", *RAY2)
    ).fit()
    one, two = metrics(tmp_path / "sp1"), metrics(tmp_path / "sp2")
    assert [r["step"] for r in one] == [r["step"] for r in two] == [1, 2]
    for a, b in zip(one, two, strict=True):
        # step 2 runs on the weights step 1 updated: equal there too means equal gradients and updates
        for key in ("loss", "sft/nll", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


@pytest.mark.slow
def test_grpo_step_with_sp2_equals_sp1(
    tiny_model_dir: Path, arithmetic_data: dict, tmp_path: Path, ray_cluster: None
) -> None:
    """Both runs sample on 2 workers (generation does not use sp), so their responses are the same; the
    old-log-prob pass, the reference, the loss and the gradients of 2 mini-batches then run on 2 data-parallel
    groups (sp=1) or on one group whose 2 ranks each hold half of every packed row (sp=2)."""
    job = [
        *RAY2,
        reward_file(tmp_path),
        "trainer.total_steps=1",
        "trainer.val_before_train=false",
        "trainer.val_every=0",
        "trainer.save_every=0",
        "actor.mini_batch_size=8",  # 2 optimizer steps: the second mini-batch's ratio is no longer 1
        "trainer.balance_batch=false",  # balancing over 2 groups or 1 would put other rows in a mini-batch
        "model.pack_row_tokens=64",
    ]
    runs = {}
    for sp in (1, 2):
        run = tmp_path / f"sp{sp}"
        overrides = rl_overrides(
            tiny_model_dir, arithmetic_data, run, *job, f"model.sequence_parallel_size={sp}"
        )
        RLTrainer(load_config(RLConfig, "rl", overrides)).fit()
        runs[sp] = next(r for r in metrics(run) if "reward/mean" in r)
    one, two = runs[1], runs[2]
    assert two["reward/mean"] == one["reward/mean"], "the same responses were sampled"
    # the trainer's log-probs against the sampler's: equal in both runs, and close to the sampler's
    assert two["rollout/logprob_diff_max"] < 1e-4
    assert two["rollout/logprob_diff_mean"] == pytest.approx(one["rollout/logprob_diff_mean"], abs=1e-6)
    assert one["actor/ppo_kl"] != 0.0 and one["actor/pg_loss"] != 0.0, (
        "the second mini-batch moved the policy"
    )
    for key in ("actor/pg_loss", "actor/ppo_kl", "actor/kl_loss", "actor/grad_norm", "actor/pg_clipfrac"):
        assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-7), key
