"""posttrain's verl-named policy losses in the explicit API: `forward_backward(data, "policy_loss", config)`.

A loss name never means two things: tinker's `gspo`, `cispo`, `dro` are tinker's (api_losses.py); the
trainer's policy losses of the same names are reached here, by `loss_fn_config["policy_loss"]`, with verl's
`loss_agg_mode`. Registered into `api_losses.API_LOSSES` on import (api_losses imports this module).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType

import torch
from torch.nn.utils.rnn import pad_sequence

from posttrain.algorithms.aggregation import LOSS_AGG_MODES, aggregation_weights, global_totals
from posttrain.algorithms.api_losses import (
    ApiLossError,
    ConfigValue,
    Tensor,
    _api_loss,
    _input,
    _listing,
    _number,
)
from posttrain.algorithms.policy_loss import own_options
from posttrain.algorithms.registry import get_policy_loss
from posttrain.errors import ConfigError

SUM_NORM = "seq-mean-token-sum-norm"
# The `policy_loss` loss's own loss_fn_config keys and their defaults (None: computed when not given); every
# other key is an option of the chosen policy loss (its keyword-only parameters, see `own_options`).
POLICY_LOSS_CONFIG: Mapping[str, ConfigValue | None] = MappingProxyType(
    {"policy_loss": "vanilla", "loss_agg_mode": "token-mean", "max_response_length": None}
)


def _policy_loss(name: str) -> Callable[..., tuple[Tensor, dict[str, float]]]:
    """The registered policy loss `name` (`get_policy_loss`), or ApiLossError listing the valid names."""
    try:
        return get_policy_loss(name)
    except ConfigError as exc:
        raise ApiLossError(f"loss 'policy_loss': {exc}") from None


@functools.lru_cache(maxsize=64)
def settable_options(policy_loss: str) -> Mapping[str, float]:
    """The options of the policy loss `policy_loss` that loss_fn_config can set, with their defaults: its
    numeric keyword-only parameters (`own_options`; not clip_cov's `generator`, which is no number).
    Cached: a registered name never changes its function (registering a name twice is an error)."""
    options = own_options(_policy_loss(policy_loss))
    numeric = {
        key: float(value)
        for key, value in options.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }
    return MappingProxyType(numeric)


@functools.lru_cache(maxsize=256)
def _check_option_values(policy_loss: str, options: tuple[tuple[str, float], ...]) -> None:
    """The policy loss's own range checks (clip_ratio_c > 1, tau > 0, ...) on one dummy token, so that a bad
    value is an error at the call, not on a worker. Cached: check_request checks every datum's config."""
    one = torch.zeros(1, 1)
    try:
        _policy_loss(policy_loss)(one, one, one, torch.ones(1, 1), **dict(options))
    except ConfigError as exc:
        raise ApiLossError(f"loss 'policy_loss': {exc}") from None


def resolve_policy_loss_config(given: Mapping[str, object]) -> dict[str, ConfigValue]:
    """Check the `policy_loss` loss's loss_fn_config and resolve it: `policy_loss` (default "vanilla") and
    `loss_agg_mode` (default "token-mean") filled in, `max_response_length` and the options kept only
    when given (an unset option is the policy loss's own default, as in the trainer).

    ApiLossError (a ValueError) for an unknown policy loss (lists the registered ones), an unknown
    loss_agg_mode (lists `LOSS_AGG_MODES`), a key that is neither this loss's nor the chosen policy
    loss's own option (lists the valid ones), a value that is not a finite number, `max_response_length`
    <= 0 or with another mode than seq-mean-token-sum-norm, or an option value the policy loss itself
    rejects (checked here on one dummy token, so the error comes at the call, not from a worker).
    """
    name = given.get("policy_loss", POLICY_LOSS_CONFIG["policy_loss"])
    if not isinstance(name, str):
        raise ApiLossError(f"loss 'policy_loss': loss_fn_config 'policy_loss' must be a name, got {name!r}")
    options = settable_options(name)
    valid = {*POLICY_LOSS_CONFIG, *options}
    unknown = set(given) - valid
    if unknown:
        raise ApiLossError(
            f"loss 'policy_loss' with policy loss {name!r} does not take loss_fn_config "
            f"{_listing(unknown)}; valid: {_listing(valid)}"
        )
    mode = given.get("loss_agg_mode", POLICY_LOSS_CONFIG["loss_agg_mode"])
    if not isinstance(mode, str) or mode not in LOSS_AGG_MODES:
        raise ApiLossError(
            f"loss 'policy_loss': unknown loss_agg_mode {mode!r}; valid: {', '.join(LOSS_AGG_MODES)}"
        )
    resolved: dict[str, ConfigValue] = {"policy_loss": name, "loss_agg_mode": mode}
    if "max_response_length" in given:
        if mode != SUM_NORM:
            raise ApiLossError(
                f"loss 'policy_loss': max_response_length is the constant of loss_agg_mode {SUM_NORM!r} "
                f"only; loss_agg_mode {mode!r} does not use it"
            )
        width = _number("policy_loss", "max_response_length", given["max_response_length"])
        if width <= 0:
            raise ApiLossError(f"loss 'policy_loss': max_response_length must be > 0, got {width}")
        resolved["max_response_length"] = width
    chosen = {key: _number("policy_loss", key, given[key]) for key in sorted(given.keys() & options.keys())}
    _check_option_values(name, tuple(chosen.items()))
    return resolved | chosen


def policy_loss_totals(
    inputs: Sequence[Mapping[str, Tensor]], config: Mapping[str, ConfigValue]
) -> dict[str, ConfigValue]:
    """The `policy_loss` loss's totals over the whole request (all datums, before the split over workers).

    With w_b the `weights` of datum b (its 0/1 response mask), counted as `aggregation.global_totals`
    counts a mini-batch (verl's convention): global_tokens = #{(b, t): w_bt > 0}, global_seqs = #{b: some
    w_bt > 0} (a datum without a weighted token is no sequence). For seq-mean-token-sum-norm without a
    given max_response_length: W = max_b (last - first weighted position of b + 1), the longest response
    of the request (at least 1), which is verl's response width when responses are right-padded to the
    longest. ApiLossError for weights that are not 0/1 (scale the advantages instead) or not one per token.
    """
    rows = [torch.as_tensor(datum["weights"]) for datum in inputs]
    for i, weights in enumerate(rows):
        if weights.dim() != 1:
            raise ApiLossError(
                f"loss 'policy_loss': datum {i}: weights must have one entry per token, "
                f"got shape {tuple(weights.shape)}"
            )
    mask = pad_sequence([w.float() for w in rows], batch_first=True)  # (B, N_max), 0 beyond each datum
    binary = (mask == 0) | (mask == 1)
    if not bool(binary.all()):
        i, j = (int(x) for x in (~binary).nonzero()[0])
        raise ApiLossError(
            f"loss 'policy_loss': datum {i}: weights must be the 0/1 response mask, "
            f"got {float(mask[i, j])}; scale the advantages instead"
        )
    tokens, seqs = global_totals(mask)
    marked = mask > 0
    width = 0
    if bool(marked.any()):  # the longest span from a datum's first to its last weighted position
        position = torch.arange(mask.shape[-1])
        last = torch.where(marked, position, -1).amax(dim=-1)
        first = torch.where(marked, position, mask.shape[-1]).amin(dim=-1)
        width = int((last - first + 1).max())
    totals: dict[str, ConfigValue] = {"global_tokens": float(tokens), "global_seqs": float(seqs)}
    if config.get("loss_agg_mode") == SUM_NORM and "max_response_length" not in config:
        totals["max_response_length"] = float(max(width, 1))
    return totals


@_api_loss(
    "policy_loss",
    required=("logprobs", "advantages", "weights"),
    config=POLICY_LOSS_CONFIG,
    resolve=resolve_policy_loss_config,
    request_totals=policy_loss_totals,
    totals_inputs=("weights",),
)
def api_policy_loss(
    lp: Tensor,
    inputs: Mapping[str, Tensor],
    *,
    policy_loss: str = "vanilla",
    loss_agg_mode: str = "token-mean",
    global_tokens: float | None = None,
    global_seqs: float | None = None,
    max_response_length: float | None = None,
    **options: float,
) -> tuple[Tensor, dict[str, float]]:
    """posttrain's verl-named policy loss `policy_loss`, aggregated under verl's `loss_agg_mode`, as
    per-token terms whose sum is the trainer's loss (posttrain's own; tinker has no such loss).

    With m = weights (the 0/1 response mask), q = logprobs (the behaviour policy's), A = advantages and
    pg = get_policy_loss(policy_loss)(lp, q, A, m, **options) the (B, N) per-token surrogate:

        loss_bt = c_bt * pg_bt,    c = aggregation_weights(m, loss_agg_mode, N_tok, S, width=W)

    so sum_bt loss_bt = aggregate_loss(pg, m, loss_agg_mode, N_tok, S) = compute_policy_loss(...) of the
    whole request: token-mean c = m / N_tok, token-sum c = m, seq-mean-token-sum c = m / S,
    seq-mean-token-mean c = m / (n_b * S) with n_b = sum_t m_bt, seq-mean-token-sum-norm c = m / (W * S).
    N_tok = global_tokens and S = global_seqs are the request's totals (`policy_loss_totals`, filled in by
    `request_config` on the client, so every worker's split sums to the whole request's loss); None means
    this call's own. W = max_response_length (default: the request's longest response). The options are
    the policy loss's own (e.g. clip_ratio_low / clip_ratio_high / clip_ratio_c for vanilla), each with
    that loss's default when unset. One datum [N] or a (B, N) block. clip_cov / kl_cov pick their tokens
    within the block they see, as in the trainer (a worker's micro-batch). No metrics (the policy loss's
    are means over the block, not sums over datums).
    """
    fn = get_policy_loss(policy_loss)
    tensors = [lp.float(), *(_input(inputs, key, lp) for key in ("logprobs", "advantages", "weights"))]
    single = lp.dim() == 1
    if single:
        tensors = [x.unsqueeze(0) for x in tensors]
    lp32, old, advantages, mask = tensors
    pg_losses, _ = fn(lp32, old, advantages, mask, **options)
    coefficients = aggregation_weights(
        mask, loss_agg_mode, global_tokens, global_seqs, width=max_response_length
    )
    losses = pg_losses * coefficients
    return (losses.squeeze(0) if single else losses), {}
