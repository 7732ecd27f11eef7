"""Rollout correction: importance weights and rejection masks for the gap between the policy that sampled the
responses (the rollout engine, pi_rollout) and the policy the trainer computes (pi_old).

The rollout engine and the trainer hold the same weights but compute different numbers (kernels, precision,
batch shapes), and with asynchronous or stale rollouts not even the same weights. Training on pi_rollout's
samples as if they came from pi_old is then off-policy. verl's `algorithm.rollout_correction` offers, under
these names, the corrections implemented here (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings
You Off-Policy RL Training"; Liu, Li et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from
the Training-Inference Mismatch"):

* `rollout_is`: truncated importance sampling, per token ("token") or per sequence ("sequence"), capped at
  `rollout_is_threshold` (`importance_weights`);
* `rollout_rs`: rejection sampling, tokens or sequences whose divergence from pi_rollout is out of bounds
  get no policy gradient (`rejection_mask`);
* `bypass_mode`: pi_rollout itself is the old policy (no separate old-log-prob pass); `loss_type` says
  whether the policy loss's own ratio corrects ("ppo_clip") or explicit IS weights do ("reinforce").

With r = pi_old / pi_rollout per token (pi_theta / pi_rollout in bypass mode). Pure: tensors in, tensors out;
every statistic is per row, so the result does not depend on how a batch is split into micro-batches.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.algorithms.aggregation import masked_mean
from posttrain.errors import ConfigError

# verl's bound on a log-ratio (token or sequence sum) before exp: e^20 is already meaningless as a weight.
SAFETY_BOUND = 20.0

IS_LEVELS = ("token", "sequence")
LOSS_TYPES = ("ppo_clip", "reinforce")
# verl's rejection options: where the statistic is taken (token, or per sequence its sum, mean or max over
# valid tokens) and which divergence estimator (k1 = log r with bounds on r, k2, k3; see `token_divergence`)
RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)


@dataclass(frozen=True)
class RejectionBounds:
    """Keep a token (sequence) whose statistic s lies in [lower, upper]; lower is -inf for k2/k3."""

    lower: float
    upper: float


@dataclass(frozen=True)
class RolloutCorrection:
    """verl's `algorithm.rollout_correction` settings, validated (ConfigError naming the key otherwise).

    `rollout_is`: None (off), "token" or "sequence"; `rollout_is_threshold`: the cap of the weight (> 0).
    `rollout_rs`: None (off) or comma-separated `RS_OPTIONS`, all of which must pass; `rollout_rs_threshold`:
    one spec shared by every option or one per option, comma-separated: a k1 option takes "lower_upper"
    bounds on the importance weight (or one number u, meaning [1/u, u]), a k2/k3 option one upper bound.
    `bypass_mode`: the rollout log-probs are the old policy. `loss_type` (bypass mode only): "ppo_clip" (the
    loss's ratio pi_theta / pi_rollout is the correction, so no IS weights; `rollout_is` must be off) or
    "reinforce" (the IS weights multiply a REINFORCE loss, policy loss `gpg`).
    """

    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0
    rollout_rs: str | None = None
    rollout_rs_threshold: str | float | None = None
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"

    def __post_init__(self) -> None:
        key = "algorithm.rollout_correction"
        if self.rollout_is is not None and self.rollout_is not in IS_LEVELS:
            raise ConfigError(
                f"{key}.rollout_is must be null, 'token' or 'sequence'; got {self.rollout_is!r}"
            )
        if not self.rollout_is_threshold > 0:
            raise ConfigError(f"{key}.rollout_is_threshold must be > 0, got {self.rollout_is_threshold}")
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(f"{key}.loss_type must be 'ppo_clip' or 'reinforce'; got {self.loss_type!r}")
        if self.loss_type == "reinforce" and not self.bypass_mode:
            raise ConfigError(f"{key}.loss_type=reinforce applies to bypass_mode=true only")
        if self.bypass_mode and self.loss_type == "ppo_clip" and self.rollout_is is not None:
            raise ConfigError(
                f"{key}.rollout_is={self.rollout_is} has no effect with bypass_mode and loss_type=ppo_clip: the "
                "loss's ratio is already pi_theta / pi_rollout; set loss_type=reinforce or rollout_is=null"
            )
        self.rejection_bounds()  # parse errors now, at start

    @property
    def enabled(self) -> bool:
        """Whether any correction is on (each of them needs the rollout log-probs)."""
        return self.rollout_is is not None or self.rollout_rs is not None or self.bypass_mode

    @property
    def applies_is_weights(self) -> bool:
        """IS weights multiply the per-token losses: decoupled mode, or bypass mode with a REINFORCE loss."""
        return self.rollout_is is not None and (not self.bypass_mode or self.loss_type == "reinforce")

    def rejection_bounds(self) -> dict[str, RejectionBounds]:
        """`rollout_rs` options -> their bounds, parsed from `rollout_rs_threshold` as verl writes them."""
        if self.rollout_rs is None:
            return {}
        key = "algorithm.rollout_correction.rollout_rs"
        options = list(dict.fromkeys(o.strip() for o in self.rollout_rs.split(",") if o.strip()))
        unknown = [o for o in options if o not in RS_OPTIONS]
        if not options or unknown:
            named = ", ".join(map(repr, unknown)) or repr(self.rollout_rs)
            raise ConfigError(f"unknown {key} option {named}; valid: {', '.join(RS_OPTIONS)}")
        if self.rollout_rs_threshold is None or str(self.rollout_rs_threshold).strip() == "":
            raise ConfigError(f"{key} is set: give {key}_threshold too")
        specs = [s.strip() for s in str(self.rollout_rs_threshold).split(",") if s.strip()]
        if len(specs) == 1:
            specs = specs * len(options)
        if len(specs) != len(options):
            raise ConfigError(
                f"{key}_threshold needs one spec shared by all options or one per option "
                f"({len(options)}), got {len(specs)}: {self.rollout_rs_threshold!r}"
            )
        return {option: _parse_bounds(option, spec) for option, spec in zip(options, specs, strict=True)}

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None) -> RolloutCorrection:
        """From a plain mapping (a LossSpec option crosses Ray as plain values); None or {} = all off."""
        valid = set(cls.__dataclass_fields__)
        unknown = sorted(set(options or {}) - valid)
        if unknown:
            raise ConfigError(
                f"rollout_correction takes no {', '.join(unknown)}; valid: {', '.join(sorted(valid))}"
            )
        return cls(**dict(options or {}))


def _parse_bounds(option: str, spec: str) -> RejectionBounds:
    """One threshold spec of `option`: "lower_upper" or "upper" (k1: bounds on the weight; k2/k3: upper)."""
    key = "algorithm.rollout_correction.rollout_rs_threshold"
    try:
        parts = [float(p) for p in spec.split("_")]
    except ValueError:
        raise ConfigError(f"{key}: {spec!r} for {option} is not a number or 'lower_upper' pair") from None
    if option.endswith("k1"):
        if len(parts) > 2:
            raise ConfigError(f"{key}: {spec!r} for {option} must be 'upper' or 'lower_upper'")
        lower, upper = (parts[0] and 1.0 / parts[0], parts[0]) if len(parts) == 1 else (parts[0], parts[1])
        if not 0 < lower <= upper:
            raise ConfigError(
                f"{key}: {option} needs bounds 0 < lower <= upper on the importance weight, got {spec!r} "
                "(one number u means [1/u, u]; on the command line write 0.5_2.0, as Hydra reads 0.5_2 as 0.52)"
            )
        return RejectionBounds(math.log(lower), math.log(upper))
    if len(parts) != 1 or not parts[0] > 0:
        raise ConfigError(f"{key}: {option} takes one upper bound > 0, got {spec!r}")
    return RejectionBounds(-math.inf, parts[0])


def importance_weights(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, level: str, threshold: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance-sampling weights (TIS; Yao et al. 2025), no gradient, 0 outside the mask.

    With log r_t = log pi_old - log pi_rollout per token (clamped to [-20, 20] before exp, as verl):

        "token":     w_t = min(r_t, threshold)
        "sequence":  w_t = min(prod_{t' valid} r_t', threshold)      the same for every token of a row

    The sequence weight is the unbiased correction of a whole response (high variance); the token weight is
    biased but of low variance. Metrics: `rollout_is_mean` (token mean of w), `rollout_is_max`, and
    `rollout_is_ratio_fraction_high` / `_low`, the share of tokens (of sequences, for "sequence") whose
    weight before truncation exceeds the threshold / is below its reciprocal.
    """
    valid = response_mask > 0
    with torch.no_grad():
        log_ratio = log_ratio.detach()
        if level == "token":
            log_w, counted = log_ratio, valid
        elif level == "sequence":
            log_w = torch.where(valid, log_ratio, 0.0).sum(dim=-1, keepdim=True)
            counted = valid.any(dim=-1, keepdim=True)  # each non-empty row counts once in the fractions
        else:
            raise ConfigError(f"rollout_is must be 'token' or 'sequence', got {level!r}")
        raw = log_w.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
        weights = torch.where(valid, raw.clamp(max=threshold).expand_as(log_ratio), 0.0)
        metrics = {
            "rollout_is_mean": masked_mean(weights, response_mask).item(),
            "rollout_is_max": weights.max().item() if bool(valid.any()) else 0.0,
            "rollout_is_ratio_fraction_high": masked_mean((raw > threshold).to(raw.dtype), counted).item(),
            "rollout_is_ratio_fraction_low": masked_mean(
                (raw < 1.0 / threshold).to(raw.dtype), counted
            ).item(),
        }
    return weights, metrics


def token_divergence(log_ratio: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token divergence statistic of rejection sampling, from log r (clamped to [-20, 20]):

        k1 = log r  (bounded below and above)     k2 = (log r)^2 / 2     k3 = r - 1 - log r

    (Schulman 2020, "Approximating KL Divergence"; k2 and k3 are >= 0 and 0 when r = 1.)
    """
    log_r = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    if estimator == "k1":
        return log_r
    if estimator == "k2":
        return 0.5 * log_r.square()
    return log_r.exp() - 1.0 - log_r


def rejection_mask(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, bounds: Mapping[str, RejectionBounds]
) -> tuple[torch.Tensor, dict[str, float]]:
    """Rejection sampling: 1 where every option of `bounds` keeps the token, 0 where one rejects it.

    For option "<where>_<k>" with d_t = token_divergence(log r_t, k) over the valid tokens of row i:

        token_k:     keep token t      iff  lower <= d_t <= upper
        seq_sum_k:   keep the row      iff  lower <= sum_t d_t <= upper     (k1: the sequence IS weight)
        seq_mean_k:  keep the row      iff  lower <= mean_t d_t <= upper    (k1: its geometric mean)
        seq_max_k:   keep the row      iff  max_t d_t <= upper

    For k1 the bounds are log(lower) and log(upper) of the importance weight r = pi_old / pi_rollout, so
    "0.5_2.0" keeps weights in [0.5, 2], as verl's documentation describes them (verl's code bounds -log r,
    i.e. 1 / r; the two agree for the symmetric [1/u, u] that one number gives). A rejected token keeps its place in the loss normaliser with zero
    policy-gradient loss. Metrics: `rollout_rs_masked_fraction` (rejected share of valid tokens),
    `rollout_rs_seq_masked_fraction` (share of non-empty rows with a rejected token), and the same two per
    option (`rollout_rs_<option>_masked_fraction`, `..._seq_masked_fraction`).
    """
    valid = response_mask > 0
    rows = valid.any(dim=-1)
    keep = torch.ones_like(valid)
    metrics: dict[str, float] = {}
    with torch.no_grad():
        log_ratio = log_ratio.detach()
        for option, bound in bounds.items():
            where, estimator = option.rsplit("_", 1)
            d = token_divergence(log_ratio, estimator)
            if where == "token":
                stat = d
            elif where == "seq_sum":
                stat = torch.where(valid, d, 0.0).sum(-1, keepdim=True)
            elif where == "seq_mean":
                count = valid.sum(-1, keepdim=True).clamp(min=1)
                stat = torch.where(valid, d, 0.0).sum(-1, keepdim=True) / count
            else:  # seq_max; an empty row has statistic 0 (kept)
                stat = torch.where(valid, d, -math.inf).amax(-1, keepdim=True)
                stat = torch.where(rows.unsqueeze(-1), stat, 0.0)
            option_keep = ((stat >= bound.lower) & (stat <= bound.upper)).expand_as(valid)
            metrics.update(_rejection_metrics(f"rollout_rs_{option}", option_keep, valid, rows))
            keep &= option_keep
        metrics.update(_rejection_metrics("rollout_rs", keep, valid, rows))
    return keep.to(log_ratio.dtype), metrics


def _rejection_metrics(
    prefix: str, keep: torch.Tensor, valid: torch.Tensor, rows: torch.Tensor
) -> dict[str, float]:
    rejected = ~keep & valid
    n_rows = int(rows.sum())
    return {
        f"{prefix}_masked_fraction": int(rejected.sum()) / max(int(valid.sum()), 1),
        f"{prefix}_seq_masked_fraction": int(rejected.any(dim=-1).sum()) / max(n_rows, 1),
    }


@dataclass(frozen=True)
class Corrected:
    """What `apply_rollout_correction` hands the policy loss (see there)."""

    old_log_prob: torch.Tensor
    weights: torch.Tensor | None  # multiply the per-token losses; None = no IS weights
    keep: torch.Tensor | None  # multiply the response mask; None = no rejection
    metrics: dict[str, float]


def apply_rollout_correction(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    rollout_log_probs: torch.Tensor | None,
    response_mask: torch.Tensor,
    correction: RolloutCorrection,
) -> Corrected:
    """The old policy, IS weights and rejection mask of one micro-batch under `correction`.

    Decoupled mode (verl's default; three policies): r = pi_old / pi_rollout, the policy loss's ratio is
    pi_theta / pi_old. Bypass mode (two policies): pi_old := pi_rollout, and r = pi_theta / pi_rollout with
    pi_theta's log-probs detached, as verl's bypass loss. Raises ConfigError when a correction is on but the
    rollout log-probs are missing.
    """
    if not correction.enabled:
        return Corrected(old_log_prob, None, None, {})
    if rollout_log_probs is None:
        raise ConfigError(
            "algorithm.rollout_correction needs rollout_log_probs (the log-probs the rollout engine sampled "
            "with); pass them or turn rollout_is, rollout_rs and bypass_mode off"
        )
    rollout_log_probs = rollout_log_probs.to(log_prob.dtype)
    if correction.bypass_mode:
        old_log_prob = rollout_log_probs
        log_ratio = log_prob.detach() - rollout_log_probs
    else:
        log_ratio = old_log_prob.detach() - rollout_log_probs
    weights, keep, metrics = None, None, {}
    if correction.applies_is_weights:
        assert correction.rollout_is is not None
        weights, is_metrics = importance_weights(
            log_ratio, response_mask, correction.rollout_is, correction.rollout_is_threshold
        )
        metrics.update(is_metrics)
    bounds = correction.rejection_bounds()
    if bounds:
        keep, rs_metrics = rejection_mask(log_ratio, response_mask, bounds)
        metrics.update(rs_metrics)
    return Corrected(old_log_prob, weights, keep, metrics)
