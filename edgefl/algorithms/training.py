"""The local training loop every client half uses, and evaluation.

Batches are drawn from in-memory tensors with a seeded ``torch.Generator`` rather than a
``DataLoader``: the client datasets are small tensors already, worker processes would only add
start-up time on a 2-core device, and one generator makes the order reproducible.

With ``train.dp_sgd`` set the same loop runs DP-SGD through Opacus (:func:`_train_dp_sgd`):
per-sample gradients (``GradSampleModule``), clipping and seeded Gaussian noise (``DPOptimizer``
around the usual optimizer) and Poisson-sampled batches (the sampler of Opacus' ``DPDataLoader``,
indexing the in-memory tensors as above); :mod:`edgefl.privacy.dp_sgd` accounts for it.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
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


@dataclass
class DPNoise:
    """What a DP-SGD round needs beside ``train.dp_sgd``: the device's noise multiplier (given or
    derived from its target epsilon) and the round's seeded noise generator
    (:func:`edgefl.privacy.dp_sgd.noise_generator`)."""

    noise_multiplier: float
    generator: torch.Generator


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
    dp: DPNoise | None = None,
) -> TrainStats:
    """Run ``cfg.epochs`` epochs (capped at ``cfg.max_steps`` batches) of ``loss_fn(xb, yb, *extras_b)``.

    ``extras`` are per-sample tensors (e.g. fixed teacher logits) batched alongside the data.
    ``after_backward`` may rewrite the gradients before the optimizer step (FedIN's gradient
    alleviation); ``after_step`` runs after it (FedIN's sequential ablation). With
    ``cfg.dp_sgd`` the steps are DP-SGD's (``dp`` gives the noise; ``loss_fn`` must be the mean
    of per-sample terms, and no hook may touch the gradients: the client halves that need one
    are refused before the run).
    """
    if cfg.dp_sgd is not None:
        if dp is None:
            raise ValueError("train.dp_sgd is set: DP-SGD needs the device's noise multiplier and noise generator (dp=DPNoise(...))")
        if optimizer is not None or after_backward is not None or after_step is not None:
            raise ValueError("DP-SGD clips and noises per-sample gradients inside its optimizer: it takes no optimizer of the "
                             "caller's and no hook that rewrites gradients or steps again")
        return _train_dp_sgd(model, x, y, cfg, generator, loss_fn, extras, dp)
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


def _dp_batches(n: int, cfg: TrainSettings, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Each DP-SGD step's sample indices: Poisson sampling (every sample joins with probability
    q = batch / samples, so a batch may be empty) through Opacus' ``UniformWithReplacementSampler``
    for 1 / q steps an epoch, or, with ``poisson = false``, plain training's shuffled batches."""
    from edgefl.privacy.dp_sgd import sample_rate, steps_per_epoch

    if cfg.dp_sgd.poisson:
        from opacus.utils.uniform_sampler import UniformWithReplacementSampler

        q, steps = sample_rate(n, cfg.batch_size), steps_per_epoch(n, cfg)
        for _ in range(cfg.epochs):
            for idx in UniformWithReplacementSampler(num_samples=n, sample_rate=q, generator=generator, steps=steps):
                yield torch.tensor(idx, dtype=torch.long)
        return
    for _ in range(cfg.epochs):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, cfg.batch_size):
            idx = order[start : start + cfg.batch_size]
            if len(idx) < 2 and n >= 2:
                continue  # as plain training, so that the two take the same batches
            yield idx


@contextlib.contextmanager
def _out_of_place(model: nn.Module) -> Iterator[None]:
    """In-place activations (``ReLU(inplace=True)``) run out of place while Opacus' hooks are on:
    its backward hooks forbid modifying a hooked layer's output in place. Same values."""
    switched = [m for m in model.modules() if getattr(m, "inplace", None) is True]
    for m in switched:
        m.inplace = False
    try:
        yield
    finally:
        for m in switched:
            m.inplace = True


def _train_dp_sgd(model: nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: TrainSettings, generator: torch.Generator,
                  loss_fn: Callable[..., torch.Tensor], extras: tuple[torch.Tensor, ...], dp: DPNoise) -> TrainStats:
    """:func:`train_local` as DP-SGD: Opacus computes each sample's gradient (``GradSampleModule``
    hooks on the model's layers; ``loss_fn`` keeps calling the model itself), ``DPOptimizer``
    clips each to ``max_grad_norm``, sums, adds N(0, (z max_grad_norm)^2) from ``dp.generator``,
    divides by the expected batch size and steps the run's optimizer. A Poisson batch that came out
    empty still takes its step (noise alone), as the accountant counts it."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    from edgefl.privacy.dp_sgd import sample_rate

    settings = cfg.dp_sgd
    n = len(y)
    expected = max(1, round(sample_rate(n, cfg.batch_size) * n))
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    steps, samples, loss_sum = 0, 0, 0.0
    with _out_of_place(model), warnings.catch_warnings():
        # the first layer's input needs no gradient: torch says its full backward hook fires on the output alone
        warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)
        hooks = GradSampleModule(model, batch_first=True, loss_reduction="mean", strict=True)
        try:
            opt = DPOptimizer(make_optimizer(model.parameters(), cfg), noise_multiplier=dp.noise_multiplier,
                              max_grad_norm=settings.max_grad_norm, expected_batch_size=expected, loss_reduction="mean",
                              generator=dp.generator)
            for idx in _dp_batches(n, cfg, generator):
                if not settings.poisson:
                    opt.expected_batch_size = len(idx)  # fixed batches: divide by the batch's own (public) size
                opt.zero_grad(set_to_none=True)
                if len(idx):
                    loss = loss_fn(x[idx], y[idx], *(e[idx] for e in extras))
                    loss.backward()
                    loss_sum += float(loss.detach()) * len(idx)
                else:  # no sample drawn: no forward, the step adds its noise to a zero sum
                    for p in trainable:
                        p.grad_sample = p.new_zeros((0, *p.shape))
                opt.step()
                steps += 1
                samples += len(idx)
                if cfg.max_steps is not None and steps >= cfg.max_steps:
                    break
        finally:
            hooks.cleanup()  # hooks off, grad_sample and counters gone: the model is a plain module again
            for p in model.parameters():
                if hasattr(p, "summed_grad"):
                    del p.summed_grad
            for m in model.modules():
                if hasattr(m, "activations"):
                    del m.activations  # left by a step that failed between forward and backward
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
