"""On-policy distillation in the RL loop (`distill.*`): a frozen teacher scores the student's own samples.

The teacher is a third model on the actor's workers, run like the reference (`actor.forward(model="teacher")`
gives `teacher_log_prob` of the sampled tokens). Per response token, reverse_kl_t = log p_student(x_t) -
log p_teacher(x_t) (the student's log-probs: the trainer's old ones when computed, else the sampler's), and
the advantage becomes task_reward_coef * A_task - kl_coef * reverse_kl_t (algorithms/distillation.py).
`distill/kl_to_teacher` is the per-token mean of reverse_kl over the step's response tokens.
"""

from __future__ import annotations

import dataclasses
import math

from posttrain.algorithms.distillation import reverse_kl_advantages
from posttrain.config.schema import OnPolicyDistillConfig, RLConfig
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.errors import ConfigError
from posttrain.models import check_model_dir
from posttrain.models.shared_tokenizer import check_same_tokenizer


def check_distill_rl_config(cfg: RLConfig) -> None:
    """`distill.*` settings that cannot work, or would be ignored, are refused naming the key."""
    d = cfg.distill
    if not d.teacher_path:
        unused = [
            f"distill.{f.name}={getattr(d, f.name)!r}"
            for f in dataclasses.fields(d)
            if getattr(d, f.name) != getattr(OnPolicyDistillConfig(), f.name)
        ]
        if unused:
            raise ConfigError(f"{', '.join(unused)} set but distill.teacher_path is empty (no teacher)")
        return
    check_model_dir(d.teacher_path)
    check_same_tokenizer(cfg.model.path, d.teacher_path, key="teacher (distill.teacher_path)")
    for key, value in (("kl_coef", d.kl_coef), ("task_reward_coef", d.task_reward_coef)):
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"distill.{key} must be a finite number >= 0, got {value}")
    if d.kl_coef == 0 and d.task_reward_coef == 0:
        raise ConfigError("distill.kl_coef and distill.task_reward_coef are both 0: nothing to learn from")
    if d.micro_batch_size <= 0:
        raise ConfigError(f"distill.micro_batch_size must be > 0, got {d.micro_batch_size}")
    if cfg.agent.enable:
        raise ConfigError("distill.teacher_path with agent.enable: agent episodes are not distilled yet")
    if cfg.async_rl.staleness:  # the reverse KL must be the current student's, not a k-versions-old sampler's
        raise ConfigError(
            "distill.teacher_path with async_rl.staleness >= 1: the distillation advantage would use the "
            "sampler's log-probs, up to async_rl.staleness versions old, as the student's"
        )
    if d.task_reward_coef == 0:  # the task advantage is multiplied by 0: what only shapes it does nothing
        a, r = cfg.algorithm, cfg.reward
        ignored = [
            (a.use_kl_in_reward, "algorithm.use_kl_in_reward=true (a KL penalty in the task reward)"),
            (r.overlong_buffer_len > 0, f"reward.overlong_buffer_len={r.overlong_buffer_len}"),
            (a.dynamic_sampling, "algorithm.dynamic_sampling=true (filters groups on the task reward)"),
            (cfg.critic.enable, "critic.enable=true (a value model of the task reward)"),
            (
                a.adv_estimator == "remax",
                "algorithm.adv_estimator=remax (a greedy baseline of the task reward)",
            ),
            (bool(r.model.path), f"reward.model.path={r.model.path}"),
        ]
        named = [why for used, why in ignored if used]
        if named:
            raise ConfigError(
                f"{'; '.join(named)}: with distill.task_reward_coef=0 the task advantage is not used, so "
                "this would be computed and ignored; set distill.task_reward_coef > 0, or unset it"
            )


def distill_advantages(
    batch: Batch, task: Batch, config: OnPolicyDistillConfig
) -> tuple[Batch, dict[str, float]]:
    """`task` (the estimator's advantages and returns) with advantages = task_reward_coef * the task
    advantages - kl_coef * reverse_kl (`batch` holds the log-probs), and the step's metrics."""
    student = batch[keys.OLD_LOG_PROBS] if keys.OLD_LOG_PROBS in batch else batch[keys.ROLLOUT_LOG_PROBS]
    mask = batch[keys.RESPONSE_MASK]
    kl_advantages, reverse_kl = reverse_kl_advantages(
        student.float(), batch[keys.TEACHER_LOG_PROB].float(), mask, config.kl_coef
    )
    advantages = config.task_reward_coef * task[keys.ADVANTAGES] + kl_advantages
    tokens = mask.sum().clamp(min=1.0)
    metrics = {
        "distill/kl_to_teacher": float(reverse_kl.sum() / tokens),
        "distill/teacher_log_prob": float((batch[keys.TEACHER_LOG_PROB] * mask).sum() / tokens),
    }
    return Batch.from_dict({keys.ADVANTAGES: advantages, keys.RETURNS: task[keys.RETURNS]}), metrics
