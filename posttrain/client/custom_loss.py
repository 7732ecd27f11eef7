"""tinker's custom loss in two passes, shared by every backend (in-process, Ray, HTTP).

A forward pass gives each datum's log-probs `lp_i`; `loss, metrics = loss_fn(data, lps)` is differentiated
with respect to them here, in the caller's process; then a `cross_entropy` forward/backward with weights
`-dloss/dlp_i` puts exactly dloss/dtheta (the chain rule through the log-probs) into the model's gradients.
The backends differ only in how they run the two passes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from tinker import types

from posttrain.client.batching import check_request

CustomLoss = Callable[[list[types.Datum], list[torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]


def with_weights(datum: types.Datum, weights: torch.Tensor) -> types.Datum:
    """`datum` as a cross_entropy datum: its target tokens, with `weights`."""
    return types.Datum(
        model_input=datum.model_input,
        loss_fn_inputs={
            "target_tokens": datum.loss_fn_inputs["target_tokens"],
            "weights": types.TensorData.from_torch(weights.detach().float()),
        },
    )


def probe_data(data: Sequence[types.Datum], lengths: Sequence[int] | None = None) -> list[types.Datum]:
    """The first pass's datums (weights 0: log-probs only), after checking the request at the call.
    `lengths`: the datums' model input lengths (check_request's)."""
    if not data:
        raise ValueError("No data provided")
    for datum in data:
        if "target_tokens" not in datum.loss_fn_inputs:
            raise ValueError("forward_backward_custom needs target_tokens in every datum")
    # one weight per target (an image chunk's length is known only once the model's processor has run)
    probe = [with_weights(d, torch.zeros(d.loss_fn_inputs["target_tokens"].to_numpy().shape)) for d in data]
    check_request(probe, "cross_entropy", None, lengths)
    return probe


def linearise(
    data: list[types.Datum], loss_fn: CustomLoss, first: types.ForwardBackwardOutput
) -> tuple[list[types.Datum], float, dict[str, float]]:
    """(the second pass's datums, the custom loss's value, its metrics) from the first pass's output."""
    lps = [out["logprobs"].to_torch().float().requires_grad_(True) for out in first.loss_fn_outputs]
    loss, metrics = loss_fn(data, lps)
    value = float(loss.detach().sum())
    loss.sum().backward()  # type: ignore[no-untyped-call]
    if any(lp.grad is None for lp in lps):
        raise ValueError("the custom loss does not depend on every datum's logprobs")
    linear = [with_weights(d, -lp.grad) for d, lp in zip(data, lps, strict=True)]  # type: ignore[arg-type]
    return linear, value, {k: float(v) for k, v in metrics.items()}


def custom_output(
    out: types.ForwardBackwardOutput, value: float, metrics: dict[str, float]
) -> types.ForwardBackwardOutput:
    """The second pass's output reporting `loss:sum` (the custom loss) and `surrogate_loss:sum` (the
    linearised one's value) with the custom loss's metrics."""
    surrogate = out.metrics.pop("loss:sum")
    out.metrics.update(metrics)
    out.metrics.update({"loss:sum": value, "surrogate_loss:sum": surrogate})
    return out
