"""Start-up for the driver loops: engine and worker specs from the config, and the algorithm's options
(estimator and loss keyword arguments, rollout correction, optimizer steps per step, sampling parameters).
The checks that fail fast are in trainers/checks.py."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch

from posttrain.algorithms.policy_loss import own_options
from posttrain.algorithms.registry import get_policy_loss
from posttrain.algorithms.rollout_correction import RolloutCorrection
from posttrain.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    LoraConfig,
    ModelConfig,
    RLConfig,
)
from posttrain.controller.placement import split_reference, uses_reference
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.engine.engine_config import EngineConfig
from posttrain.errors import ConfigError
from posttrain.rollout.base import SamplingParams
from posttrain.workers.actor_rollout_ref import ActorRolloutRefSpec
from posttrain.workers.critic import CriticSpec
from posttrain.workers.reference import ReferenceSpec


def engine_config(model: ModelConfig, path: str = "", **fields: Any) -> EngineConfig:
    """An engine config from the `model` section (path, precision, packing, memory levers, LoRA) + `fields`."""
    model_fields = {
        "model_path": path or model.path,
        "dtype": model.dtype,
        "compute_dtype": model.compute_dtype,
        "attn_implementation": model.attn_implementation,
        "remove_padding": model.remove_padding,
        "pack_row_tokens": model.pack_row_tokens,
        "share_prompt": model.share_prompt,
        "gradient_checkpointing": model.gradient_checkpointing,
        "offload": model.offload,
        "lora": model.lora,
        "sequence_parallel_size": model.sequence_parallel_size,
        "router_aux_loss_coef": model.router_aux_loss_coef,
        "vision_tower": model.vision_tower,
    }
    return EngineConfig(**{**model_fields, **fields})


# options of particular policy losses that live in ActorConfig; one left unset (None) means the chosen
# loss's own documented default, one that is set is passed only to a loss that takes it
LOSS_OPTION_FIELDS = (
    "clip_ratio_low",
    "clip_ratio_high",
    "clip_ratio_c",
    "loss_beta",
    "clip_cov_ratio",
    "clip_cov_lb",
    "clip_cov_ub",
    "kl_cov_ratio",
    "ppo_kl_coef",
    "tau_pos",
    "tau_neg",
)
# config name -> the loss function's parameter name, where they differ
LOSS_OPTION_ALIASES = {"loss_beta": "beta"}


def rollout_correction(algo: AlgorithmConfig, policy_loss: str) -> RolloutCorrection:
    """`algorithm.rollout_correction`, validated (ConfigError naming the key and the allowed values)."""
    rc = algo.rollout_correction
    correction = RolloutCorrection(
        rollout_is=rc.rollout_is,
        rollout_is_threshold=rc.rollout_is_threshold,
        rollout_rs=rc.rollout_rs or None,  # an empty string is "off", as null
        rollout_rs_threshold=rc.rollout_rs_threshold or None,
        bypass_mode=rc.bypass_mode,
        loss_type=rc.loss_type,
    )
    if correction.loss_type == "reinforce" and policy_loss != "gpg":
        raise ConfigError(
            "algorithm.rollout_correction.loss_type=reinforce weighs the REINFORCE loss -A * log pi: set "
            f"actor.policy_loss=gpg (got {policy_loss}; a ratio loss with IS weights counts the correction twice)"
        )
    return correction


def policy_loss_options(actor: ActorConfig, algo: AlgorithmConfig) -> dict[str, Any]:
    """The `ppo` LossSpec options. Only the loss options the user set are passed, so an unset one is the
    chosen loss's own default (in its signature); a set one the chosen loss does not take is an error
    naming the key and the loss (never silently ignored). The rollout correction (from `algo`) and
    `loss_scale_factor` travel as plain values."""
    accepted = own_options(get_policy_loss(actor.policy_loss))
    correction = rollout_correction(algo, actor.policy_loss)
    options: dict[str, Any] = {
        "policy_loss": actor.policy_loss,
        "loss_agg_mode": actor.loss_agg_mode,
        "use_kl_loss": actor.use_kl_loss,
        "kl_loss_coef": actor.kl_loss_coef,
        "kl_loss_type": actor.kl_loss_type,
        "entropy_coeff": actor.entropy_coeff,
    }
    if correction.enabled:
        options["rollout_correction"] = dataclasses.asdict(correction)
    if actor.loss_scale_factor is not None:
        if actor.loss_agg_mode != "seq-mean-token-sum-norm":
            raise ConfigError(
                f"actor.loss_scale_factor={actor.loss_scale_factor} is set, but actor.loss_agg_mode="
                f"{actor.loss_agg_mode} does not use it (only seq-mean-token-sum-norm does)"
            )
        if not actor.loss_scale_factor > 0:
            raise ConfigError(f"actor.loss_scale_factor must be > 0, got {actor.loss_scale_factor}")
        options["loss_scale_factor"] = actor.loss_scale_factor
    for name in LOSS_OPTION_FIELDS:
        value = getattr(actor, name)
        if value is None:
            continue
        param = LOSS_OPTION_ALIASES.get(name, name)
        if param not in accepted:
            takes = [f"actor.{f}" for f in LOSS_OPTION_FIELDS if LOSS_OPTION_ALIASES.get(f, f) in accepted]
            raise ConfigError(
                f"actor.{name}={value} is set, but actor.policy_loss={actor.policy_loss} does not use it "
                f"(it takes: {', '.join(takes) or 'none of the loss options'})"
            )
        options[param] = value
    return options


def advantage_kwargs(estimator: Callable[..., Any], algo: AlgorithmConfig, batch: Batch) -> dict[str, Any]:
    """Exactly the keyword arguments `estimator` declares, from the config and the batch."""
    pool: dict[str, Any] = {"gamma": algo.gamma, "lam": algo.lam, "norm_by_std": algo.norm_adv_by_std_in_grpo}
    if keys.VALUES in batch:
        pool["values"] = batch[keys.VALUES]
    if keys.REWARD_BASELINES in batch:
        pool["reward_baselines"] = batch[keys.REWARD_BASELINES]
    if algo.gdpo_reward_keys:
        pool["reward_components"] = reward_components(batch, algo.gdpo_reward_keys)
        pool["reward_weights"] = algo.gdpo_reward_weights or None
    params = inspect.signature(estimator).parameters
    return {name: value for name, value in pool.items() if name in params}


def reward_components(batch: Batch, names: Sequence[str]) -> torch.Tensor:
    """(B, K) reward components: the columns `names` that the reward function returned besides "score".

    A row without the value (its score failed, and counts 0.0 as the score does) gets 0.0; a name that no
    row has is a ConfigError (the reward function does not return it).
    """
    columns = []
    for name in names:
        values = list(batch[name]) if name in batch else []
        if all(v is None for v in values):
            raise ConfigError(
                f"algorithm.gdpo_reward_keys: '{name}' is not a value of the reward function's results; it must "
                f"return a dict with 'score' and '{name}'"
            )
        columns.append(torch.tensor([0.0 if v is None else float(v) for v in values], dtype=torch.float32))
    return torch.stack(columns, dim=-1)


def optimizer_steps_per_step(cfg: RLConfig) -> int:
    """Actor optimizer steps per RL step: ppo_epochs x mini-batches."""
    samples = cfg.data.train_batch_prompts * cfg.rollout.n
    return cfg.actor.ppo_epochs * (samples // (cfg.actor.mini_batch_size or samples))


def critic_optimizer_steps_per_step(cfg: RLConfig) -> int:
    """Critic optimizer steps per RL step: its ppo_epochs x its mini-batches."""
    samples = cfg.data.train_batch_prompts * cfg.rollout.n
    return cfg.critic.ppo_epochs * (samples // (cfg.critic.mini_batch_size or samples))


def reuses_update_log_probs(cfg: RLConfig) -> bool:
    """Whether the separate old-log-prob pass can be skipped: with one optimizer step per batch the policy
    has not changed when the update computes its log-probs, so they are the old ones (same weights, same
    tokens); in rollout correction's bypass mode the rollout log-probs are the old ones, whatever the
    number of steps. KL in the reward needs them before the update, so it keeps the pass.

    Asynchronous RL too: the old (proximal) policy of the ratio is the trainer's weights when the batch is
    trained, not the older weights that sampled it (decoupled PPO, Hilton et al. 2021), so with one step per
    batch a recomputation would give the update's own log-probs again. The sampler's weights enter as the
    behaviour policy through the rollout log-probs, which `algorithm.rollout_correction` corrects against;
    the loss reports the gap (`rollout/logprob_diff_*`) from the same forward."""
    samples = cfg.data.train_batch_prompts * cfg.rollout.n
    one_step = cfg.actor.ppo_epochs == 1 and cfg.actor.mini_batch_size in (0, samples)
    bypass = cfg.algorithm.rollout_correction.bypass_mode
    skip = bypass or (cfg.actor.reuse_log_probs_on_policy and one_step)
    return skip and not cfg.algorithm.use_kl_in_reward


def sampling_params(cfg: RLConfig) -> tuple[SamplingParams, SamplingParams]:
    """Training's sampling (`rollout.*`, validated) and validation's: `rollout.val_temperature`, untruncated
    (no top-p, top-k or min-p; the stop strings stay, as they end a response)."""
    sampling = SamplingParams(
        max_tokens=cfg.data.max_response_length,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        top_k=cfg.rollout.top_k,
        min_p=cfg.rollout.min_p,
        stop=cfg.rollout.stop,
    )
    sampling.validate()
    return sampling, dataclasses.replace(
        sampling, temperature=cfg.rollout.val_temperature, top_p=1.0, top_k=0, min_p=0.0
    )


def actor_spec(cfg: RLConfig, threads: int) -> ActorRolloutRefSpec:
    """The actor's worker: its engine (model levers, `actor.optim`, micro-batching), the colocated rollout
    engine unless the rollout has a pool of its own, and the reference when KL is used."""
    return ActorRolloutRefSpec(
        engine=engine_config(
            cfg.model,
            optim=cfg.actor.optim,
            # the actor does not train in the critic's warm-up steps: its schedule spans the steps it trains
            total_steps=max(1, cfg.trainer.total_steps - cfg.algorithm.critic_warmup)
            * optimizer_steps_per_step(cfg),
            micro_batch_size=cfg.actor.micro_batch_size,
            max_token_len=cfg.actor.max_token_len_per_worker,
            config_section="actor",
        ),
        with_rollout=cfg.resources.rollout == "trainer",
        with_ref=uses_reference(cfg) and not split_reference(cfg),
        teacher=teacher_engine(cfg),
        rollout_name=cfg.rollout.name,
        rollout_vllm=cfg.rollout.vllm,
        rollout_max_batch_size=cfg.rollout.max_batch_size,
        seed=cfg.trainer.seed,
        threads=threads,
        record_routing=cfg.actor.router_replay.mode == "R3",
    )


def reference_spec(cfg: RLConfig, threads: int) -> ReferenceSpec | None:
    """The reference's own workers when `resources.ref` names a pool (None: it is on the actor's workers, or
    unused): the model section's base model, frozen, never LoRA (a LoRA actor's reference is its base model),
    forward passes micro-batched as the actor's."""
    if not split_reference(cfg):
        return None
    engine = engine_config(
        cfg.model,
        lora=LoraConfig(),
        trainable=False,
        micro_batch_size=cfg.actor.micro_batch_size,
        max_token_len=cfg.actor.max_token_len_per_worker,
    )
    return ReferenceSpec(engine=engine, seed=cfg.trainer.seed, threads=threads)


def teacher_engine(cfg: RLConfig) -> EngineConfig | None:
    """The distillation teacher's frozen engine on the actor's workers (`distill.teacher_path`): the model
    section's precision, attention and packing, never LoRA; None without a teacher."""
    if not cfg.distill.teacher_path:
        return None
    return engine_config(
        cfg.model,
        path=cfg.distill.teacher_path,
        lora=LoraConfig(),
        trainable=False,
        micro_batch_size=cfg.distill.micro_batch_size,
        max_token_len=0,
    )


def critic_spec(cfg: RLConfig, threads: int) -> CriticSpec:
    """The critic's engine: the model section's levers, the critic's own optimizer (never LoRA)."""
    c = cfg.critic
    engine = engine_config(
        cfg.model,
        path=c.model_path,
        lora=LoraConfig(),  # the critic trains fully: a new value head on adapters alone learns little
        head="value",
        optim=c.optim,
        total_steps=cfg.trainer.total_steps * critic_optimizer_steps_per_step(cfg),
        micro_batch_size=c.micro_batch_size,
        max_token_len=c.max_token_len_per_worker,
        config_section="critic",
    )
    return CriticSpec(engine=engine, seed=cfg.trainer.seed, threads=threads)
