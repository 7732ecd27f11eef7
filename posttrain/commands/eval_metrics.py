"""Evaluation metrics over n samples per prompt: accuracy, mean reward, pass@k. Pure functions, no I/O.

A sample is correct when its score is >= 1, as the trainer's `val/acc` defines it.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import comb

CORRECT_SCORE = 1.0


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from n samples of which c are correct (Chen et al. 2021, "Evaluating
    Large Language Models Trained on Code", eq. 1): 1 - C(n-c, k) / C(n, k).

    Exact integer binomials (no overflow, no float cancellation for large n)."""
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def summarize(
    scores: Sequence[Sequence[float]], ks: Sequence[int], data_sources: Sequence[str] | None = None
) -> dict[str, float | int | dict]:
    """Metrics of `scores[prompt][sample]` (every prompt with the same number n of samples).

    `accuracy`: share of correct samples (= mean pass@1); `mean_reward`: mean score; `pass@k` for each k
    in `ks` (k <= n), averaged over prompts; `by_data_source`: the same per data source when given."""
    if not scores:
        raise ValueError("summarize: no prompts")
    n = len(scores[0])
    if any(len(row) != n for row in scores):
        raise ValueError("summarize: every prompt needs the same number of samples")
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ValueError(f"pass@k: k must be in [1, n={n}], got {bad}")
    flat = [s for row in scores for s in row]
    out: dict[str, float | int | dict] = {
        "n_prompts": len(scores),
        "n_samples_per_prompt": n,
        "accuracy": sum(s >= CORRECT_SCORE for s in flat) / len(flat),
        "mean_reward": sum(flat) / len(flat),
    }
    for k in ks:
        correct = [sum(s >= CORRECT_SCORE for s in row) for row in scores]
        out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in correct) / len(scores)
    if data_sources is not None:
        groups: dict[str, list[Sequence[float]]] = {}
        for source, row in zip(data_sources, scores, strict=True):
            groups.setdefault(source, []).append(row)
        if len(groups) > 1:
            out["by_data_source"] = {source: summarize(rows, ks) for source, rows in sorted(groups.items())}
    return out
