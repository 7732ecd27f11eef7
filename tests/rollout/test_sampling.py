"""Sampling helpers: truncation sets and the log-prob convention (full distribution at temperature T)."""

from __future__ import annotations

import math

import torch

from posttrain.rollout.sampling import draw, sample_tokens, truncate_logits


def test_top_k_keeps_the_k_largest() -> None:
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0]])
    kept = torch.isfinite(truncate_logits(logits, top_k=2, top_p=1.0))
    assert kept.tolist() == [[False, True, True, False]]


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = torch.isfinite(truncate_logits(probs.log(), top_k=0, top_p=0.75))
    # 0.5 < 0.75, 0.5 + 0.3 >= 0.75: the first two stay
    assert kept.tolist() == [[True, True, False, False]]


def test_log_prob_is_of_the_tempered_full_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    tokens, log_probs = sample_tokens(logits, temperature=0.5, top_k=1)
    assert tokens.item() == 0
    z = [4.0, 2.0, 0.0]
    expected = 4.0 - math.log(sum(math.exp(v) for v in z))
    assert abs(log_probs.item() - expected) < 1e-6


def test_greedy_reports_untempered_log_prob() -> None:
    logits = torch.tensor([[0.0, math.log(3.0)]])
    tokens, log_probs = sample_tokens(logits, temperature=0.0)
    assert tokens.item() == 1
    assert abs(log_probs.item() - math.log(0.75)) < 1e-6


def test_draw_follows_the_distribution_and_never_draws_a_truncated_token() -> None:
    """200k draws from one row: every frequency within 5 standard errors of its probability (a flake
    would need a 5-sigma event; the generator is seeded anyway), zero-probability tokens never drawn."""
    probs = torch.tensor([0.0, 0.5, 0.0, 0.25, 0.125, 0.0625, 0.0625 - 1e-6, 1e-6, 0.0])
    n = 200_000
    tokens = draw(probs.expand(n, -1), torch.Generator().manual_seed(0))
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    assert counts[probs == 0].sum() == 0
    se = (probs.double() * (1 - probs.double()) / n).sqrt()
    assert ((counts / n - probs.double()).abs() <= 5 * se + 1e-12).all(), (counts / n).tolist()


def test_draw_at_the_top_of_the_unit_interval_takes_the_last_possible_token(monkeypatch) -> None:
    """u just below 1 (rounded up, u * total could reach the total): the last token with mass, not one past
    the vocabulary nor a truncated token after it; u = 0: the first token with mass."""

    def constant(value: float):
        return lambda shape, **kw: torch.full(shape, value, dtype=kw["dtype"])

    monkeypatch.setattr(torch, "rand", constant(1 - 2**-53))
    assert draw(torch.tensor([[0.3, 0.7, 0.0, 0.0]])).tolist() == [1]
    monkeypatch.setattr(torch, "rand", constant(0.0))
    assert draw(torch.tensor([[0.0, 0.4, 0.6]])).tolist() == [1]
