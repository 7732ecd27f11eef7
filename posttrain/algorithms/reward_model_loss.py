"""The reward model's pairwise loss: Bradley-Terry over a chosen and a rejected score per prompt.

Per pair, with scores r_c (chosen) and r_r (rejected) of a sequence classifier:

    loss = -log sigmoid(r_c - r_r - m) + coef * (r_c + r_r)^2

m is the pair's margin (TRL's `margin` column, as in Llama 2's reward models; 0 without one). The second term
is Eisenstein et al. (2023, "Helping or Herding?")'s auxiliary loss that centres rewards at 0 (TRL's
`center_rewards_coefficient`): Bradley-Terry sees differences only, so without it scores drift by any constant.
The batch loss is the mean over pairs. Pure: tensors in, tensors out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from posttrain.errors import ConfigError


def check_center_coefficient(coef: float) -> None:
    if not coef >= 0:
        raise ConfigError(f"rm.center_rewards_coefficient must be >= 0 (0 = off), got {coef}")


def bradley_terry_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    margin: torch.Tensor | None = None,
    center_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(P,) per-pair loss -log sigmoid(r_c - r_r - m) + center_coef * (r_c + r_r)^2, and per-pair metrics:
    `accuracy` (1 where r_c > r_r; a tie counts 0, and `ties` counts it), `margin` (r_c - r_r), `chosen`,
    `rejected`, `bt_loss` (the first term) and `center` ((r_c + r_r)^2, before the coefficient)."""
    if chosen.shape != rejected.shape or chosen.dim() != 1:
        raise ValueError(
            f"chosen {tuple(chosen.shape)} and rejected {tuple(rejected.shape)} must both be (P,)"
        )
    check_center_coefficient(center_coef)
    difference = chosen - rejected
    shifted = difference if margin is None else difference - margin.to(difference.dtype)
    bt = -F.logsigmoid(shifted)
    center = (chosen + rejected) ** 2
    losses = bt + center_coef * center if center_coef else bt
    detached = difference.detach()
    metrics = {
        "accuracy": (detached > 0).to(chosen.dtype),
        "ties": (detached == 0).to(chosen.dtype),
        "margin": detached,
        "chosen": chosen.detach(),
        "rejected": rejected.detach(),
        "bt_loss": bt.detach(),
        "center": center.detach(),
    }
    return losses, metrics
