"""Reward-model ensembles' combinations (Coste et al. 2024), against hand computations."""

from __future__ import annotations

import pytest
import torch

from posttrain.algorithms.reward_ensemble import combine_ensemble_scores, ensemble_disagreement
from posttrain.errors import ConfigError

# two models' scores of three responses: per response mean 2, 2, -2; population variance 1, 4, 0
SCORES = torch.tensor([[1.0, 4.0, -2.0], [3.0, 0.0, -2.0]], dtype=torch.float64)


@pytest.mark.parametrize(
    ("combine", "coef", "expected"),
    [
        ("mean", 0.0, [2.0, 2.0, -2.0]),
        ("min", 0.0, [1.0, 0.0, -2.0]),
        ("uwo", 0.5, [2.0 - 0.5 * 1.0, 2.0 - 0.5 * 4.0, -2.0]),  # mean - lambda * variance
    ],
)
def test_combinations_by_hand(combine: str, coef: float, expected: list[float]) -> None:
    out = combine_ensemble_scores(SCORES, combine, coef)
    assert out.dtype == torch.float64
    assert out.tolist() == pytest.approx(expected, abs=1e-12)


def test_one_model_is_its_own_scores_and_disagreement_is_the_spread() -> None:
    one = SCORES[:1]
    for combine, coef in [("mean", 0.0), ("min", 0.0), ("uwo", 2.0)]:
        assert combine_ensemble_scores(one, combine, coef).tolist() == one[0].tolist()
    assert ensemble_disagreement(SCORES).tolist() == pytest.approx([1.0, 2.0, 0.0], abs=1e-12)


def test_bad_combinations_are_refused() -> None:
    with pytest.raises(ConfigError, match="combine 'uwo' needs uwo_coef > 0"):
        combine_ensemble_scores(SCORES, "uwo", 0.0)
    with pytest.raises(ConfigError, match="unknown ensemble combine 'max'; valid: mean, min, uwo"):
        combine_ensemble_scores(SCORES, "max")
    with pytest.raises(ValueError, match="must be \\(models, responses\\)"):
        combine_ensemble_scores(SCORES[0], "mean")
