"""Chunked log-prob/entropy computation equals the direct one, in value and in gradient."""

from __future__ import annotations

import math

import torch

from posttrain.engine.log_probs import chunked_log_probs_and_entropy, entropy_from_logits, token_log_probs


def test_chunked_equals_direct_with_gradients() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=gen, requires_grad=True)
    targets = torch.randint(0, 11, (3, 7), generator=gen)
    lp, ent = chunked_log_probs_and_entropy(logits, targets, chunk_tokens=4)
    (lp.sum() + 0.3 * ent.sum()).backward()
    chunked_grad = logits.grad.clone()
    logits.grad = None
    direct_lp, direct_ent = token_log_probs(logits, targets), entropy_from_logits(logits)
    (direct_lp.sum() + 0.3 * direct_ent.sum()).backward()
    torch.testing.assert_close(lp, direct_lp)
    torch.testing.assert_close(ent, direct_ent)
    torch.testing.assert_close(chunked_grad, logits.grad)


def test_entropy_of_uniform_is_log_vocab() -> None:
    ent = entropy_from_logits(torch.zeros(1, 1, 8))
    assert abs(ent.item() - torch.log(torch.tensor(8.0)).item()) < 1e-6


def test_float64_stays_float64_and_low_precision_is_upcast() -> None:
    # logits [0, log 2, log 5] (softmax [1/8, 2/8, 5/8]) in float64: exact to float64 precision
    logits = torch.tensor([[[0.0, 0.6931471805599453, 1.6094379124341003]]], dtype=torch.float64)
    lp = token_log_probs(logits, torch.tensor([[2]]))
    assert lp.dtype == torch.float64
    assert abs(lp.item() - math.log(5 / 8)) < 1e-15
    ent = entropy_from_logits(logits)
    probs = (1 / 8, 2 / 8, 5 / 8)
    assert ent.dtype == torch.float64 and abs(ent.item() + sum(p * math.log(p) for p in probs)) < 1e-15
    chunked_lp, chunked_ent = chunked_log_probs_and_entropy(logits, torch.tensor([[2]]))
    assert chunked_lp.dtype == chunked_ent.dtype == torch.float64
    assert token_log_probs(logits.bfloat16(), torch.tensor([[2]])).dtype == torch.float32
