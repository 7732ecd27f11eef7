"""KL-in-reward: the coefficient controllers and the reward penalty they scale.

PPO-style RLHF (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences") subtracts
coef * KL(pi_old || pi_ref) from each token's reward; the coefficient is either fixed or adapted so that
the measured KL tracks a target. The controllers are small stateful objects (their coefficient is saved
with a checkpoint through `state_dict`); `apply_kl_penalty` is a pure tensor function.
Must not import engine, rollout, workers, Ray or data.batch.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch

from posttrain.algorithms.kl import kl_penalty
from posttrain.errors import ConfigError, PosttrainError

KL_CONTROLLER_KINDS = ("fixed", "adaptive")

# Ziegler et al. 2019 bound the proportional error so one outlier batch moves the coefficient by at most
# 20% * n_steps / horizon.
_MAX_PROPORTIONAL_ERROR = 0.2


class KLController(Protocol):
    """What the trainer needs from a KL coefficient controller."""

    @property
    def value(self) -> float: ...

    def update(self, current_kl: float, n_steps: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _check_coef(name: str, coef: float) -> float:
    coef = float(coef)
    if not math.isfinite(coef) or coef < 0.0:
        raise ConfigError(f"{name} must be a finite number >= 0, got {coef}")
    return coef


def _loaded_value(state: dict[str, Any], owner: str) -> float:
    if "value" not in state:
        raise ConfigError(f"{owner} state has no 'value' key (got keys {sorted(state)})")
    return _check_coef(f"{owner} state 'value'", state["value"])


class FixedKLController:
    """A constant KL coefficient; `update` does nothing."""

    def __init__(self, coef: float) -> None:
        self._value = _check_coef("kl coef", coef)

    @property
    def value(self) -> float:
        return self._value

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "fixed", "value": self._value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Checked, but the configured coefficient stays: a fixed coefficient never moved, so a checkpoint's
        can differ only when the config changed it (or the run was adaptive), and then the config wins."""
        _loaded_value(state, "FixedKLController")

    def __repr__(self) -> str:
        return f"FixedKLController(value={self._value})"


class AdaptiveKLController:
    """Proportional controller of the KL coefficient (Ziegler et al. 2019, section 2.2).

    After each batch with measured KL `current_kl` over `n_steps` samples:

        err = clip(current_kl / target_kl - 1, -0.2, 0.2);      coef *= 1 + err * n_steps / horizon

    so the coefficient grows while the KL is above the target and shrinks while it is below; `horizon`
    (in samples, like n_steps) sets how fast.
    """

    def __init__(self, init_coef: float, target_kl: float, horizon: float) -> None:
        self._value = _check_coef("kl init_coef", init_coef)
        if not target_kl > 0.0:
            raise ConfigError(f"adaptive KL controller: target_kl must be > 0, got {target_kl}")
        if not horizon > 0:
            raise ConfigError(f"adaptive KL controller: horizon must be > 0, got {horizon}")
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    @property
    def value(self) -> float:
        return self._value

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient towards keeping `current_kl` at the target (see the class docstring)."""
        current_kl = float(current_kl)
        if not math.isfinite(current_kl):
            raise PosttrainError(
                f"adaptive KL controller got a non-finite KL ({current_kl}); training diverged"
            )
        if n_steps < 0:
            raise ConfigError(f"adaptive KL controller: n_steps must be >= 0, got {n_steps}")
        error = current_kl / self.target_kl - 1.0
        error = min(max(error, -_MAX_PROPORTIONAL_ERROR), _MAX_PROPORTIONAL_ERROR)
        self._value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "adaptive", "value": self._value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The coefficient the controller had reached; a checkpoint of a fixed coefficient (a run switched to
        adaptive on resume) is not a reached value: the configured init_coef stays."""
        value = _loaded_value(state, "AdaptiveKLController")
        if state.get("kind", "adaptive") == "adaptive":
            self._value = value

    def __repr__(self) -> str:
        return (
            f"AdaptiveKLController(value={self._value}, target_kl={self.target_kl}, horizon={self.horizon})"
        )


def make_kl_controller(
    kind: str, coef: float, target_kl: float | None = None, horizon: float | None = None
) -> FixedKLController | AdaptiveKLController:
    """The controller of `kind` ("fixed" or "adaptive"); `target_kl` and `horizon` are used by "adaptive" only.

    Raises ConfigError for an unknown kind, a negative coef, or (adaptive) target_kl <= 0 / horizon <= 0.
    """
    if kind == "fixed":
        return FixedKLController(coef)
    if kind == "adaptive":
        if target_kl is None or horizon is None:
            raise ConfigError("adaptive KL controller needs target_kl and horizon")
        return AdaptiveKLController(coef, target_kl, horizon)
    raise ConfigError(f"unknown KL controller kind {kind!r}; valid: {', '.join(KL_CONTROLLER_KINDS)}")


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kind: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token rewards with the KL penalty: rewards = scores - kl_coef * kl * mask, all (B, R), no gradient.

    kl is the per-token estimate `kl_penalty(old_log_prob, ref_log_prob, kind)` of KL(pi_old || pi_ref).
    Metrics: `kl_in_reward` the mean over non-empty sequences of the sequence KL (the sum of its tokens'
    estimates, the quantity of Ziegler et al.), `kl_in_reward_token_mean` the mean over non-empty sequences
    of the token-mean KL (what verl reports and feeds its adaptive controller), `kl_coef`. Feed the one your
    target_kl is calibrated for to `controller.update(kl, n_steps=batch size)`.
    """
    with torch.no_grad():
        mask = response_mask.to(token_level_scores.dtype)
        kl = kl_penalty(old_log_prob.detach(), ref_log_prob.detach(), kind).to(mask.dtype) * mask
        rewards = token_level_scores - kl_coef * kl
        lengths = mask.sum(dim=-1)
        non_empty = lengths > 0
        n_seqs = max(int(non_empty.sum()), 1)
        seq_kl = kl.sum(dim=-1)
        seq_token_mean = seq_kl / lengths.clamp(min=1.0)
        metrics = {
            "kl_in_reward": (seq_kl.sum() / n_seqs).item(),
            "kl_in_reward_token_mean": (seq_token_mean.sum() / n_seqs).item(),
            "kl_coef": float(kl_coef),
        }
    return rewards, metrics
