"""Combining the scores of several reward models into one reward per response (a reward-model ensemble).

A policy optimised against one learned reward model climbs that model's errors as well as its signal (reward
over-optimisation, Gao et al. 2023, "Scaling laws for reward model overoptimization"). Coste et al. (2024,
"Reward model ensembles help mitigate overoptimization", ICLR) score each response with several reward models
and optimise a conservative combination of their scores; errors the models do not share cancel out or are
penalised. With r_m the score of model m (m = 1..M) for one response:

    mean:  r = (1/M) sum_m r_m
    min:   r = min_m r_m                                        (worst-case optimisation, WCO)
    uwo:   r = (1/M) sum_m r_m - lambda * (1/M) sum_m (r_m - mean)^2
                                                                (uncertainty-weighted optimisation, UWO)

The variance is the population variance over the M models. The scores are combined as they are: the models
should be trained alike (posttrain rm's reward centering keeps them near zero), since a model on a larger
scale would dominate the mean and the variance. Pure tensor functions; must not import engine, rollout,
workers, Ray or data.batch.
"""

from __future__ import annotations

import math

import torch

from posttrain.errors import ConfigError

COMBINE_MODES = ("mean", "min", "uwo")


def combine_ensemble_scores(scores: torch.Tensor, combine: str, uwo_coef: float = 0.0) -> torch.Tensor:
    """(B,) combined rewards from `scores` (M, B): M reward models' scores of the same B responses."""
    if scores.dim() != 2 or scores.shape[0] < 1:
        raise ValueError(f"ensemble scores must be (models, responses), got shape {tuple(scores.shape)}")
    if combine == "mean":
        return scores.mean(dim=0)
    if combine == "min":
        return scores.min(dim=0).values
    if combine == "uwo":
        if not (math.isfinite(uwo_coef) and uwo_coef > 0):
            raise ConfigError(
                f"combine 'uwo' needs uwo_coef > 0 (the weight of the variance), got {uwo_coef}"
            )
        mean = scores.mean(dim=0)
        return mean - uwo_coef * (scores - mean).pow(2).mean(dim=0)
    raise ConfigError(f"unknown ensemble combine {combine!r}; valid: {', '.join(COMBINE_MODES)}")


def ensemble_disagreement(scores: torch.Tensor) -> torch.Tensor:
    """(B,) standard deviation of the models' scores per response (population): how much they disagree."""
    return scores.std(dim=0, unbiased=False)
