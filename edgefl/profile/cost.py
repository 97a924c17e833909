"""A cost model for training a zoo model on a device, and the budget -> architecture rule.

Time per round: ``3 x forward FLOPs x samples x epochs / effective FLOP/s`` (backward costs about
twice the forward pass, as FedScale assumes; torch's counter measured 2.96x), plus, when the
profile has measured them, ``steps x operators x per-operator overhead`` (the dispatch cost that
dominates small models; operators are the aten operators the forward pass runs) and ``steps x params x per-parameter cost`` (zeroing gradients and the
optimizer's update stream every parameter through memory several times: it dominates models
whose parameters outweigh their arithmetic, like VGG-9's 51 M-parameter FC layer), plus the
model's upload and download at the profile's bandwidth.
Memory: ``params x (4 weights + 4 gradients + optimizer state)`` plus the activations autograd
keeps for a batch (measured once per model by counting the bytes of every new tensor the
training forward pass creates per sample), scaled by the profile's activation factor when known (autograd also keeps some
inputs, and kernels take workspace), plus the profile's per-step overhead when known. Storage:
the parameter bytes. ``edgefl device-profile`` fits the overhead terms from the models it
measures.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from edgefl.models import build_model, example_inputs, model_info
from edgefl.profile.schema import DeviceProfile

OPTIMIZER_STATE_BYTES = {"sgd": 0, "momentum": 4, "adam": 8}


@lru_cache(maxsize=128)
def activation_bytes_per_sample(name: str, frozen_options: tuple, input_shape: tuple[int, ...], num_classes: int) -> int:
    """Bytes of new tensors the forward pass creates for one sample: what autograd keeps and
    what memory-bound kernels stream."""
    return _forward_stats(name, frozen_options, input_shape, num_classes)[0]


@lru_cache(maxsize=128)
def layer_count(name: str, frozen_options: tuple, input_shape: tuple[int, ...], num_classes: int) -> int:
    """Operators the forward pass dispatches: each costs dispatch time forward and backward."""
    return _forward_stats(name, frozen_options, input_shape, num_classes)[1]


class _OperatorCounter(TorchDispatchMode):
    """Counts the aten operators a forward pass runs and the bytes of the tensors they create.

    Counting at the operator level rather than per leaf module sees what modules hide: functional
    calls (``torch.cat``, ``F.relu``, the CVAE's reparameterisation), the full output of a
    transposed convolution that is cropped afterwards, and the residual additions; and it skips
    bytes that are not new: views and in-place operators (``relu_``, ``add_``) write no new tensor.
    """

    def __init__(self) -> None:
        super().__init__()
        self.operators = 0
        self.new_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.operators += 1
        if not func.is_view and not func._schema.is_mutable:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.new_bytes += t.numel() * t.element_size()
        return out


@lru_cache(maxsize=128)
def _forward_stats(name: str, frozen_options: tuple, input_shape: tuple[int, ...], num_classes: int) -> tuple[int, int]:
    model = build_model(name, num_classes=num_classes, input_shape=input_shape, **dict(frozen_options))
    model.train()  # the training forward: dropout draws masks, batch norm uses batch statistics
    counter = _OperatorCounter()
    with torch.no_grad(), counter:
        model(*example_inputs(model, 2, input_shape, num_classes))
    return counter.new_bytes // 2, counter.operators


def freeze(options: dict) -> tuple:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in options.items()))


def compute_seconds(
    profile: DeviceProfile, flops_per_sample: int, samples: int, layers: int | None = None, batch: int | None = None,
    params: int | None = None, activation_bytes: int | None = None,
) -> float | None:
    """Training time for ``samples``; None when the profile's speed is unknown.

    A measured profile with the full fit (``compute.fitted_gflops`` known) uses it:
    steps x (layers x o + params x p + activation bytes x batch x q) + 3 x FLOPs x samples / fitted
    speed. Otherwise ``3 x FLOPs x samples / effective GFLOP/s`` plus whichever per-layer and
    per-parameter costs the profile knows."""
    c = profile.compute
    steps = -(-samples // batch) if batch else 0
    fitted = c.fitted_gflops
    if fitted.known and batch and layers is not None and params is not None and activation_bytes is not None:
        arithmetic = 3 * flops_per_sample * samples / (fitted.value * 1e9) if fitted.value else 0.0
        per_step = (layers * _value(c.layer_overhead_us) * 1e-6 + params * _value(c.param_overhead_ns) * 1e-9
                    + activation_bytes * batch * _value(c.activation_ns_per_byte) * 1e-9)
        return arithmetic + steps * per_step
    speed = c.effective_gflops
    if not speed.known or not speed.value:
        return None
    t = 3 * flops_per_sample * samples / (speed.value * 1e9)
    if batch:
        if c.layer_overhead_us.known and layers:
            t += steps * layers * c.layer_overhead_us.value * 1e-6
        if c.param_overhead_ns.known and params:
            t += steps * params * c.param_overhead_ns.value * 1e-9
    return t


def _value(q) -> float:
    return float(q.value) if q.known and q.value is not None else 0.0


@dataclass(frozen=True)
class StepFit:
    """A host's training cost fitted from measured steps::

        step = layers x o + 3 x FLOPs x batch x f + params x p + activation bytes x batch x q
        memory = params x (8 + optimizer) + k x activation bytes x batch + overhead

    ``o`` is dispatch per layer, ``f`` the time per FLOP (``effective_gflops`` = 1 / f), ``p``
    streaming weights, gradients and optimizer state through memory, ``q`` moving activations
    (batch norm, ReLU, pooling and small convolutions are bound by memory traffic, not arithmetic,
    on a CPU). A term the data do not support fits to zero.
    """

    effective_gflops: float
    layer_overhead_us: float
    memory_overhead_bytes: float
    param_overhead_ns: float = 0.0
    activation_factor: float = 1.0
    activation_ns_per_byte: float = 0.0

    def step_seconds(self, flops: float, batch: int, layers: int, params: int, activation_bytes: float = 0.0) -> float:
        arithmetic = 3 * flops * batch / (self.effective_gflops * 1e9) if self.effective_gflops != float("inf") else 0.0
        return (layers * self.layer_overhead_us * 1e-6 + arithmetic + params * self.param_overhead_ns * 1e-9
                + activation_bytes * batch * self.activation_ns_per_byte * 1e-9)

    def memory_bytes(self, params: int, optimizer_bytes: int, activation_bytes: float, batch: int) -> float:
        return params * (8 + optimizer_bytes) + self.activation_factor * activation_bytes * batch + self.memory_overhead_bytes


def _nonnegative_lstsq(a, b):
    """Least squares with every coefficient >= 0 (costs cannot be negative): scipy's NNLS when
    available, else plain least squares clipped at zero."""
    import numpy as np

    try:
        from scipy.optimize import nnls

        return nnls(a, b)[0]
    except ImportError:
        return np.clip(np.linalg.lstsq(a, b, rcond=None)[0], 0, None)


def fit_step_model(rows: list[dict]) -> StepFit:
    """Fit the host terms from measured rows (keys: flops, batch, layers, step_s, memory_measured,
    and params + activation_bytes for the full model; rows without them fit the older two-term
    model: layers and FLOPs, and the median memory the naive model misses). Both fits weight each
    row by 1 / its size, so relative errors count and small models weigh as much as big ones."""
    import numpy as np

    full = all("params" in r and "activation_bytes" in r for r in rows)
    cols = [[r["layers"], 3 * r["flops"] * r["batch"]] + ([r["params"], r["activation_bytes"] * r["batch"]] if full else [])
            for r in rows]
    a = np.array(cols, dtype=float)
    t = np.array([r["step_s"] for r in rows], dtype=float)
    w = 1 / t
    scale = a.max(0)
    scale[scale == 0] = 1
    coef = _nonnegative_lstsq((a / scale) * w[:, None], t * w) / scale
    speed = 1 / coef[1] / 1e9 if coef[1] > 0 else float("inf")
    if not full:
        mem = float(np.median([r["memory_measured"] - r["memory_naive"] for r in rows]))
        return StepFit(speed, coef[0] * 1e6, max(mem, 0.0))
    m = np.array([r["memory_measured"] - r["params"] * 16 for r in rows], dtype=float)
    am = np.array([[r["activation_bytes"] * r["batch"], 1.0] for r in rows])
    wm = 1 / np.array([r["memory_measured"] for r in rows], dtype=float)
    k, base = _nonnegative_lstsq(am * wm[:, None] / am.max(0), m * wm) / am.max(0)
    return StepFit(speed, coef[0] * 1e6, float(base), coef[2] * 1e9, float(k), coef[3] * 1e9)


def transfer_seconds(profile: DeviceProfile, up_bytes: int, down_bytes: int) -> float | None:
    """Upload and download time at the profile's bandwidth (None when unknown)."""
    up, down = profile.network.uplink_mbps, profile.network.downlink_mbps
    if not (up.known and down.known and up.value and down.value):
        return None
    return up_bytes * 8 / (up.value * 1e6) + down_bytes * 8 / (down.value * 1e6)


@dataclass(frozen=True)
class CostEstimate:
    model: str
    options: tuple
    kind: str
    params: int
    flops_per_sample: int
    train_memory_bytes: int
    storage_bytes: int
    compute_s: float | None
    transfer_s: float | None

    @property
    def round_s(self) -> float | None:
        if self.compute_s is None:
            return None
        return self.compute_s + (self.transfer_s or 0.0)


def estimate(
    name: str,
    options: dict | None = None,
    *,
    profile: DeviceProfile | None = None,
    batch: int = 32,
    samples: int = 600,
    epochs: int = 1,
    optimizer: Literal["sgd", "momentum", "adam"] = "adam",
    input_shape: tuple[int, ...] = (1, 28, 28),
    num_classes: int = 10,
    upload_bytes: int | None = None,
) -> CostEstimate:
    """Predicted training cost of one round of ``name`` on ``profile`` (time needs a known speed)."""
    options = options or {}
    frozen = freeze(options)
    info = model_info(name, num_classes=num_classes, input_shape=input_shape, **options)
    act = activation_bytes_per_sample(name, frozen, tuple(input_shape), num_classes)
    factor = profile.memory.activation_factor if profile is not None else None
    memory = info.params * (8 + OPTIMIZER_STATE_BYTES[optimizer]) + act * batch * (factor.value if factor and factor.known else 1.0)
    if profile is not None and profile.memory.step_overhead_bytes.known:
        memory += profile.memory.step_overhead_bytes.value
    compute_s = transfer_s = None
    if profile is not None:
        layers = layer_count(name, frozen, tuple(input_shape), num_classes)
        compute_s = compute_seconds(profile, info.flops_per_sample, samples * epochs, layers, batch, info.params, act)
        payload = info.params * 4 if upload_bytes is None else upload_bytes
        transfer_s = transfer_seconds(profile, payload, info.params * 4)
    return CostEstimate(name, frozen, info.kind, info.params, info.flops_per_sample, int(memory), info.params * 4, compute_s, transfer_s)
