"""Reducing a per-token loss matrix to the scalar a backward pass needs, the same way however the batch is split.

Why the `global_*` arguments exist. An optimizer step consumes one mini-batch, but the engine sees it in
pieces: M micro-batches (gradient accumulation) on each of D data-parallel ranks. The gradient we want is
the gradient of the loss of the *whole* mini-batch. Two mechanisms combine the pieces:

* gradient accumulation **sums** the micro-batch gradients on a rank;
* data-parallel reduction (DDP / FSDP all-reduce) **averages** gradients over the D ranks.

So if every micro-batch divides its local sum by the mini-batch total (tokens or sequences, counted over
all micro-batches and all ranks) and multiplies by D, then sum over micro-batches followed by the mean over
ranks is exactly sum(all terms) / total: the whole mini-batch loss. Dividing each micro-batch by its own
local count instead (what a naive mean does) weights tokens of short micro-batches more and makes the
gradient depend on how the batch was split. When `global_*` is None the local totals are used, which is
only correct for a single piece, hence `dp_size` must then be 1.

Counting convention, one for every caller (the RL trainer's mini-batches, the worker's local fallback, the
explicit API's requests all use `global_totals`): tokens are `response_mask.sum()`, sequences are rows with
at least one valid response token (verl's `agg_loss`), so an all-padding row neither adds a loss nor dilutes
the sequence mean.

Every mode is linear in the per-token losses once the totals are fixed: `aggregation_weights` gives the
per-token coefficients c, and `aggregate_loss` is sum(c * loss). The explicit API's `policy_loss` uses the
coefficients directly, to fit verl's modes into its per-token-then-summed convention.

Pure: tensors in, tensors out; no distributed code (the caller all-reduces the counts).
"""

from __future__ import annotations

import torch

from posttrain.errors import ConfigError

LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` where `mask` is 1; 0 (not NaN) when the mask is empty."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def global_totals(response_mask: torch.Tensor) -> tuple[int, int]:
    """(valid tokens, sequences with at least one valid token) of a (B, R) mask, as `aggregate_loss` counts.

    The caller sums these over every micro-batch and data-parallel rank of a mini-batch and passes the
    sums as `global_tokens` / `global_seqs`. A row without a valid token is not a sequence: it adds no loss,
    so counting it would only shrink every other sequence's weight.
    """
    valid = response_mask > 0
    return int(valid.sum().item()), int(valid.any(dim=-1).sum().item())


def aggregation_weights(
    mask: torch.Tensor,
    mode: str,
    global_tokens: int | float | torch.Tensor | None = None,
    global_seqs: int | float | torch.Tensor | None = None,
    dp_size: int = 1,
    width: int | float | None = None,
) -> torch.Tensor:
    """The per-token coefficients c of `mode`: every mode is linear in the per-token losses given the
    mini-batch totals, so `aggregate_loss(l, mask, mode, ...) = sum_it c_it * l_it`.

    With m the mask, N = global_tokens, S = global_seqs, n_i = sum_t m_it, D = dp_size, W = width:

    * "token-mean":              c_it = D * m_it / N        (DAPO's token-level loss, Yu et al. 2025)
    * "token-sum":               c_it = D * m_it
    * "seq-mean-token-sum":      c_it = D * m_it / S
    * "seq-mean-token-mean":     c_it = D * m_it / n_i / S   (original GRPO, Shao et al. 2024)
    * "seq-mean-token-sum-norm": c_it = D * m_it / W / S    (Dr. GRPO, Liu et al. 2025)

    W is verl's `loss_scale_factor`: a constant standing for the maximum response length (Dr. GRPO divides
    by it instead of each response's own length). It defaults to the response width mask.shape[-1], as
    verl does; the last mode is then split-invariant only when every micro-batch is padded to the same
    width, so set it (e.g. to data.max_response_length) to keep the normalisation constant. Without `global_*` the local totals are used (N = sum m, S = rows with a valid token);
    see the module docstring for why the totals and D appear. A zero total (an all-padding batch) and
    n_i = 0 are treated as 1, so such rows weigh 0, not NaN. The result has the mask's shape, in the mask's
    dtype if it is floating (else float32), and no gradient of its own.

    Raises ConfigError for an unknown mode, dp_size < 1, `dp_size != 1` without the global totals the mode
    needs, or width <= 0.
    """
    if mode not in LOSS_AGG_MODES:
        raise ConfigError(f"unknown loss_agg_mode {mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")
    if dp_size < 1:
        raise ConfigError(f"dp_size must be >= 1, got {dp_size}")
    needs_tokens = mode == "token-mean"
    needs_seqs = mode.startswith("seq-mean")
    if dp_size != 1 and ((needs_tokens and global_tokens is None) or (needs_seqs and global_seqs is None)):
        raise ConfigError(
            f"loss_agg_mode {mode!r} with dp_size={dp_size} needs the mini-batch totals "
            "(global_tokens / global_seqs); local totals are only correct on a single rank"
        )
    if width is not None and not width > 0:
        raise ConfigError(f"the width of loss_agg_mode 'seq-mean-token-sum-norm' must be > 0, got {width}")
    m = mask.detach().to(mask.dtype if mask.is_floating_point() else torch.float32)
    m = m * dp_size

    if mode == "token-sum":
        return m
    if mode == "token-mean":
        total = mask.sum() if global_tokens is None else global_tokens
        return m / _at_least_one(total, m)

    seqs = (mask > 0).any(dim=-1).sum() if global_seqs is None else global_seqs
    m = m / _at_least_one(seqs, m)
    if mode == "seq-mean-token-sum":
        return m
    if mode == "seq-mean-token-mean":
        lengths = mask.detach().to(m.dtype).sum(dim=-1, keepdim=True).clamp(min=1.0)
        return m / lengths
    # "seq-mean-token-sum-norm"
    return m / (mask.shape[-1] if width is None else width)


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    global_tokens: int | float | torch.Tensor | None = None,
    global_seqs: int | float | torch.Tensor | None = None,
    dp_size: int = 1,
    width: int | float | None = None,
) -> torch.Tensor:
    """Reduce a (B, R) per-token loss to a scalar under `mode`, normalised by mini-batch totals:

            loss = sum_it c_it * l_it,    c = aggregation_weights(mask, mode, totals..., dp_size, width)

    i.e. with m the mask, N = global_tokens, S = global_seqs, n_i = sum_t m_it, D = dp_size, W = width
    (default R = mask.shape[-1]):

    * "token-mean":              D * sum_it l_it m_it / N        (DAPO's token-level loss, Yu et al. 2025)
    * "token-sum":               D * sum_it l_it m_it
    * "seq-mean-token-sum":      D * sum_i (sum_t l_it m_it) / S
    * "seq-mean-token-mean":     D * sum_i (sum_t l_it m_it / n_i) / S   (original GRPO, Shao et al. 2024)
    * "seq-mean-token-sum-norm": D * sum_it l_it m_it / W / S    (Dr. GRPO, Liu et al. 2025)

    The last mode divides by W = `width`, verl's `loss_scale_factor` (default the response width, a
    constant standing for the maximum response length, as verl); with the default it is split-invariant
    only when every micro-batch is padded to the same width. See the
    module docstring for why the totals and D appear. A zero total (an all-padding batch) is treated as 1
    so the loss is 0, not NaN.

    Raises ConfigError for an unknown mode, or for `dp_size != 1` without global totals.
    """
    weights = aggregation_weights(mask.to(loss_mat.dtype), mode, global_tokens, global_seqs, dp_size, width)
    return (loss_mat * weights).sum()


def _at_least_one(total: int | float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`total` as a tensor on `like`'s device, clamped to >= 1 (a zero total only occurs with a zero sum)."""
    return torch.as_tensor(total, dtype=like.dtype, device=like.device).clamp(min=1.0)
