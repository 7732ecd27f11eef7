"""Start-up checks of the driver loops: what cannot work is rejected before any model loads, with an error
that names the key (and, where one exists, the setting to use instead)."""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from posttrain.algorithms.aggregation import LOSS_AGG_MODES
from posttrain.algorithms.registry import get_advantage_estimator, get_kl_estimator
from posttrain.config.schema import (
    ModelConfig,
    RLConfig,
    VLLMConfig,
)
from posttrain.controller.placement import check_placement
from posttrain.engine.lora import check_target_modules
from posttrain.engine.moe import resolve_aux_loss_coef
from posttrain.engine.sequence_parallel import check_sequence_parallel
from posttrain.engine.shared_prompt import check_share_prompt
from posttrain.errors import ConfigError, DataError
from posttrain.models import check_model_dir, empty_model, is_vision_language, load_config, load_text_config
from posttrain.models.routing import is_moe
from posttrain.models.shared_tokenizer import check_same_tokenizer
from posttrain.rewards.user import load_reward_function
from posttrain.rollout import ROLLOUT_ENGINES, VLLM_INSTALL_HINT
from posttrain.tracking import check_backends
from posttrain.trainers.agent_generation import check_agent_config
from posttrain.trainers.async_rollout import check_async_config
from posttrain.trainers.on_policy_distill import check_distill_rl_config
from posttrain.trainers.pixel_bounds import check_pixel_bounds
from posttrain.trainers.settings_in_effect import check_settings_in_effect
from posttrain.trainers.setup import policy_loss_options

GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "gpg", "grpo_passk", "gdpo")
# inputs of an estimator that the trainer can supply (`advantage_kwargs`); any other required one is refused
SUPPLIED_INPUTS = ("values", "reward_baselines")


def check_files(files: Sequence[str], key: str) -> None:
    if not files:
        raise ConfigError(f"{key} is empty: give at least one parquet or jsonl file")
    for f in files:
        if not Path(f).expanduser().is_file():
            raise DataError(f"{key}: file not found: {f}")


def check_model_options(model: ModelConfig, longest: int, budgets: dict[str, int]) -> None:
    """Precision, packing, LoRA targets and token budgets, checked before any worker starts.

    `longest` is the longest prompt + response a step can hold; `budgets` maps each
    `max_token_len_per_worker` setting's name to its value.
    """
    for key, value, valid in (
        ("model.dtype", model.dtype, ("float32", "bfloat16")),
        ("model.compute_dtype", model.compute_dtype, ("", "float32", "bfloat16")),
    ):
        if value not in valid:
            shown = ", ".join(repr(v) for v in valid)
            raise ConfigError(f"{key} '{value}' unknown; valid: {shown}")
    if model.pack_row_tokens <= 0:
        raise ConfigError(f"model.pack_row_tokens must be > 0, got {model.pack_row_tokens}")
    check_share_prompt(model.share_prompt, model.remove_padding, model.attn_implementation)
    for name, budget in budgets.items():
        if budget < 0 or 0 < budget < longest:
            raise ConfigError(
                f"{name}={budget} is smaller than the longest sequence a step can hold "
                f"(data.max_prompt_length + data.max_response_length = {longest}); 0 turns the budget off"
            )
    if model.lora.rank > 0:
        check_target_modules(empty_model(model.path), model.lora)
    check_router_aux_loss(model)


def check_router_aux_loss(model: ModelConfig) -> None:
    """`model.router_aux_loss_coef` against the model: a positive one needs a mixture of experts. Any
    `model.sequence_parallel_size` works (engine.moe sums the loss's per-expert terms over the sp ranks)."""
    if model.router_aux_loss_coef is None:
        return  # the model config's own coefficient, nothing to check
    resolve_aux_loss_coef(load_config(model.path), model.router_aux_loss_coef)


