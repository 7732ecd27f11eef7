"""Pure tensor functions of RL post-training: advantages, policy losses, KL estimators and controllers, loss
aggregation, reward shaping.

Importing the package registers every built-in estimator and loss (including those of the
`advantages_outcome`, `advantages_token_baseline`, `policy_loss_variants`, `policy_loss_dppo` and
`policy_loss_cov` siblings), so `get_policy_loss("gspo")` works whichever submodule was imported first.
Must not import engine, rollout, workers, Ray or data.batch.
"""

from posttrain.algorithms import (
    advantages_outcome,  # noqa: F401  (registers rloo, remax, opo, gdpo, ...)
    advantages_token_baseline,  # noqa: F401  (registers optimal_token_baseline, ...)
)
from posttrain.algorithms.advantages import AdvantageEstimator, compute_grpo_advantages
from posttrain.algorithms.aggregation import LOSS_AGG_MODES, aggregate_loss, global_totals, masked_mean
from posttrain.algorithms.kl import kl_penalty
from posttrain.algorithms.kl_control import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    make_kl_controller,
)
from posttrain.algorithms.policy_loss import kl_loss, ppo_clip_loss
from posttrain.algorithms.policy_loss_cov import clip_cov_loss, kl_cov_loss
from posttrain.algorithms.policy_loss_dppo import dppo_kl_loss, dppo_tv_loss
from posttrain.algorithms.policy_loss_variants import (
    cispo_loss,
    dro_loss,
    geo_mean_loss,
    gpg_loss,
    gspo_loss,
    sapo_loss,
)
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
from posttrain.algorithms.reward_shaping import groups_with_reward_variance, overlong_penalty
from posttrain.algorithms.rollout_correction import RolloutCorrection

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "apply_kl_penalty",
    "cispo_loss",
    "clip_cov_loss",
    "dppo_kl_loss",
    "dppo_tv_loss",
    "dro_loss",
    "geo_mean_loss",
    "gpg_loss",
    "groups_with_reward_variance",
    "gspo_loss",
    "kl_cov_loss",
    "make_kl_controller",
    "overlong_penalty",
    "sapo_loss",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "AdvantageEstimator",
    "Registry",
    "RolloutCorrection",
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
