"""Which settings of a run would take no effect: keys set while the switch that uses them is off.

Each finding is the changed keys (`key=value`, see config.unused) and the switch that is off. The commands'
start-up checks refuse the first one (`check_settings_in_effect`, `check_shared_settings_in_effect`); the
verl converter uses the same list to leave out what verl would ignore as well, so that a converted command
line is never refused for a verl default carried over (verl's `kl_loss_type` while `use_kl_loss` is false).
"""

from __future__ import annotations

from typing import Any

from posttrain.config.schema import ModelConfig, RayConfig, RLConfig
from posttrain.config.unused import changed_keys, refuse_changed
from posttrain.errors import ConfigError
from posttrain.models import is_vision_language

Finding = tuple[list[str], str]  # the changed keys, and why they would be ignored

KL_IN_REWARD = ("kl_penalty", "kl_ctrl_type", "kl_coef", "kl_target", "kl_horizon")


def unused_rl_settings(cfg: RLConfig) -> list[Finding]:
    """The settings of an RL run that nothing would read, grouped by the switch that is off."""
    found: list[Finding] = []

    def off(section: Any, key: str, because: str, **which: Any) -> None:
        changed = changed_keys(section, key, **which)
        if changed:
            found.append((changed, because))

    algo, actor, a = cfg.algorithm, cfg.actor, cfg.async_rl
    if not algo.use_kl_in_reward:
        off(
            algo,
            "algorithm",
            "algorithm.use_kl_in_reward=false (the KL in the loss is actor.kl_loss_coef and actor.kl_loss_type)",
            fields=KL_IN_REWARD,
        )
    elif algo.kl_ctrl_type == "fixed":
        off(
            algo,
            "algorithm",
            "algorithm.kl_ctrl_type=fixed (they steer the adaptive one)",
            fields=KL_IN_REWARD[3:],
        )
    if not actor.use_kl_loss:
        off(actor, "actor", "actor.use_kl_loss=false", fields=("kl_loss_coef", "kl_loss_type"))
    if not cfg.critic.enable:
        off(cfg.critic, "critic", "critic.enable=false", besides=("enable",))
        off(
            algo,
            "algorithm",
            "critic.enable=false (its warm-up steps would train nothing)",
            fields=("critic_warmup",),
        )
    correction = algo.rollout_correction
    if correction.rollout_is is None:
        off(
            correction, "algorithm.rollout_correction", "rollout_is is null", fields=("rollout_is_threshold",)
        )
    if correction.rollout_rs is None:
        off(
            correction, "algorithm.rollout_correction", "rollout_rs is null", fields=("rollout_rs_threshold",)
        )
    if not cfg.agent.enable:
        off(cfg.agent, "agent", "agent.enable=false", besides=("enable",))
    if a.staleness == 0:
        off(a, "async_rl", "async_rl.staleness=0 (the synchronous loop)", besides=("staleness",))
    elif not a.partial_rollout:
        off(a, "async_rl", "async_rl.partial_rollout=false", fields=("partial_chunk_tokens",))
    reward = cfg.reward
    if reward.custom_function_path:
        off(
            reward,
            "reward",
            "reward.custom_function_path replaces the built-in scorers",
            fields=("gsm8k_method",),
        )
    else:
        off(
            reward,
            "reward",
            "reward.custom_function_path is empty",
            fields=("custom_function_name", "timeout_s"),
        )
    if reward.overlong_buffer_len == 0:
        off(
            reward,
            "reward",
            "reward.overlong_buffer_len=0 (no overlong shaping)",
            fields=("overlong_penalty_factor",),
        )
    if cfg.trainer.max_restarts == 0:
        off(cfg.trainer, "trainer", "trainer.max_restarts=0 (no restarts)", fields=("restart_wait_s",))
    if not algo.dynamic_sampling:
        off(algo, "algorithm", "algorithm.dynamic_sampling=false", fields=("max_gen_rounds",))
    if correction.bypass_mode:
        off(
            actor,
            "actor",
            "algorithm.rollout_correction.bypass_mode=true (the rollout's log-probs are the old ones: no pass)",
            fields=("reuse_log_probs_on_policy",),
        )
    if cfg.rollout.name != "vllm":
        off(
            cfg.rollout.vllm,
            "rollout.vllm",
            f"rollout.name={cfg.rollout.name} (they configure rollout.name=vllm)",
        )
    if not (cfg.trainer.val_every or cfg.trainer.val_before_train):
        off(cfg.rollout, "rollout", "no validation (trainer.val_every=0, val_before_train=false)",
            fields=("val_temperature",))  # fmt: skip
    found += unused_shared_settings(cfg.model, cfg.ray, cfg.trainer, default_trainer=type(cfg.trainer)())
    return found