def check_router_replay(cfg: RLConfig) -> None:
    """`actor.router_replay.mode` needs a mixture of experts (any sequence-parallel size: under sp each rank
    replays and records its slice of the packed rows, engine.routing_replay). R2 records in the trainer's
    old-log-prob pass, so any rollout engine, placement, async RL or agent loop works; rollout correction's
    bypass mode has no such pass (its old log-probs are the sampler's: R3). R3 needs the built-in engine
    (colocated or in a rollout pool of its own) in one synchronous pass per response: the only path that
    records each token's experts and carries them to the Batch (partial rollouts and agent episodes are
    assembled without them)."""
    mode = cfg.actor.router_replay.mode
    if mode == "disabled":
        return
    key = f"actor.router_replay.mode={mode}"
    if not is_moe(load_config(cfg.model.path)):
        raise ConfigError(f"{key} needs a mixture-of-experts model; {cfg.model.path} has no routed experts")
    refused: list[tuple[bool, str]] = []
    if mode == "R2":
        bypass = cfg.algorithm.rollout_correction.bypass_mode
        why = (
            "algorithm.rollout_correction.bypass_mode=true (no old-log-prob pass records the routing; use R3)"
        )
        refused.append((bypass, why))
    else:
        refused += [
            (
                cfg.rollout.name != "native",
                f"rollout.name={cfg.rollout.name} (only the native engine records routing; R2 works with any)",
            ),
            (cfg.async_rl.staleness > 0, f"async_rl.staleness={cfg.async_rl.staleness} (R2 works with it)"),
            (
                cfg.agent.enable,
                "agent.enable=true (episodes are not assembled with their sampled routing; R2 works with it)",
            ),
        ]
    for used, why in refused:
        if used:
            raise ConfigError(f"{key} is not supported with {why}; set actor.router_replay.mode=disabled")


def check_sequence_parallel_config(model: ModelConfig, world_size: int, backend: str) -> None:
    """`model.sequence_parallel_size` against the trainer's workers, the model's attention heads and the other
    model options (engine.sequence_parallel), before any worker starts."""
    sp = model.sequence_parallel_size
    if sp > 1 and backend == "local":
        raise ConfigError(
            f"model.sequence_parallel_size={sp} splits rows across workers: it needs trainer.backend=ray with "
            "trainer.n_workers_per_node (x nnodes) a multiple of it (backend=local runs one worker)"
        )
    heads = int(getattr(load_config(model.path), "num_attention_heads", 1)) if sp > 1 else 1
    check_sequence_parallel(sp, world_size, heads, model.attn_implementation, model.remove_padding)


def data_parallel_size(model: ModelConfig, world_size: int) -> int:
    """Data-parallel groups of the trainer's workers: the workers, or with sequence parallelism the groups of
    `model.sequence_parallel_size` workers that share rows (world = dp x sp)."""
    return world_size // max(1, model.sequence_parallel_size)


def check_context(cfg: RLConfig, path: str | None = None) -> None:
    """The longest sequence a rollout can ask for against the context (max_position_embeddings) of the model
    at `path` (default: the policy's), so that it fails here, naming the keys, instead of in the first
    generation or the critic's first pass after the model loads."""
    path = path or cfg.model.path
    context = getattr(load_text_config(path), "max_position_embeddings", None)
    if cfg.agent.enable:
        keys, longest = "agent.max_total_tokens", cfg.agent.max_total_tokens
    else:
        keys = "data.max_prompt_length + data.max_response_length"
        longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    if isinstance(context, int) and longest > context:
        raise ConfigError(
            f"{keys} = {longest} tokens exceeds the model's context of {context} positions "
            f"(max_position_embeddings in {path}/config.json): lower it, or use a model with a longer "
            "context (make-model --preset tiny-32k / small-32k for the built-in ones)"
        )
    vllm_len = cfg.rollout.vllm.max_model_len
    if cfg.rollout.name == "vllm" and path == cfg.model.path and 0 < vllm_len < longest:
        raise ConfigError(
            f"{keys} = {longest} tokens exceeds rollout.vllm.max_model_len={vllm_len}: raise it"
        )


def check_critic_model(cfg: RLConfig) -> None:
    """A critic on a model of its own (`critic.model_path`) reads the policy's token ids: the directory must
    exist, share the policy's tokenizer (another one would score the wrong tokens, silently, whenever its
    vocabulary is as large) and hold the longest sequence."""
    path = cfg.critic.model_path
    if not cfg.critic.enable or not path:
        return
    check_model_dir(path)
    check_same_tokenizer(cfg.model.path, path, key="critic (critic.model_path)")
    check_context(cfg, path)


