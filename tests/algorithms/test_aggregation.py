import pytest
import torch

from posttrain.algorithms.aggregation import LOSS_AGG_MODES, aggregate_loss, global_totals, masked_mean
from posttrain.errors import ConfigError

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # last row: empty response


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        # masked tokens: 1, 2 (row 0) and 4 (row 1); sum 7, 3 tokens, 2 non-empty rows, width 3
        ("token-mean", 7 / 3),
        ("token-sum", 7.0),
        ("seq-mean-token-sum", (3 + 4) / 2),
        ("seq-mean-token-mean", (3 / 2 + 4 / 1) / 2),
        ("seq-mean-token-sum-norm", 7 / 3 / 2),
    ],
)
def test_local_totals(mode, expected):
    assert aggregate_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 7 / 10 * 2),
        ("token-sum", 7.0 * 2),
        ("seq-mean-token-sum", 7 / 4 * 2),
        ("seq-mean-token-mean", 5.5 / 4 * 2),
        ("seq-mean-token-sum-norm", 7 / 3 / 4 * 2),
    ],
)
def test_global_totals_and_dp_size(mode, expected):
    out = aggregate_loss(LOSS, MASK, mode, global_tokens=10, global_seqs=4, dp_size=2)
    assert out.item() == pytest.approx(expected)


def test_global_totals_counts_tokens_and_non_empty_rows():
    assert global_totals(MASK) == (3, 2)
    # the local default of every seq-mean mode counts the same way: the empty row does not dilute the mean
    tokens, seqs = global_totals(MASK)
    for mode in LOSS_AGG_MODES:
        local = aggregate_loss(LOSS, MASK, mode)
        assert local.item() == pytest.approx(aggregate_loss(LOSS, MASK, mode, tokens, seqs).item())


def test_width_is_verls_loss_scale_factor():
    # seq-mean-token-sum-norm: (3 + 4) / 2 sequences / W, with W = 10 instead of the width 3
    assert aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm", width=10).item() == pytest.approx(7 / 2 / 10)


def test_empty_mask_gives_zero_not_nan():
    for mode in LOSS_AGG_MODES:
        assert aggregate_loss(LOSS, torch.zeros_like(MASK), mode).item() == 0.0
    assert masked_mean(LOSS, torch.zeros_like(MASK)).item() == 0.0


def test_unknown_mode_lists_valid_modes():
    with pytest.raises(
        ConfigError, match=r"unknown loss_agg_mode 'token_mean'; valid: token-mean, token-sum"
    ):
        aggregate_loss(LOSS, MASK, "token_mean")


def test_dp_size_needs_global_totals():
    with pytest.raises(ConfigError, match="global_tokens"):
        aggregate_loss(LOSS, MASK, "token-mean", dp_size=2)
    with pytest.raises(ConfigError, match="global_seqs"):
        aggregate_loss(LOSS, MASK, "seq-mean-token-mean", global_tokens=3, dp_size=2)


def _loss_mat(theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A per-token loss that depends non-linearly on shared parameters, like a model's."""
    return (x * theta).sin() + theta.square() * x


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batches_and_dp_ranks_reproduce_whole_batch_gradient(mode):
    torch.manual_seed(0)
    batch, width = 8, 5
    x = torch.randn(batch, width)
    lengths = torch.tensor([5, 1, 3, 0, 2, 5, 4, 1])  # uneven, one empty response
    mask = (torch.arange(width) < lengths[:, None]).float()

    theta = torch.randn(width, requires_grad=True)
    aggregate_loss(_loss_mat(theta, x), mask, mode).backward()
    whole = theta.grad.clone()

    tokens, seqs = global_totals(mask)
    dp_size, micro_per_rank = 2, 2
    rank_grads = []
    for rank in range(dp_size):
        theta.grad = None
        rows = torch.arange(rank * 4, rank * 4 + 4)  # 4 rows per rank, 2 micro-batches of 2 rows
        for micro in rows.chunk(micro_per_rank):
            loss = aggregate_loss(
                _loss_mat(theta, x[micro]), mask[micro], mode, tokens, seqs, dp_size=dp_size
            )
            loss.backward()  # gradient accumulation sums micro-batch gradients
        rank_grads.append(theta.grad.clone())
    averaged = torch.stack(rank_grads).mean(dim=0)  # what the data-parallel all-reduce does
    torch.testing.assert_close(averaged, whole)


def test_local_normalisation_would_not_be_split_invariant():
    """The reason for global totals: per-micro-batch token means weight short micro-batches more."""
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    whole = aggregate_loss(x, mask, "token-mean").item()  # (1 + 2 + 3) / 3 = 2
    naive = sum(aggregate_loss(x[i : i + 1], mask[i : i + 1], "token-mean").item() for i in range(2)) / 2
    split = sum(
        aggregate_loss(x[i : i + 1], mask[i : i + 1], "token-mean", global_tokens=3).item() for i in range(2)
    )
    assert whole == pytest.approx(2.0)
    assert naive == pytest.approx((1.5 + 3.0) / 2)  # 2.25: wrong
    assert split == pytest.approx(2.0)
