"""Rewards: built-in rule-based scorers by data_source, user reward functions, and the reward manager.

Importing the package registers the built-in scorers (arithmetic, gsm8k, shapes). Must not import engine,
rollout, workers, Ray or data.batch; the only I/O is `load_reward_function` importing a user file and
`IsolatedFunction` running one in a child process (with a per-call timeout). `RewardHealth` is the policy
that stops a run whose scores keep failing.
"""

from posttrain.rewards import arithmetic, gsm8k, shapes  # noqa: F401  (registers the built-in scorers)
from posttrain.rewards.health import RewardHealth, StepFailures
from posttrain.rewards.isolation import CallFailure, IsolatedFunction
from posttrain.rewards.manager import RewardManager, RewardResult, scores_to_token_level
from posttrain.rewards.registry import SCORERS, default_compute_score, get_scorer, register_scorer
from posttrain.rewards.user import load_reward_function

__all__ = [
    "SCORERS",
    "CallFailure",
    "IsolatedFunction",
    "RewardHealth",
    "RewardManager",
    "RewardResult",
    "StepFailures",
    "default_compute_score",
    "get_scorer",
    "load_reward_function",
    "register_scorer",
    "scores_to_token_level",
]