def check_vision_language_model(model: ModelConfig) -> None:
    """What training a vision-language model on image rows needs (SFT and RL): one rank per row.

    Packed rows (`model.remove_padding=true`) and padded rows both work (engine.packed_images gives each packed
    sequence its own images and multimodal positions); sequence parallelism, which splits a packed row's
    columns over ranks, would separate image tokens from their images, and is refused naming the key."""
    if model.sequence_parallel_size > 1:
        raise ConfigError(
            f"model.sequence_parallel_size={model.sequence_parallel_size} is not supported for the "
            f"vision-language model {model.path}: sequence parallelism splits packed rows over ranks, which "
            "would separate image tokens from their images; set model.sequence_parallel_size=1"
        )


def check_rl_vision_language(cfg: RLConfig) -> None:
    """RL (GRPO and the PPO family) with a vision-language policy: image prompts are sampled by the built-in
    engine and their images reach the actor's and the reference's passes; what does not carry images yet is
    refused here, naming the key."""
    check_vision_language_model(cfg.model)
    refused = (
        (
            cfg.rollout.name in ROLLOUT_ENGINES and cfg.rollout.name != "native",
            f"rollout.name={cfg.rollout.name} cannot sample image prompts: use rollout.name=native",
        ),
        (
            cfg.critic.enable,
            "critic.enable=true: the critic's value head does not take images yet; use a critic-free "
            "estimator (algorithm.adv_estimator=grpo, rloo, ...)",
        ),
        (
            bool(cfg.reward.model.path),
            "reward.model.path is set: a reward model would score the text without the images; use a rule "
            "scorer or reward.custom_function_path",
        ),
        (
            bool(cfg.distill.teacher_path),
            "distill.teacher_path is set: the teacher's pass takes no images yet",
        ),
        (
            cfg.async_rl.staleness > 0,
            "async_rl.staleness >= 1: the asynchronous rollout producer does not carry images yet",
        ),
    )
    for used, why in refused:
        if used:
            raise ConfigError(f"{why} (model.path={cfg.model.path} is a vision-language model)")


def check_vllm_config(cfg: RLConfig) -> None:
    """rollout.name=vllm: what its engine refuses in each worker, refused here before any worker loads a model
    (posttrain/rollout/vllm_engine.py says why each is so). vLLM itself is not imported here: it imports Ray,
    which must not be imported before the local mode's loopback setting (controller/ray_env.py)."""
    if is_moe(load_config(cfg.model.path)):
        raise ConfigError(
            f"rollout.name=vllm with the mixture-of-experts model {cfg.model.path}: vLLM's in-place weight reload "
            "does not reproduce its updated experts (posttrain/rollout/vllm_engine.py); use rollout.name=native"
        )
    if cfg.resources.rollout == "trainer" and cfg.trainer.world_size > 1:
        raise ConfigError(
            f"rollout.name=vllm with {cfg.trainer.world_size} colocated training workers: each worker's vLLM would "
            "take the trainer's torch.distributed world as its own. Use one training worker, the rollout on a pool "
            "of its own (resources.rollout: each rollout worker is a process of its own), or rollout.name=native"
        )
    for key, temperature in (
        ("rollout.temperature", cfg.rollout.temperature),
        ("rollout.val_temperature", cfg.rollout.val_temperature),
    ):
        if temperature > 2 or 0 < temperature < 0.01:
            raise ConfigError(f"{key}={temperature}: vLLM samples at 0 (greedy) or in [0.01, 2]")
    if any(not stop for stop in cfg.rollout.stop):
        raise ConfigError("rollout.stop: vLLM refuses an empty stop string")
    if (
        cfg.trainer.device == "cpu"
        and cfg.rollout.vllm.gpu_memory_utilization != VLLMConfig().gpu_memory_utilization
    ):
        raise ConfigError(
            f"rollout.vllm.gpu_memory_utilization={cfg.rollout.vllm.gpu_memory_utilization} with trainer.device=cpu: "
            "not used on CPU; size vLLM's KV cache with rollout.vllm.kv_cache_gib"
        )


