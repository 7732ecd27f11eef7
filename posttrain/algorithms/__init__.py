"""Pure tensor functions of RL post-training: advantages, policy losses, KL estimators, loss aggregation.

Importing the package registers every built-in estimator and loss, so `get_policy_loss("vanilla")` works
whichever submodule was imported first. Must not import engine, rollout, workers, Ray or data.batch.
"""

from posttrain.algorithms.advantages import AdvantageEstimator, compute_grpo_advantages
from posttrain.algorithms.aggregation import LOSS_AGG_MODES, aggregate_loss, global_totals, masked_mean
from posttrain.algorithms.kl import kl_penalty
from posttrain.algorithms.policy_loss import kl_loss, ppo_clip_loss
from posttrain.algorithms.registry import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    POLICY_LOSSES,
    Registry,
    get_advantage_estimator,
    get_kl_estimator,
    get_policy_loss,
    register_advantage,
    register_kl,
    register_policy_loss,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdvantageEstimator",
    "Registry",
    "aggregate_loss",
    "compute_grpo_advantages",
    "get_advantage_estimator",
    "get_kl_estimator",
    "get_policy_loss",
    "global_totals",
    "kl_loss",
    "kl_penalty",
    "masked_mean",
    "ppo_clip_loss",
    "register_advantage",
    "register_kl",
    "register_policy_loss",
]
