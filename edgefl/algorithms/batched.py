"""Training the clients of one architecture together: one batched computation per step instead
of one client after another (what makes a 100-client round fast on a GPU).

Each client keeps its own everything: parameters, batch-norm statistics, optimizer state, data,
batch order and dropout masks. The parameters of the group are stacked along a new first
dimension, and ``torch.func.vmap`` runs one client's step (forward, loss, ``torch.func.grad``)
over the stack; the optimizer update is elementwise, so it runs on the stacked tensors directly.
The numbers are those of training the clients one after another (:func:`train_local`), within
float tolerance: the batch order comes from each client's own generator in the same sequence,
and dropout masks are drawn from a generator seeded like the one-at-a-time run's global RNG, in
the same order and shape (on the CPU, bit-identical masks; CUDA's fused dropout draws
differently, so there only the distribution matches).

A method takes part by returning a :class:`BatchPlan` from ``ClientHalf.batch_plan``: its loss
written so ``vmap`` can run it (no branch on a tensor's value), the per-client tensors the loss
reads, and what to do after each step and after training. Clients whose steps have different
batch sizes at the same step (data sets of different sizes) train in sub-groups of equal batch
size, so no padding ever changes a batch-norm statistic.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.func import grad, vmap
from torch.nn.utils.stateless import _reparametrize_module

from edgefl.algorithms.training import TrainStats
from edgefl.config import TrainSettings
from edgefl.messages import Message


class Trainee(Protocol):
    """What :func:`train_together` needs of a client half (``ClientHalf`` has it; named here
    structurally because the client half's module imports this one)."""

    model: nn.Module
    setup: Any

    def record(self, stats: TrainStats) -> None: ...

Tensors = dict[str, torch.Tensor]
#: ``loss(model, params, xb, yb, consts, extras) -> (loss, aux)``: one client's batch loss, vmap-safe
#: (``model`` computes with ``params``; a loss reading the weights themselves, a proximal term, takes them from ``params``)
LossFn = Callable[[nn.Module, Tensors, torch.Tensor, torch.Tensor, Tensors, Tensors], tuple[torch.Tensor, Tensors]]
#: ``adjust(model, params, buffers, grads, consts) -> grads``: rewrite one client's gradients (FedIN's alleviation)
AdjustFn = Callable[[nn.Module, Tensors, Tensors, Tensors, Tensors], Tensors]


@dataclass
class BatchPlan:
    """One client's part in a batched round (built by ``ClientHalf.batch_plan``)."""

    key: tuple  # clients with equal keys (and architecture and training settings) train together
    generator: torch.Generator  # the client's batch order (and its per-step draws), as its one-at-a-time fit uses it
    dropout_seed: int  # the global RNG seed the one-at-a-time fit sets (its dropout masks)
    loss: LossFn
    finish: Callable[[], Message]  # the upload, once the trained weights are back in the model
    consts: Tensors = field(default_factory=dict)  # per-client tensors the loss reads (same shapes across the group)
    step_extras: Callable[[torch.Tensor], Tensors] | None = None  # per-step draws from ``generator``, given the batch's labels
    on_step: Callable[[Tensors, torch.Tensor], None] | None = None  # after each step: the loss's aux outputs and the labels
    adjust: AdjustFn | None = None


class NotBatchable(Exception):
    """This group cannot train as one computation (the reason is logged once, then one at a time)."""


def _schedule(n: int, cfg: TrainSettings, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """The batch indices :func:`~edgefl.algorithms.training.train_local` would use, drawn from
    ``generator`` at the same moments (each epoch's permutation when the epoch starts)."""
    steps = 0
    for _ in range(cfg.epochs):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, cfg.batch_size):
            idx = order[start : start + cfg.batch_size]
            if len(idx) < 2 and n >= 2:
                continue  # as train_local: batch-norm cannot train on a single sample
            yield idx
            steps += 1
            if cfg.max_steps is not None and steps >= cfg.max_steps:
                return


class _Masks:
    """Dropout inside the vmapped step: each ``nn.Dropout`` multiplies by the next mask given."""

    def __init__(self) -> None:
        self.queue: list[torch.Tensor] = []

    @contextmanager
    def patched(self, modules: list[nn.Dropout]):
        def forward(module: nn.Dropout, x: torch.Tensor) -> torch.Tensor:
            return x * self.queue.pop(0) if module.p > 0 else x  # p = 0 draws nothing, as F.dropout

        saved = [m.forward for m in modules]
        for m in modules:
            m.forward = forward.__get__(m)  # type: ignore[method-assign]
        try:
            yield
        finally:
            for m, f in zip(modules, saved):
                m.forward = f  # type: ignore[method-assign]


def _check_structure(base: nn.Module) -> list[nn.Dropout]:
    """The model's dropout layers; NotBatchable for random layers other than plain dropout."""
    dropouts: list[nn.Dropout] = []
    for name, m in base.named_modules():
        if type(m) is nn.Dropout:
            dropouts.append(m)
        elif isinstance(m, nn.modules.dropout._DropoutNd) or isinstance(m, nn.RReLU):
            raise NotBatchable(f"{type(m).__name__} ({name}) draws randomness the batched step cannot reproduce")
    return dropouts


class _Adam:
    """torch.optim.Adam's update (L2 weight decay, no amsgrad) on stacked parameters, rows = clients."""

    def __init__(self, params: Tensors, cfg: TrainSettings, n: int) -> None:
        self.cfg = cfg
        self.m = {k: torch.zeros_like(v) for k, v in params.items()}
        self.v = {k: torch.zeros_like(v) for k, v in params.items()}
        self.steps = torch.zeros(n, dtype=torch.float64, device=next(iter(params.values())).device)

    def step(self, params: Tensors, grads: Tensors, rows: torch.Tensor) -> None:
        cfg, beta1, beta2, eps = self.cfg, 0.9, 0.999, 1e-8
        self.steps[rows] += 1
        t = self.steps[rows]
        bc1 = (1 - beta1 ** t)
        bc2_sqrt = (1 - beta2 ** t).sqrt()
        for k, g in grads.items():
            p = params[k][rows]
            shape = (-1,) + (1,) * (p.dim() - 1)
            if cfg.weight_decay:
                g = g + cfg.weight_decay * p
            m = self.m[k][rows].lerp_(g, 1 - beta1)
            v = self.v[k][rows].mul_(beta2).addcmul_(g, g, value=1 - beta2)
            step_size = (cfg.lr / bc1).to(p.dtype).view(shape)
            denom = (v.sqrt() / bc2_sqrt.to(p.dtype).view(shape)).add_(eps)
            params[k][rows] = p - step_size * m / denom
            self.m[k][rows], self.v[k][rows] = m, v


class _SGD:
    """torch.optim.SGD's update (momentum without dampening or Nesterov, L2 weight decay)."""

    def __init__(self, params: Tensors, cfg: TrainSettings, n: int) -> None:
        self.cfg = cfg
        self.buf = {k: torch.zeros_like(v) for k, v in params.items()}
        self.started = torch.zeros(n, dtype=torch.bool, device=next(iter(params.values())).device)

    def step(self, params: Tensors, grads: Tensors, rows: torch.Tensor) -> None:
        cfg = self.cfg
        first = ~self.started[rows]
        self.started[rows] = True
        for k, g in grads.items():
            p = params[k][rows]
            if cfg.weight_decay:
                g = g + cfg.weight_decay * p
            if cfg.momentum:
                shape = (-1,) + (1,) * (p.dim() - 1)
                old = self.buf[k][rows]
                b = torch.where(first.view(shape), g, old * cfg.momentum + g)
                self.buf[k][rows] = b
                g = b
            params[k][rows] = p - cfg.lr * g


def train_together(clients: list[Trainee], plans: list[BatchPlan], train: TrainSettings | None = None) -> list[Message]:
    """Train ``clients`` (one architecture, one method, one training setting; their plans share a
    key) as one batched computation; returns their uploads in order. ``train``: the round's
    settings (the learning rate its schedule gives; default the first client's). Raises
    NotBatchable before touching any client when the model cannot be batched."""
    first = clients[0]
    cfg = train or first.setup.train
    base = copy.deepcopy(first.model)
    dropouts = _check_structure(base)
    base.train()
    names = [k for k, p in first.model.named_parameters() if p.requires_grad]
    fixed = [k for k, p in first.model.named_parameters() if not p.requires_grad]
    n = len(clients)
    models = [c.model for c in clients]
    for c in clients:
        c.model.train()
    # each model's tables walked once: walking them per tensor name cost seconds a round for 100 ResNets
    own_params = [dict(m.named_parameters()) for m in models]
    own_states = [_state_table(m, fixed) for m in models]
    params = {k: torch.stack([own[k].detach() for own in own_params]) for k in names}
    state_names = [k for k, _ in first.model.named_buffers()] + fixed  # moved by the forward (batch norm) or fixed
    buffers = {k: torch.stack([own[k].detach() for own in own_states]) for k in state_names}
    consts = {k: torch.stack([p.consts[k] for p in plans]) for k in plans[0].consts}
    optimizer = _Adam(params, cfg, n) if cfg.optimizer == "adam" else _SGD(params, cfg, n)
    masks = _Masks()
    plan0 = plans[0]

    def one_client(p: Tensors, b: Tensors, c: Tensors, xb: torch.Tensor, yb: torch.Tensor, extras: Tensors,
                   drop: list[torch.Tensor]) -> tuple[Tensors, torch.Tensor, Tensors]:
        # the statistics are an argument of the transformed function: batch norm updates them in place
        def loss_of(q: Tensors, stats: Tensors) -> tuple[torch.Tensor, tuple[torch.Tensor, Tensors]]:
            masks.queue = list(drop)
            with _reparametrize_module(base, {**q, **stats}), masks.patched(dropouts):
                loss, aux = plan0.loss(base, q, xb, yb, c, extras)
            return loss, (loss.detach(), {k: v.detach() for k, v in aux.items()})

        grads, (loss, aux) = grad(loss_of, has_aux=True)(p, b)
        if plan0.adjust is not None:
            grads = plan0.adjust(base, p, b, grads, c)
        return grads, loss, aux

    step = vmap(one_client, randomness="error")
    calls: dict[int, list[tuple[tuple[int, ...], float]]] = {}  # per batch size: (input shape, p) of each dropout call, in call order

    def dropout_calls(xb: torch.Tensor) -> list[tuple[tuple[int, ...], float]]:
        size = len(xb)
        if size not in calls:
            seen: list[tuple[tuple[int, ...], float]] = []
            probe = copy.deepcopy(base)
            hooks = [m.register_forward_hook(lambda mod, inp, out: seen.append((tuple(inp[0].shape), mod.p)))
                     for m in probe.modules() if type(m) is nn.Dropout and m.p > 0]
            with torch.no_grad():
                probe.eval()(xb)  # eval: only the shapes matter, and no statistics move
            for h in hooks:
                h.remove()
            calls[size] = seen
        return calls[size]

    rngs = [torch.Generator().manual_seed(p.dropout_seed) for p in plans]
    schedules = [_schedule(len(c.setup.y), cfg, p.generator) for c, p in zip(clients, plans)]
    live = list(range(n))
    steps, samples, loss_sum = [0] * n, [0] * n, [0.0] * n
    while live:
        batches: dict[int, list[tuple[int, torch.Tensor, Tensors]]] = {}
        for i in list(live):
            idx = next(schedules[i], None)
            if idx is None:
                live.remove(i)
                continue
            yb = clients[i].setup.y[idx]
            extras = plans[i].step_extras(yb) if plans[i].step_extras else {}
            batches.setdefault(len(idx), []).append((i, idx, extras))
        for size, group in sorted(batches.items()):
            rows = torch.tensor([i for i, _, _ in group])
            xb = torch.stack([clients[i].setup.x[idx] for i, idx, _ in group])
            yb = torch.stack([clients[i].setup.y[idx] for i, idx, _ in group])
            extras = {k: torch.stack([e[k] for _, _, e in group]) for k in group[0][2]}
            drop: list[torch.Tensor] = []
            if any(d.p > 0 for d in dropouts):  # each client's masks, in its forward's call order, from its own generator
                per = [[torch.empty(shape).bernoulli_(1 - p, generator=rngs[i]).div_(1 - p).to(xb.device)
                        for shape, p in dropout_calls(xb[0])] for i, _, _ in group]
                drop = [torch.stack([per[j][call] for j in range(len(group))]) for call in range(len(per[0]))]
            dev_rows = rows.to(xb.device)
            sub_b = {k: v[dev_rows] for k, v in buffers.items()}
            sub_c = {k: v[dev_rows] for k, v in consts.items()}
            grads, loss, aux = step({k: v[dev_rows] for k, v in params.items()}, sub_b, sub_c, xb, yb, extras, drop)
            optimizer.step(params, grads, dev_rows)
            for k, v in sub_b.items():  # batch-norm statistics the forward moved (in place, per client)
                buffers[k][dev_rows] = v
            losses = loss.tolist()
            for j, (i, _idx, _) in enumerate(group):
                steps[i] += 1
                samples[i] += size
                loss_sum[i] += losses[j] * size
                if plans[i].on_step is not None:
                    plans[i].on_step({k: v[j] for k, v in aux.items()}, yb[j])
    with torch.no_grad():
        for i in range(n):
            for k in names:
                own_params[i][k].copy_(params[k][i])
            for k in buffers:
                own_states[i][k].copy_(buffers[k][i])
    out = []
    for i, (client, plan) in enumerate(zip(clients, plans)):
        client.record(TrainStats(steps[i], samples[i], loss_sum[i] / max(samples[i], 1)))
        out.append(plan.finish())
    return out


def _state_table(model: nn.Module, fixed: list[str]) -> Tensors:
    """A model's buffers and its frozen parameters, by name."""
    return {**dict(model.named_buffers()), **{k: p for k, p in model.named_parameters() if k in fixed}}


def describe(model: nn.Module) -> tuple:
    """What must match for two models to share a batched step: names and shapes of their state."""
    return tuple((k, tuple(v.shape), v.dtype) for k, v in model.state_dict().items())