def check_rl_config(cfg: RLConfig) -> None:
    """Every check that needs no model weights: names in registries, sizes that divide, files that exist."""
    check_model_dir(cfg.model.path)
    if cfg.rollout.name == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"{VLLM_INSTALL_HINT}; or rollout.name=native, the built-in engine")
    if cfg.rollout.name == "vllm":
        check_vllm_config(cfg)
    if is_vision_language(cfg.model.path):
        check_rl_vision_language(cfg)
    check_pixel_bounds(cfg.data, cfg.model.path)
    check_context(cfg)
    check_critic_model(cfg)
    check_model_options(
        cfg.model,
        max(
            cfg.data.max_prompt_length + cfg.data.max_response_length,
            cfg.agent.max_total_tokens if cfg.agent.enable else 0,
        ),
        {
            "actor.max_token_len_per_worker": cfg.actor.max_token_len_per_worker,
            "critic.max_token_len_per_worker": cfg.critic.max_token_len_per_worker,
        },
    )
    check_sequence_parallel_config(cfg.model, cfg.trainer.world_size, cfg.trainer.backend)
    check_counts(cfg)
    check_files(cfg.data.train_files, "data.train_files")
    check_router_replay(cfg)
    check_distill_rl_config(cfg)
    if cfg.trainer.val_every or cfg.trainer.val_before_train:
        if not cfg.data.val_files:
            raise ConfigError(
                f"data.val_files is empty: trainer.val_every={cfg.trainer.val_every} / "
                f"trainer.val_before_train={str(cfg.trainer.val_before_train).lower()} validate on it; give "
                "held-out rows, or turn validation off with trainer.val_every=0 trainer.val_before_train=false"
            )
        check_files(cfg.data.val_files, "data.val_files")
    check_rl_settings(cfg)
    if cfg.reward.custom_function_path:
        load_reward_function(cfg.reward.custom_function_path, cfg.reward.custom_function_name)
    check_backends(cfg.trainer.loggers, key="trainer.loggers")  # unknown names; wandb/mlflow not installed


def check_rl_settings(cfg: RLConfig) -> None:
    """The checks of `check_rl_config` that read the config alone (no model directory, data or reward file,
    no installed tracker): names in registries, sizes that divide, step counts, settings in effect. `posttrain
    config from-verl` runs them on what it converts, so both refuse the same command lines."""
    check_counts(cfg)
    check_agent_config(cfg)
    check_async_config(cfg)
    estimator = get_advantage_estimator(cfg.algorithm.adv_estimator)
    policy_loss_options(cfg.actor, cfg.algorithm)  # unknown loss, an option the chosen loss does not take
    check_algorithm(cfg, estimator)
    if cfg.actor.use_kl_loss:
        get_kl_estimator(cfg.actor.kl_loss_type)
    if cfg.actor.loss_agg_mode not in LOSS_AGG_MODES:
        raise ConfigError(
            f"unknown actor.loss_agg_mode '{cfg.actor.loss_agg_mode}'; valid: {', '.join(LOSS_AGG_MODES)}"
        )
    if cfg.rollout.name not in ROLLOUT_ENGINES:
        raise ConfigError(f"unknown rollout.name '{cfg.rollout.name}'; valid: {', '.join(ROLLOUT_ENGINES)}")
    if cfg.rollout.max_batch_size <= 0:
        raise ConfigError(f"rollout.max_batch_size must be > 0, got {cfg.rollout.max_batch_size}")
    check_placement(cfg)
    samples = cfg.data.train_batch_prompts * cfg.rollout.n
    mini = cfg.actor.mini_batch_size or samples
    dp = data_parallel_size(cfg.model, cfg.trainer.world_size)
    # mini-batches split over the data-parallel groups (the ranks of a sequence-parallel group share rows)
    workers = (
        f"{dp} data-parallel groups (workers / model.sequence_parallel_size)"
        if dp < cfg.trainer.world_size
        else f"{dp} workers"
    )
    if samples % mini:
        raise ConfigError(
            f"actor.mini_batch_size={mini} must divide the samples per step "
            f"(data.train_batch_prompts * rollout.n = {samples})"
        )
    if mini % dp:
        raise ConfigError(f"actor.mini_batch_size={mini} must be divisible by the {workers}")
    if cfg.critic.enable:
        critic_mini = cfg.critic.mini_batch_size or samples
        if samples % critic_mini or critic_mini % dp:
            raise ConfigError(
                f"critic.mini_batch_size={critic_mini} must divide the samples per step ({samples}) and be "
                f"divisible by the {workers}"
            )
    if cfg.actor.micro_batch_size <= 0:
        raise ConfigError(f"actor.micro_batch_size must be > 0, got {cfg.actor.micro_batch_size}")
    check_update_counts(cfg)
    check_settings_in_effect(cfg)  # keys set while the switch that uses them is off


