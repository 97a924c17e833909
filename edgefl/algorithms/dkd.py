"""Decoupled knowledge distillation (Zhao et al., CVPR 2022) and CHFL's temperature schedule.

DKD splits the softened prediction into

* TCKD: the binary distribution (target class, all other classes), and
* NCKD: the distribution over the non-target classes, computed with the target logit masked out,

and distils each with KL(teacher || student), scaled by T^2 so gradients keep their size as T
changes. CHFL (paper 004, Eq. 6) weights both parts by one ``alpha``.
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

_MASK = 1000.0  # subtracted from the target logit so it vanishes from the non-target softmax


def tckd_nckd(student: torch.Tensor, teacher: torch.Tensor, target: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The two DKD terms, each averaged over the batch and scaled by T^2."""
    t = temperature
    gt = F.one_hot(target, student.shape[1]).to(student.dtype)
    p_s = F.softmax(student / t, dim=1)
    p_t = F.softmax(teacher / t, dim=1)
    b_s = torch.stack([(p_s * gt).sum(1), (p_s * (1 - gt)).sum(1)], dim=1)
    b_t = torch.stack([(p_t * gt).sum(1), (p_t * (1 - gt)).sum(1)], dim=1)
    tckd = F.kl_div(torch.log(b_s.clamp_min(1e-12)), b_t, reduction="batchmean") * t * t
    log_q_s = F.log_softmax(student / t - _MASK * gt, dim=1)
    q_t = F.softmax(teacher / t - _MASK * gt, dim=1)
    nckd = F.kl_div(log_q_s, q_t, reduction="batchmean") * t * t
    return tckd, nckd


def dkd_loss(student: torch.Tensor, teacher: torch.Tensor, target: torch.Tensor, temperature: float, alpha: float) -> torch.Tensor:
    """CHFL's DKD: ``alpha * (TCKD + NCKD)``; the teacher carries no gradient."""
    tckd, nckd = tckd_nckd(student, teacher.detach(), target, temperature)
    return alpha * (tckd + nckd)


def chfl_temperature(epoch: int, epochs: int, beta: float) -> float:
    """``beta * (1 + cos(pi * epoch / epochs)) + 1``: 2*beta + 1 at epoch 0, 1 at the last epoch."""
    return beta * (1 + math.cos(math.pi * epoch / epochs)) + 1
