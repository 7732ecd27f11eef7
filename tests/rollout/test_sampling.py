"""Sampling helpers: truncation sets and the log-prob convention (full distribution at temperature T)."""

from __future__ import annotations

import math

import torch

from posttrain.rollout.sampling import sample_tokens, truncate_logits


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