def check_counts(cfg: RLConfig) -> None:
    """Step counts and sizes in their ranges, naming the key. verl writes -1 for "never" (test_freq, save_freq):
    here `step % -1 == 0` would mean every step, the opposite, so a negative count is refused with what 0
    means instead."""
    bounds = {
        "trainer.total_steps": (cfg.trainer.total_steps, 1, ""),
        "trainer.val_every": (cfg.trainer.val_every, 0, " (0 = never, verl's -1)"),
        "trainer.save_every": (cfg.trainer.save_every, 0, " (0 = only at the end, verl's -1)"),
        "data.val_max_prompts": (cfg.data.val_max_prompts, 0, " (0 = every validation prompt)"),
        "data.train_batch_prompts": (cfg.data.train_batch_prompts, 1, ""),
        "rollout.n": (cfg.rollout.n, 1, ""),
    }
    for key, (value, least, meaning) in bounds.items():
        if value < least:
            raise ConfigError(f"{key} must be >= {least}{meaning}, got {value}")


def check_update_counts(cfg: RLConfig) -> None:
    """Settings under which a model would never train, or that fail only at the first update (after a whole
    generation): refused before the workers start."""
    if cfg.actor.ppo_epochs < 1:
        raise ConfigError(
            f"actor.ppo_epochs must be >= 1 (passes over each batch), got {cfg.actor.ppo_epochs}"
        )
    warmup, total = cfg.algorithm.critic_warmup, cfg.trainer.total_steps
    if warmup < 0:
        raise ConfigError(f"algorithm.critic_warmup must be >= 0, got {warmup}")
    if not cfg.critic.enable:
        return
    critic = cfg.critic
    if critic.ppo_epochs < 1:
        raise ConfigError(f"critic.ppo_epochs must be >= 1 (passes over each batch), got {critic.ppo_epochs}")
    if critic.micro_batch_size <= 0:
        raise ConfigError(f"critic.micro_batch_size must be > 0, got {critic.micro_batch_size}")
    if not critic.cliprange_value > 0:
        raise ConfigError(
            f"critic.cliprange_value must be > 0 (the value clip around the old values), got "
            f"{critic.cliprange_value}"
        )
    if warmup >= total:
        raise ConfigError(
            f"algorithm.critic_warmup={warmup} critic-only steps leave none of trainer.total_steps={total} "
            "for the actor"
        )


