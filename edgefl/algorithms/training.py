"""The local training loop every client half uses, and evaluation.

Batches are drawn from in-memory tensors with a seeded ``torch.Generator`` rather than a
``DataLoader``: the client datasets are small tensors already, worker processes would only add
start-up time on a 2-core device, and one generator makes the order reproducible.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from edgefl.config import TrainSettings


@dataclass
class TrainStats:
    steps: int
    samples: int
    mean_loss: float


def make_optimizer(params, cfg: TrainSettings) -> torch.optim.Optimizer:
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def train_local(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: TrainSettings,
    generator: torch.Generator,
    loss_fn: Callable[..., torch.Tensor],
    optimizer: torch.optim.Optimizer | None = None,
    extras: tuple[torch.Tensor, ...] = (),
    after_backward: Callable[[], None] | None = None,
    after_step: Callable[[], None] | None = None,
) -> TrainStats:
    """Run ``cfg.epochs`` epochs (capped at ``cfg.max_steps`` batches) of ``loss_fn(xb, yb, *extras_b)``.

    ``extras`` are per-sample tensors (e.g. fixed teacher logits) batched alongside the data.
    ``after_backward`` may rewrite the gradients before the optimizer step (FedIN's gradient
    alleviation); ``after_step`` runs after it (FedIN's sequential ablation).
    """
    model.train()
    opt = optimizer or make_optimizer(model.parameters(), cfg)
    n = len(y)
    steps, samples, loss_sum = 0, 0, 0.0
    for _ in range(cfg.epochs):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, cfg.batch_size):
            idx = order[start : start + cfg.batch_size]
            if len(idx) < 2 and n >= 2:
                continue  # batch-norm cannot train on a single sample
            xb, yb = x[idx], y[idx]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(xb, yb, *(e[idx] for e in extras))
            loss.backward()
            if after_backward is not None:
                after_backward()
            opt.step()
            if after_step is not None:
                after_step()
            steps += 1
            samples += len(idx)
            loss_sum += float(loss.detach()) * len(idx)
            if cfg.max_steps is not None and steps >= cfg.max_steps:
                return TrainStats(steps, samples, loss_sum / max(samples, 1))
    return TrainStats(steps, samples, loss_sum / max(samples, 1))


@torch.no_grad()
def evaluate_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1000) -> float:
    """Top-1 accuracy in eval mode."""
    was_training = model.training
    model.eval()
    device = next(iter(model.parameters()), torch.empty(0)).device  # the shared test set stays on the CPU
    correct = 0
    for start in range(0, len(y), batch_size):
        xb, yb = x[start : start + batch_size].to(device), y[start : start + batch_size].to(device)
        correct += int((model(xb).argmax(1) == yb).sum())
    model.train(was_training)
    return correct / max(len(y), 1)
