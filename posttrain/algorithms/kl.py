"""Per-token estimators of KL(pi || pi_ref) from the log-probs of the sampled tokens.

Only the sampled token's log-prob is known under each policy, so the KL is estimated from the log-ratio
of one sample x ~ pi. Following John Schulman, "Approximating KL Divergence" (2020,
http://joschu.net/blog/kl-approx.html), with log r = log pi_ref(x) - log pi(x):

* k1 = -log r              unbiased, high variance, can be negative per token;
* k2 = (log r)^2 / 2       biased but low variance, always >= 0;
* k3 = (r - 1) - log r     unbiased and always >= 0, low variance ("low_var_kl" in verl, used by GRPO).

Each is registered under its verl names. k1 and k3 have the KL as expected *value*, but their expected
*gradient* is not the gradient of the KL, while k2's is (for samples from pi). The straight-through
variants "k1+"/"kl+", "k3+"/"low_var_kl+" and "abs+" take the value of the named estimator and the
gradient of k2: `k2 + (est - k2).detach()` (verl's "+" suffix). verl accepts the suffix on every name, so
"k2+"/"mse+" are k2 itself (value and gradient already k2's). Pure: tensors in, tensors out.
"""

from __future__ import annotations

import torch

from posttrain.algorithms.registry import get_kl_estimator, register_kl

# verl's bounds: the log-ratio before exp (overflow), and k3 itself (a few tokens with a huge ratio would
# otherwise dominate the loss and its gradient).
_LOG_RATIO_CLAMP = 20.0
_K3_CLAMP = 10.0


@register_kl("k1", "kl")
def kl_k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k1 = log pi(x) - log pi_ref(x): the plain log-ratio (Schulman 2020)."""
    return log_prob - ref_log_prob


@register_kl("abs")
def kl_abs(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """|log pi(x) - log pi_ref(x)|: a non-negative, biased variant of k1."""
    return (log_prob - ref_log_prob).abs()


@register_kl("k2", "mse", "k2+", "mse+")
def kl_k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 * (log pi(x) - log pi_ref(x))^2 (Schulman 2020): low variance, biased, >= 0.

    Also "k2+"/"mse+": the straight-through form k2 + (k2 - k2).detach() is k2 itself (as verl returns it).
    """
    return 0.5 * (log_prob - ref_log_prob).square()


@register_kl("k3", "low_var_kl")
def kl_k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k3 = r - log r - 1 with r = exp(log pi_ref(x) - log pi(x)) (Schulman 2020): unbiased, >= 0.

    The log-ratio is clamped to [-20, 20] before exp and k3 to [-10, 10], as verl does.
    """
    log_ratio = (ref_log_prob - log_prob).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    k3 = log_ratio.exp() - log_ratio - 1.0
    return k3.clamp(-_K3_CLAMP, _K3_CLAMP)


def _with_k2_gradient(
    value: torch.Tensor, log_prob: torch.Tensor, ref_log_prob: torch.Tensor
) -> torch.Tensor:
    """`value` in the forward pass, the gradient of k2 in the backward pass (straight-through)."""
    k2 = kl_k2(log_prob, ref_log_prob)
    return k2 + (value - k2).detach()


@register_kl("k1+", "kl+")
def kl_k1_plus(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """Value of k1, gradient of k2 (log pi - log pi_ref per token)."""
    return _with_k2_gradient(kl_k1(log_prob, ref_log_prob), log_prob, ref_log_prob)


@register_kl("abs+")
def kl_abs_plus(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """Value of abs, gradient of k2."""
    return _with_k2_gradient(kl_abs(log_prob, ref_log_prob), log_prob, ref_log_prob)


@register_kl("k3+", "low_var_kl+")
def kl_k3_plus(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """Value of k3 (clamped as `kl_k3`), gradient of k2."""
    return _with_k2_gradient(kl_k3(log_prob, ref_log_prob), log_prob, ref_log_prob)


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate (B, R) of the registered estimator `kind` ("k1", "k3", "low_var_kl", "k3+", ...).

    Raises ConfigError listing the valid kinds for an unknown one.
    """
    return get_kl_estimator(kind)(log_prob, ref_log_prob)