def check_algorithm(cfg: RLConfig, estimator: Callable[..., Any]) -> None:
    """Combinations that cannot work are rejected here, with the reason."""
    algo, name = cfg.algorithm, cfg.algorithm.adv_estimator
    params = inspect.signature(estimator).parameters
    needs = {
        p for p, v in params.items() if v.kind is inspect.Parameter.KEYWORD_ONLY and v.default is v.empty
    }
    unsupplied = sorted(needs - set(SUPPLIED_INPUTS))
    if unsupplied:
        raise ConfigError(
            f"algorithm.adv_estimator={name} needs {', '.join(unsupplied)} per response token, which the trainer "
            "does not supply to advantage estimators yet (the actor's forward pass returns log-probs only); "
            "the estimator function can be called directly"
        )
    if "values" in needs and not cfg.critic.enable:
        raise ConfigError(
            f"algorithm.adv_estimator={name} needs a critic: set critic.enable=true (or algorithm=ppo)"
        )
    if cfg.critic.enable and "values" not in params:
        raise ConfigError(f"critic.enable=true but algorithm.adv_estimator={name} does not use values")
    # pure distillation (task_reward_coef 0) uses no task advantage: a group of one is fine there
    task_advantage = not (cfg.distill.teacher_path and cfg.distill.task_reward_coef == 0)
    if name in GROUP_ESTIMATORS and cfg.rollout.n < 2 and task_advantage:
        raise ConfigError(
            f"algorithm.adv_estimator={name} needs rollout.n >= 2 (advantages are relative to a group)"
        )
    if "reward_baselines" in needs and algo.dynamic_sampling:
        raise ConfigError("algorithm.adv_estimator=remax cannot be combined with algorithm.dynamic_sampling")
    if algo.dynamic_sampling and cfg.rollout.n < 2:
        raise ConfigError(
            "algorithm.dynamic_sampling needs rollout.n >= 2 (it filters groups by reward variance)"
        )
    for key, value in (("gamma", algo.gamma), ("lam", algo.lam)):
        if value != 1.0 and key not in params:
            raise ConfigError(f"algorithm.{key}={value} is set, but adv_estimator={name} does not use it")
    if not algo.norm_adv_by_std_in_grpo and "norm_by_std" not in params:
        raise ConfigError(
            f"algorithm.norm_adv_by_std_in_grpo=false is set, but adv_estimator={name} does not use it"
        )
    if algo.use_kl_in_reward and cfg.actor.use_kl_loss:
        raise ConfigError(
            "KL is either in the reward (algorithm.use_kl_in_reward) or in the loss (actor.use_kl_loss), not both"
        )
    if algo.use_kl_in_reward:
        get_kl_estimator(algo.kl_penalty)
        if algo.kl_ctrl_type not in ("fixed", "adaptive"):
            raise ConfigError(f"algorithm.kl_ctrl_type must be fixed or adaptive, got '{algo.kl_ctrl_type}'")
    if algo.gdpo_reward_keys and "reward_components" not in params:
        raise ConfigError(
            f"algorithm.gdpo_reward_keys is set, but adv_estimator={name} does not use it (gdpo does)"
        )
    if algo.gdpo_reward_keys:  # gdpo's advantage is built from the components, not the token-level reward
        unused = [
            (cfg.reward.overlong_buffer_len > 0, f"reward.overlong_buffer_len={cfg.reward.overlong_buffer_len}"),
            (algo.use_kl_in_reward, "algorithm.use_kl_in_reward=true"),
            (algo.dynamic_sampling, "algorithm.dynamic_sampling=true (it filters on the score, not the components)"),
            (cfg.agent.enable, "agent.enable=true (episodes keep the score only, not the components)"),
            (not cfg.reward.custom_function_path, "no reward.custom_function_path (the built-in scorers "
             "return one score, no components)"),
        ]  # fmt: skip
        named = [why for used, why in unused if used]
        if named:
            raise ConfigError(
                f"algorithm.gdpo_reward_keys (gdpo's advantage from the reward function's components) with "
                f"{'; '.join(named)}: not supported, it would be ignored or fail at the first step"
            )
    if algo.gdpo_reward_weights and len(algo.gdpo_reward_weights) != len(algo.gdpo_reward_keys):
        raise ConfigError(
            f"algorithm.gdpo_reward_weights has {len(algo.gdpo_reward_weights)} values for "
            f"{len(algo.gdpo_reward_keys)} algorithm.gdpo_reward_keys; give one weight per key (or none)"
        )
    if algo.max_gen_rounds < 1:
        raise ConfigError(f"algorithm.max_gen_rounds must be >= 1, got {algo.max_gen_rounds}")
    if cfg.reward.overlong_buffer_len >= cfg.data.max_response_length:
        raise ConfigError(
            f"reward.overlong_buffer_len={cfg.reward.overlong_buffer_len} must be smaller than "
            f"data.max_response_length={cfg.data.max_response_length}"
        )
    if cfg.reward.overlong_buffer_len < 0:
        raise ConfigError("reward.overlong_buffer_len must be >= 0 (0 = off)")
