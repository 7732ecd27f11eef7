"""Driver-side reward stage: scores from the reward manager, DAPO overlong shaping, KL in the reward.

`score` turns decoded responses into `token_level_scores`; `apply_kl` turns scores into
`token_level_rewards` (minus coef * KL to the reference when `algorithm.use_kl_in_reward`).
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.algorithms.kl_control import apply_kl_penalty, make_kl_controller
from posttrain.algorithms.reward_shaping import overlong_penalty
from posttrain.config.schema import RLConfig
from posttrain.data import keys
from posttrain.data.batch import Batch
from posttrain.rewards.manager import RewardManager, RewardResult, scores_to_token_level
from posttrain.rewards.user import load_reward_function


class RewardStage:
    def __init__(self, cfg: RLConfig) -> None:
        self.cfg = cfg
        custom = (
            load_reward_function(cfg.reward.custom_function_path, cfg.reward.custom_function_name)
            if cfg.reward.custom_function_path
            else None
        )
        scorer_kwargs = {"openai/gsm8k": {"method": cfg.reward.gsm8k_method}} if custom is None else None
        self.manager = RewardManager(custom, scorer_kwargs)
        algo = cfg.algorithm
        self.kl_controller = (
            make_kl_controller(algo.kl_ctrl_type, algo.kl_coef, algo.kl_target, algo.kl_horizon)
            if algo.use_kl_in_reward
            else None
        )

    def score_texts(self, batch: Batch) -> RewardResult:
        return self.manager.score(
            list(batch[keys.DATA_SOURCE]),
            list(batch[keys.RESPONSE_TEXT]),
            list(batch[keys.GROUND_TRUTH]),
            list(batch[keys.EXTRA_INFO]),
        )

    def score(self, batch: Batch) -> Batch:
        """`token_level_scores` (with overlong shaping), raw `score` per row, and the error count in meta."""
        result = self.score_texts(batch)
        scores = torch.tensor(result.scores, dtype=torch.float32)
        shaped = scores
        if self.cfg.reward.overlong_buffer_len > 0:
            lengths = batch[keys.RESPONSE_MASK].sum(-1)
            shaped = scores + overlong_penalty(
                lengths,
                self.cfg.data.max_response_length,
                self.cfg.reward.overlong_buffer_len,
                self.cfg.reward.overlong_penalty_factor,
            )
        return Batch.from_dict(
            {keys.TOKEN_LEVEL_SCORES: scores_to_token_level(shaped, batch[keys.RESPONSE_MASK])},
            {"score": list(result.scores)},
            {"reward_errors": result.n_errors},
        )

    def apply_kl(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        """`token_level_rewards`: the scores, minus the KL penalty when KL is in the reward."""
        scores = batch[keys.TOKEN_LEVEL_SCORES]
        if self.kl_controller is None:
            return Batch.from_dict({keys.TOKEN_LEVEL_REWARDS: scores}), {}
        rewards, metrics = apply_kl_penalty(
            scores,
            batch[keys.OLD_LOG_PROBS],
            batch[keys.REF_LOG_PROB],
            batch[keys.RESPONSE_MASK],
            self.kl_controller.value,
            self.cfg.algorithm.kl_penalty,
        )
        # the controller's target is calibrated, as in verl, on the per-token mean KL
        self.kl_controller.update(metrics["kl_in_reward_token_mean"], n_steps=len(batch))
        return Batch.from_dict({keys.TOKEN_LEVEL_REWARDS: rewards}), {
            f"algorithm/{k}": v for k, v in metrics.items()
        }

    def state_dict(self) -> dict[str, Any]:
        return {"kl_controller": self.kl_controller.state_dict() if self.kl_controller is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.kl_controller is not None and state.get("kl_controller") is not None:
            self.kl_controller.load_state_dict(state["kl_controller"])