def unused_shared_settings(
    model: ModelConfig, ray: RayConfig, trainer: Any, default_trainer: Any
) -> list[Finding]:
    """Sections every command has: LoRA's options without adapters, packing's without packing, Ray's settings
    without Ray."""
    found: list[Finding] = []
    lora = model.lora
    if not model.remove_padding:
        changed = changed_keys(model, "model", fields=("pack_row_tokens",))
        if changed:
            found.append((changed, "model.remove_padding=false (rows are padded, not packed)"))
    if lora.rank == 0:
        changed = changed_keys(lora, "model.lora", besides=("rank",))
        if changed:
            found.append((changed, "model.lora.rank=0 (full fine-tuning, no adapters)"))
    if trainer.backend == "local":
        changed = changed_keys(ray, "ray") + changed_keys(
            trainer, "trainer", fields=("cpus_per_worker", "gpus_per_worker"), default=default_trainer
        )
        if changed:
            found.append(
                (changed, "trainer.backend=local (one in-process worker, no Ray): set trainer.backend=ray")
            )
    elif ray.address:
        changed = changed_keys(ray, "ray", fields=("num_cpus", "tmpdir"))
        if changed:
            found.append(
                (changed, "ray.address is set (they configure the local Ray instance posttrain starts)")
            )
    return found


def check_settings_in_effect(cfg: RLConfig) -> None:
    """Refuse the first group of `unused_rl_settings`, naming its keys and the switch."""
    for changed, because in unused_rl_settings(cfg):
        refuse_changed(changed, because)
    check_device_and_model(cfg.model, cfg.trainer)


def check_shared_settings_in_effect(
    model: ModelConfig, ray: RayConfig, trainer: Any, default_trainer: Any
) -> None:
    """The offline commands' (sft, dpo, rm, distill) share of the checks above."""
    for changed, because in unused_shared_settings(model, ray, trainer, default_trainer):
        refuse_changed(changed, because)
    check_device_and_model(model, trainer)


def check_device_and_model(model: ModelConfig, trainer: Any) -> None:
    """A CUDA run on Ray with no GPU per worker would run on CPU; a vision-tower setting on a text model."""
    if trainer.backend == "ray" and trainer.device == "cuda" and trainer.gpus_per_worker == 0:
        raise ConfigError(
            "trainer.device=cuda with trainer.gpus_per_worker=0: Ray would give the workers no GPU and they "
            "would run on CPU; give each worker a GPU share (e.g. trainer.gpus_per_worker=1) or set "
            "trainer.device=cpu"
        )
    gpus = trainer.gpus_per_worker
    if (
        trainer.backend == "ray"
        and trainer.device != "cpu"
        and 0 < gpus < 1
        and trainer.n_workers_per_node > 1
    ):
        raise ConfigError(
            f"trainer.gpus_per_worker={gpus:g} with trainer.n_workers_per_node={trainer.n_workers_per_node}: "
            "Ray packs fractional GPU shares onto one GPU, so ranks of one process group would share a device "
            "(NCCL refuses that); give each worker a whole GPU (trainer.gpus_per_worker=1), or one worker per node"
        )
    if model.vision_tower != "auto" and model.path and not is_vision_language(model.path):
        raise ConfigError(
            f"model.vision_tower={model.vision_tower} is set, but model.path={model.path} is a text-only model "
            "(no vision tower): it would be ignored"
        )


def check_offline_settings_in_effect(cfg: Any, command: str) -> None:
    """sft, dpo, rm and distill: the shared checks above, validation without held-out rows, and the keys of
    the shared sections that these commands do not read."""
    default = type(cfg)()
    check_shared_settings_in_effect(cfg.model, cfg.ray, cfg.trainer, default.trainer)
    trainer = cfg.trainer
    if trainer.val_every and not cfg.data.val_files:
        raise ConfigError(
            f"trainer.val_every={trainer.val_every} is set, but data.val_files is empty: {command} would never "
            "validate (give held-out rows in data.val_files, or leave trainer.val_every 0)"
        )
    if command == "sft" and trainer.stop_at_val_nll and not (cfg.data.val_files and trainer.val_every):
        raise ConfigError(
            f"trainer.stop_at_val_nll={trainer.stop_at_val_nll} needs validations during the run: set "
            "data.val_files and trainer.val_every > 0 (without them it could only be checked after the last step)"
        )
    if command in ("sft", "distill"):
        refuse_changed(
            changed_keys(cfg.data, "data", fields=("train_batch_prompts",), default=default.data),
            f"{command} batches by optim.batch_size (samples per optimizer step); data.train_batch_prompts is "
            "posttrain train's",
        )
