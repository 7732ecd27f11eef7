"""Chunked log-prob/entropy computation equals the direct one, in value and in gradient."""

from __future__ import annotations

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
