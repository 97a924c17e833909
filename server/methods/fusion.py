"""Knowledge fusion on a synthetic set (FedMHO Eq. 5-8, ensemble distillation, FedCVAE's
from-scratch training).

The teachers are fixed, so their logits are computed once over the whole synthetic set and
batched alongside it; the student then trains with Adam on
``lam * CE(student, y) + (1 - lam) * KL(softmax(teacher) || softmax(student))``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from edgefl.compute import resolve_device


def kl_to_teacher(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(p_teacher || p_student) averaged over the batch (temperature 1, as in the paper)."""
    return F.kl_div(F.log_softmax(student_logits, 1), F.log_softmax(teacher_logits, 1), reduction="batchmean", log_target=True)


def fusion_loss(student_logits: torch.Tensor, y: torch.Tensor, teacher_logits: torch.Tensor | None, lam: float,
                reading: str = "paper") -> torch.Tensor:
    """Eq. 8: lam * CE + (1 - lam) * KL; plain CE (Eq. 5) when there is no teacher or lam = 1.
    ``reading = "authors-code"``: CE + KL / C, what the FedMHO authors' code computes with
    ``nn.KLDivLoss()`` (its default ``reduction="mean"`` averages over batch and classes)."""
    ce = F.cross_entropy(student_logits, y)
    if teacher_logits is None:
        return ce
    if reading == "authors-code":
        return ce + kl_to_teacher(student_logits, teacher_logits) / student_logits.shape[1]
    if lam >= 1.0:
        return ce
    return lam * ce + (1.0 - lam) * kl_to_teacher(student_logits, teacher_logits)


@torch.no_grad()
def mean_logits(models: list[nn.Module], x: torch.Tensor, device: torch.device, batch: int = 500) -> torch.Tensor:
    """The teachers' mean logits over ``x`` (eval mode), on the CPU."""
    out = []
    for start in range(0, len(x), batch):
        xb = x[start : start + batch].to(device)
        acc = None
        for m in models:
            m.to(device).eval()
            logits = m(xb).float()
            acc = logits if acc is None else acc + logits
        out.append((acc / len(models)).cpu())
    return torch.cat(out)


@dataclass
class FusionStats:
    epochs: int
    steps: int
    first_loss: float
    last_loss: float


def train_on_synthetic(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    teacher_logits: torch.Tensor | None,
    lam: float,
    *,
    epochs: int,
    lr: float,
    batch_size: int,
    generator: torch.Generator,
    device: torch.device,
    reading: str = "paper",
) -> FusionStats:
    """Adam on the synthetic set; ``lam = 0`` with teachers is pure distillation (ensemble
    distillation), ``teacher_logits = None`` plain cross-entropy."""
    model.to(device).train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    steps, first, last = 0, float("nan"), float("nan")
    for epoch in range(epochs):
        order = torch.randperm(len(y), generator=generator)
        total, seen = 0.0, 0
        for start in range(0, len(y), batch_size):
            idx = order[start : start + batch_size]
            xb, yb = x[idx].to(device), y[idx].to(device)
            tb = teacher_logits[idx].to(device) if teacher_logits is not None else None
            opt.zero_grad(set_to_none=True)
            loss = fusion_loss(model(xb), yb, tb, lam, reading)
            loss.backward()
            opt.step()
            steps += 1
            total += float(loss.detach()) * len(idx)
            seen += len(idx)
        mean = total / max(seen, 1)
        if epoch == 0:
            first = mean
        last = mean
    model.eval()
    return FusionStats(epochs, steps, first, last)


def pick_device(choice: str) -> torch.device:
    """The server half's device (``auto``: CUDA when present; :func:`edgefl.compute.resolve_device`)."""
    return resolve_device(choice)
