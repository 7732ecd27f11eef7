"""Preference-optimisation losses over the log-probs of a chosen and a rejected completion per prompt.

Every loss takes `PairLogps` (per pair: summed completion log-probs under the policy, their token counts,
and the reference's summed log-probs when there is a reference) and returns the per-pair loss (P,); the
batch loss is their mean. Names and defaults follow TRL (`DPOConfig.loss_type`, `beta`, `label_smoothing`;
CPO's `simpo_gamma`; ORPO's `beta` is the paper's lambda). Notation, per pair:

    h_w = log pi(y_w|x) - log pi_ref(y_w|x),   h_l = log pi(y_l|x) - log pi_ref(y_l|x),   h = h_w - h_l

Several losses combine as sum_k w_k * loss_k (`loss_weights`, TRL's list `loss_type`), e.g. sigmoid + sft
(RPO). Rewards (metrics): beta * h_w and beta * h_l with a reference; beta * the mean token log-prob without.
Pure: tensors in, tensors out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from posttrain.algorithms.registry import Registry
from posttrain.errors import ConfigError


@dataclass(frozen=True)
class PairLogps:
    chosen: torch.Tensor  # (P,) sum of log pi over the chosen completion's tokens
    rejected: torch.Tensor  # (P,)
    chosen_tokens: torch.Tensor  # (P,) completion lengths (loss-mask sums)
    rejected_tokens: torch.Tensor  # (P,)
    ref_chosen: torch.Tensor | None = None  # (P,) the reference's sums; None for reference-free losses
    ref_rejected: torch.Tensor | None = None
    # NLL normaliser: chosen tokens per pair over the whole mini-batch (N / P), so that the mean over pairs of
    # -chosen / tokens_per_pair is the token-mean NLL (TRL's); None = this batch's own
    tokens_per_pair: float | None = None

    def margin(self) -> torch.Tensor:
        """h = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))."""
        ref_c, ref_r = self.reference()
        return (self.chosen - ref_c) - (self.rejected - ref_r)

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ref_chosen is None or self.ref_rejected is None:
            raise ConfigError("this preference loss needs reference log-probs (dpo.reference)")
        return self.ref_chosen, self.ref_rejected

    def mean_chosen(self) -> torch.Tensor:
        return self.chosen / self.chosen_tokens.clamp(min=1)

    def mean_rejected(self) -> torch.Tensor:
        return self.rejected / self.rejected_tokens.clamp(min=1)

    def nll(self) -> torch.Tensor:
        """Per-pair share of the token-mean NLL of the chosen completions."""
        per_pair = self.tokens_per_pair
        if per_pair is None:
            per_pair = float(self.chosen_tokens.sum()) / max(1, len(self.chosen))
        return -self.chosen / max(per_pair, 1e-8)


@dataclass(frozen=True)
class PreferenceOptions:
    beta: float = 0.1
    label_smoothing: float = 0.0  # sigmoid (conservative DPO) and robust: the assumed label-flip rate
    simpo_gamma: float = 0.5  # simpo: the target reward margin


LossFn = Callable[[PairLogps, PreferenceOptions], torch.Tensor]
PREFERENCE_LOSSES: Registry[LossFn] = Registry("preference loss")
NEEDS_REFERENCE: set[str] = set()


def register(name: str, needs_reference: bool) -> Callable[[LossFn], LossFn]:
    if needs_reference:
        NEEDS_REFERENCE.add(name)
    return PREFERENCE_LOSSES.register(name)


@register("sigmoid", needs_reference=True)
def sigmoid_loss(p: PairLogps, o: PreferenceOptions) -> torch.Tensor:
    """DPO (Rafailov et al. 2023), with label smoothing eps the conservative DPO of Mitchell 2023:
    -(1 - eps) log sigma(beta h) - eps log sigma(-beta h)."""
    h = o.beta * p.margin()
    eps = o.label_smoothing
    return -(1 - eps) * F.logsigmoid(h) - eps * F.logsigmoid(-h)


@register("robust", needs_reference=True)
def robust_loss(p: PairLogps, o: PreferenceOptions) -> torch.Tensor:
    """Robust DPO (Chowdhury et al. 2024), unbiased under label-flip rate eps < 1/2:
    (-(1 - eps) log sigma(beta h) + eps log sigma(-beta h)) / (1 - 2 eps)."""
    h = o.beta * p.margin()
    eps = o.label_smoothing
    return (-(1 - eps) * F.logsigmoid(h) + eps * F.logsigmoid(-h)) / (1 - 2 * eps)


@register("hinge", needs_reference=True)
def hinge_loss(p: PairLogps, o: PreferenceOptions) -> torch.Tensor:
    """SLiC (Zhao et al. 2023) on the DPO margin: max(0, 1 - beta h)."""
    return torch.relu(1 - o.beta * p.margin())


@register("ipo", needs_reference=True)
def ipo_loss(p: PairLogps, o: PreferenceOptions) -> torch.Tensor:
    """IPO (Azar et al. 2023): (h - 1/(2 beta))^2, with h on mean token log-probs (as TRL computes it)."""
    ref_c, ref_r = p.reference()
    h = (p.chosen - ref_c) / p.chosen_tokens.clamp(min=1) - (p.rejected - ref_r) / p.rejected_tokens.clamp(
        min=1
    )
    return (h - 1 / (2 * o.beta)) ** 2


@register("apo_zero", needs_reference=True)
def apo_zero_loss(p: PairLogps, o: PreferenceOptions) -> torch.Tensor:
    """APO-zero (D'Oosterlinck et al. 2024, Anchored Preference Optimization): push the chosen likelihood up
    and the rejected down, each against the reference: (1 - sigma(beta h_w)) + sigma(beta h_l)."""
    ref_c, ref_r = p.reference()
    return (1 - torch.sigmoid(o.beta * (p.chosen - ref_c))) + torch.sigmoid(o.beta * (p.rejected - ref_r))


@register("sft", needs_reference=False)
def sft_loss(p: PairLogps, o: PreferenceOptions) -> torch.Tensor:
    """Negative log-likelihood of the chosen completions, token mean over the batch (RPO, Pang et al. 2024;
    MPO's generation term): -sum log pi(y_w) / chosen tokens."""
    return p.nll()


@register("simpo", needs_reference=False)
def simpo_loss(p: PairLogps, o: PreferenceOptions) -> torch.Tensor:
    """SimPO (Meng et al. 2024), reference-free: -log sigma(beta (mean log pi(y_w) - mean log pi(y_l)) - gamma),
    with mean = the length-normalised log-prob; label smoothing as in sigmoid."""
    h = o.beta * (p.mean_chosen() - p.mean_rejected()) - o.simpo_gamma
    eps = o.label_smoothing
    return -(1 - eps) * F.logsigmoid(h) - eps * F.logsigmoid(-h)


@register("orpo", needs_reference=False)
def orpo_loss(p: PairLogps, o: PreferenceOptions) -> torch.Tensor:
    """ORPO (Hong et al. 2024), reference-free: NLL(y_w) - lambda log sigma(log odds(y_w) - log odds(y_l)),
    odds(y) = P / (1 - P) with log P the mean token log-prob; lambda is `beta` (as TRL's ORPOConfig)."""
    mc, mr = p.mean_chosen(), p.mean_rejected()
    # log(1 - exp(x)) for x < 0, stable near 0 (clamped: a completion of probability 1 has infinite odds)
    log_odds = (mc - mr) - (
        torch.log1p(-torch.exp(mc).clamp(max=1 - 1e-7)) - torch.log1p(-torch.exp(mr).clamp(max=1 - 1e-7))
    )
    return p.nll() - o.beta * F.logsigmoid(log_odds)


def check_preference(
    loss_types: Sequence[str], loss_weights: Sequence[float], options: PreferenceOptions
) -> None:
    """Reject at start what cannot work, naming the setting and the valid values."""
    if not loss_types:
        raise ConfigError(f"dpo.loss_type is empty; valid: {', '.join(PREFERENCE_LOSSES.names())}")
    for name in loss_types:
        PREFERENCE_LOSSES.get(name)
    if len(set(loss_types)) != len(loss_types):
        raise ConfigError(f"dpo.loss_type={list(loss_types)} names a loss twice")
    if loss_weights and len(loss_weights) != len(loss_types):
        raise ConfigError(
            f"dpo.loss_weights has {len(loss_weights)} values for {len(loss_types)} losses in dpo.loss_type"
        )
    if options.beta <= 0:
        raise ConfigError(f"dpo.beta must be > 0, got {options.beta}")
    if not 0 <= options.label_smoothing < 0.5:
        raise ConfigError(f"dpo.label_smoothing must be in [0, 0.5), got {options.label_smoothing}")
    if options.label_smoothing and not set(loss_types) & {"sigmoid", "robust", "simpo"}:
        raise ConfigError("dpo.label_smoothing applies to the sigmoid, robust and simpo losses only")
    if options.simpo_gamma != PreferenceOptions().simpo_gamma and "simpo" not in loss_types:
        raise ConfigError(
            f"dpo.simpo_gamma={options.simpo_gamma} is set, but it applies to the simpo loss only (dpo.loss_type="
            f"{list(loss_types)}): it would be ignored"
        )


def needs_reference(loss_types: Sequence[str]) -> bool:
    return any(name in NEEDS_REFERENCE for name in loss_types)


def preference_loss(
    p: PairLogps, loss_types: Sequence[str], loss_weights: Sequence[float], options: PreferenceOptions
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(per-pair loss sum_k w_k loss_k (P,), per-pair metrics: rewards, margins, accuracy, each loss term)."""
    weights = list(loss_weights) or [1.0] * len(loss_types)
    total = torch.zeros_like(p.chosen)
    metrics: dict[str, torch.Tensor] = {}
    for name, weight in zip(loss_types, weights, strict=True):
        term = PREFERENCE_LOSSES.get(name)(p, options)
        metrics[f"loss_{name}"] = term.detach()
        total = total + weight * term
    with torch.no_grad():
        if p.ref_chosen is not None and p.ref_rejected is not None:
            chosen = options.beta * (p.chosen - p.ref_chosen)
            rejected = options.beta * (p.rejected - p.ref_rejected)
        else:
            chosen, rejected = options.beta * p.mean_chosen(), options.beta * p.mean_rejected()
        metrics |= {
            "rewards_chosen": chosen,
            "rewards_rejected": rejected,
            "rewards_margin": chosen - rejected,
            "rewards_accuracy": (chosen > rejected).to(chosen.dtype),
            "logps_chosen": p.chosen.detach(),
            "logps_rejected": p.rejected.detach(),
        }
    return total, metrics
