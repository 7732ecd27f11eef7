"""Distillation from a teacher that shares the student's tokenizer: the per-token losses and advantages.

* `generalized_jsd`: GKD's divergence between the teacher's and the student's whole next-token
  distributions (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
  Self-Generated Mistakes"), with `beta` as TRL's GKDTrainer defines it (0 = forward KL, 1 = reverse KL).
* `reverse_kl_advantages`: on-policy distillation in the RL loop (Gu et al. 2024, MiniLLM; Agarwal et al.
  2024; tinker-cookbook's on-policy distillation): the sampled-token estimate of the reverse KL,
  log p_student(x_t) - log p_teacher(x_t), as a negative per-token advantage.

Pure: tensors in, tensors out. Must not import engine, rollout, workers, Ray or data.batch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last dimension, from log-probabilities (0 * log 0 counts 0)."""
    p = p_log.exp()
    return torch.where(p > 0, p * (p_log - q_log), torch.zeros_like(p)).sum(-1)


def generalized_jsd(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    beta: float = 0.5,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Generalised Jensen-Shannon divergence per position (..., V) -> (...), over the full vocabulary.

    With S = softmax(student_logits / T), P = softmax(teacher_logits / T) and the mixture
    M = beta * P + (1 - beta) * S:

        JSD_beta = beta * KL(P || M) + (1 - beta) * KL(S || M)     for 0 < beta < 1,
        JSD_0 = KL(P || S)  (forward KL),     JSD_1 = KL(S || P)  (reverse KL),

    the end points being the limits of JSD_beta / beta (beta -> 0) and JSD_beta / (1 - beta) (beta -> 1):
    TRL GKDTrainer's definition (Agarwal et al. 2024, GKD, eq. 5). Gradients flow into both arguments;
    detach the teacher's. Computed in float32 at least.
    """
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"generalized_jsd: student logits {tuple(student_logits.shape)} and teacher logits "
            f"{tuple(teacher_logits.shape)} differ in shape"
        )
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"generalized_jsd: beta must be in [0, 1], got {beta}")
    if temperature <= 0:
        raise ValueError(f"generalized_jsd: temperature must be > 0, got {temperature}")
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    s_log = F.log_softmax(student_logits.to(dtype) / temperature, dim=-1)
    t_log = F.log_softmax(teacher_logits.to(dtype) / temperature, dim=-1)
    if beta == 0.0:
        return _kl(t_log, s_log)
    if beta == 1.0:
        return _kl(s_log, t_log)
    m_log = torch.logsumexp(torch.stack([t_log + math.log(beta), s_log + math.log(1.0 - beta)]), dim=0)
    return beta * _kl(t_log, m_log) + (1.0 - beta) * _kl(s_log, m_log)


def reverse_kl_advantages(
    student_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, reverse_kl), both (B, R): reverse_kl_t = log p_student(x_t) - log p_teacher(x_t) of the
    sampled token x_t ~ p_student (an unbiased per-token estimate of KL(student || teacher)), and
    A_t = -kl_coef * reverse_kl_t, zero outside `response_mask` (MiniLLM, Gu et al. 2024; GKD, Agarwal et
    al. 2024; tinker-cookbook's on-policy distillation: no discount, no baseline)."""
    mask = response_mask.to(student_log_probs.dtype)
    reverse_kl = (student_log_probs - teacher_log_probs) * mask
    return -kl_coef * reverse_kl, reverse_kl
