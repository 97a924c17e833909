"""A cost model for training a zoo model on a device, and the budget -> architecture rule.

Time. A catalog profile knows one effective speed: ``3 x forward FLOPs x samples / effective
GFLOP/s`` (backward costs about twice the forward pass, as FedScale assumes; torch's counter
measured 2.96x), plus per-operator and per-parameter costs where the profile has them. A profile
``edgefl device-profile`` measured has the full step fit, one term per kind of work a CPU step
does at its own rate::

    step = fixed + operators x o + convolutions x c + conv FLOPs x 3 / conv rate
           + transposed-conv FLOPs x 3 / its rate + linear FLOPs x 3 / linear rate
           + random elements x r + memory-bound bytes x q + parameter tensors x t + params x p

Convolutions, transposed convolutions (a CVAE decoder's upsampling: it ran at a third of the
rate of ordinary ones here) and matrix multiplies run at different rates (oneDNN's kernels
against BLAS GEMMs), and each convolution call costs kernel set-up forward and backward;
dropout masks and CVAE noise are random-number generation, which costs per element and
dominated the FedHe CNNs' steps (their dropout over wide maps: 40 % of the step); batch norm,
ReLU, pooling and additions are bound by the bytes they read and write; the optimizer runs its
own operators for every parameter tensor (a CPU has no foreach kernels) and streams every
parameter; a fixed cost per step (loss, autograd's start, optimizer call) dominates 2 ms steps.
``device-profile`` times the optimizer apart from the passes, and the fit prices the two apart. The statistics come from one training forward pass under a
torch dispatch mode (:class:`ForwardStats`), so functional calls and in-place operators are seen
as they run.

Memory: ``params x (4 weights + 4 gradients + optimizer state)`` plus the activations autograd
keeps for a batch (the bytes of every new tensor the training forward pass creates), scaled by
the profile's activation factor when known (autograd also keeps some inputs, and kernels take
workspace), plus temporaries the size of the largest parameter tensor (the optimizer updates
one tensor at a time; VGG-9's 16 MiB FC weight made its peak 30 MiB higher than the rest
predicts), plus the profile's per-step overhead when known. Storage: the parameter bytes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from edgefl.models import build_model, example_inputs, model_info
from edgefl.models.registry import JsonFileCache
from edgefl.profile.schema import DeviceProfile

OPTIMIZER_STATE_BYTES = {"sgd": 0, "momentum": 4, "adam": 8}

_CONVOLUTIONS = {"convolution", "_convolution", "conv2d", "conv1d", "conv_transpose2d", "mkldnn_convolution"}
_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"}
_RANDOM = {"bernoulli", "bernoulli_", "rand", "randn", "rand_like", "randn_like", "normal", "normal_", "uniform_",
           "native_dropout", "randint", "randperm"}
_ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "zeros", "ones"}  # allocate, move no data


@dataclass(frozen=True)
class ForwardStats:
    """What one training forward pass runs: operators per pass, the rest per sample."""

    operators: int
    conv_operators: int  # each convolution call sets up oneDNN kernels forward and backward
    conv_flops: float
    transposed_conv_flops: float  # a generator's upsampling: other kernels, another rate
    linear_flops: float
    random_elements: float
    traffic_bytes: float  # read + written by the memory-bound operators (not conv, matmul, random)
    new_bytes: float  # new tensors created: what autograd keeps and the activation memory
    param_tensors: int = 0  # the optimizer updates each on its own on a CPU (no foreach kernels there)
    largest_param_bytes: int = 0  # the optimizer's temporaries for one tensor at a time are this big


class _OperatorCounter(TorchDispatchMode):
    """Sorts the aten operators a forward pass runs by the kind of work they do.

    Counting at the operator level rather than per leaf module sees what modules hide: functional
    calls (``torch.cat``, ``F.relu``, the CVAE's reparameterisation), the full output of a
    transposed convolution that is cropped afterwards, and the residual additions; views and
    in-place operators (``relu_``, ``add_``) create no new tensor.
    """

    def __init__(self) -> None:
        super().__init__()
        self.operators = self.conv_operators = 0
        self.conv_flops = self.transposed_conv_flops = self.linear_flops = self.random_elements = self.traffic_bytes = self.new_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.operators += 1
        name = func.overloadpacket.__name__
        outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
        out_bytes = sum(t.numel() * t.element_size() for t in outs)
        if not func.is_view and not func._schema.is_mutable:
            self.new_bytes += out_bytes
        if name in _CONVOLUTIONS or name in _MATMULS:
            formula = flop_registry.get(func.overloadpacket)
            flops = formula(*args, **kwargs, out_val=out) if formula else 0
            if name in _CONVOLUTIONS:
                self.conv_operators += 1
                if _is_transposed(name, args, kwargs):
                    self.transposed_conv_flops += flops
                else:
                    self.conv_flops += flops
            else:
                self.linear_flops += flops
        elif name in _RANDOM:
            self.random_elements += sum(t.numel() for t in outs)
        elif not func.is_view and name not in _ALLOCATIONS:
            ins = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            self.traffic_bytes += out_bytes + sum(t.numel() * t.element_size() for t in ins)
        return out


@lru_cache(maxsize=256)
def forward_stats(name: str, frozen_options: tuple, input_shape: tuple[int, ...], num_classes: int) -> ForwardStats:
    """One training forward pass of ``name`` (batch 2, divided per sample), counted by kind of work.

    Kept in a cache file beside :func:`~edgefl.models.model_info`'s, keyed by the models' source,
    this module's and torch's version: counting the zoo's 26 candidates took ``edgefl assign``
    a minute or more on every call."""
    key = json.dumps([name, frozen_options, input_shape, num_classes], default=str)
    cache = _STATS_CACHE.load()
    if key in cache:
        try:
            return ForwardStats(**cache[key])
        except TypeError:
            pass  # written by another layout of ForwardStats: count again
    stats = _count_forward(name, frozen_options, input_shape, num_classes)
    cache[key] = asdict(stats)
    _STATS_CACHE.save()
    return stats


@lru_cache(maxsize=1)
def _stats_path() -> Path:
    from edgefl.models.registry import _cache_path

    models = _cache_path()  # one file per models source and torch version, in the user's cache folder
    digest = hashlib.sha256(models.name.encode() + Path(__file__).read_bytes()).hexdigest()[:16]
    return models.with_name(f"forward-stats-{digest}.json")


_STATS_CACHE = JsonFileCache(lambda: _stats_path())


def _count_forward(name: str, frozen_options: tuple, input_shape: tuple[int, ...], num_classes: int) -> ForwardStats:
    model = build_model(name, num_classes=num_classes, input_shape=input_shape, **dict(frozen_options))
    model.train()  # the training forward: dropout draws masks, batch norm uses batch statistics
    batch = 2
    inputs = example_inputs(model, batch, input_shape, num_classes)  # made outside: not the model's work
    counter = _OperatorCounter()
    with torch.no_grad(), counter:
        model(*inputs)
    return ForwardStats(counter.operators, counter.conv_operators, counter.conv_flops / batch,
                        counter.transposed_conv_flops / batch, counter.linear_flops / batch,
                        counter.random_elements / batch, counter.traffic_bytes / batch, counter.new_bytes / batch,
                        sum(1 for p in model.parameters() if p.requires_grad),
                        max((p.numel() * p.element_size() for p in model.parameters()), default=0))


def _is_transposed(name: str, args: tuple, kwargs: dict) -> bool:
    if name == "conv_transpose2d":
        return True
    if name in ("convolution", "_convolution"):  # (input, weight, bias, stride, padding, dilation, transposed, ...)
        return bool(kwargs.get("transposed", args[6] if len(args) > 6 else False))
    return False


def activation_bytes_per_sample(name: str, frozen_options: tuple, input_shape: tuple[int, ...], num_classes: int) -> int:
    """Bytes of new tensors the forward pass creates for one sample: what autograd keeps."""
    return int(forward_stats(name, frozen_options, input_shape, num_classes).new_bytes)


def freeze(options: dict) -> tuple:
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in options.items()))


def _per_unit(rate: float, unit: float) -> float:
    """Seconds per unit of work from a rate in units / s; a rate of 0 means the term is absent."""
    return 1 / (rate * unit) if rate else 0.0


@dataclass(frozen=True)
class StepFit:
    """A host's training cost fitted from measured steps (see the module's docstring).

    Rates of 0 (``conv_gflops``, ``linear_gflops``) mean the fit found no such term on this host:
    that work hides inside the others. ``memory = params x (8 + optimizer) + activation_factor x
    new bytes x batch + memory_overhead_bytes``.
    """

    step_overhead_us: float
    layer_overhead_us: float
    conv_overhead_us: float
    conv_gflops: float
    transposed_conv_gflops: float
    linear_gflops: float
    random_ns_per_element: float
    traffic_ns_per_byte: float
    tensor_overhead_us: float
    param_overhead_ns: float
    activation_factor: float
    memory_overhead_bytes: float
    largest_tensor_factor: float = 0.0

    def step_seconds(self, stats: ForwardStats, params: int, batch: int) -> float:
        return (self.step_overhead_us * 1e-6 + stats.operators * self.layer_overhead_us * 1e-6
                + stats.conv_operators * self.conv_overhead_us * 1e-6
                + 3 * stats.conv_flops * batch * _per_unit(self.conv_gflops, 1e9)
                + 3 * stats.transposed_conv_flops * batch * _per_unit(self.transposed_conv_gflops, 1e9)
                + 3 * stats.linear_flops * batch * _per_unit(self.linear_gflops, 1e9)
                + stats.random_elements * batch * self.random_ns_per_element * 1e-9
                + stats.traffic_bytes * batch * self.traffic_ns_per_byte * 1e-9
                + stats.param_tensors * self.tensor_overhead_us * 1e-6 + params * self.param_overhead_ns * 1e-9)

    def memory_bytes(self, params: int, optimizer_bytes: int, stats: ForwardStats, batch: int) -> float:
        return (params * (8 + optimizer_bytes) + self.activation_factor * stats.new_bytes * batch
                + self.largest_tensor_factor * stats.largest_param_bytes + self.memory_overhead_bytes)

    @classmethod
    def from_profile(cls, profile: DeviceProfile) -> StepFit | None:
        """The profile's fitted step model, None unless ``edgefl device-profile`` measured all of it."""
        c, m = profile.compute, profile.memory
        fields = (c.step_overhead_us, c.layer_overhead_us, c.conv_overhead_us, c.conv_gflops, c.transposed_conv_gflops, c.linear_gflops,
                  c.random_ns_per_element,
                  c.traffic_ns_per_byte, c.tensor_overhead_us, c.param_overhead_ns)
        if not all(q.known for q in fields):
            return None
        return cls(*(float(q.value) for q in fields), _value(m.activation_factor, 1.0), _value(m.step_overhead_bytes),
                   _value(m.largest_tensor_factor))


def compute_seconds(
    profile: DeviceProfile, flops_per_sample: int, samples: int, batch: int | None = None,
    params: int | None = None, stats: ForwardStats | None = None,
) -> float | None:
    """Training time for ``samples``; None when the profile's speed is unknown.

    A measured profile with the full step fit uses it (steps x :meth:`StepFit.step_seconds`).
    Otherwise ``3 x FLOPs x samples / effective GFLOP/s`` plus whichever per-operator and
    per-parameter costs the profile knows."""
    c = profile.compute
    steps = -(-samples // batch) if batch else 0
    fit = StepFit.from_profile(profile)
    if fit is not None and batch and stats is not None and params is not None:
        return steps * fit.step_seconds(stats, params, batch)
    speed = c.effective_gflops
    if not speed.known or not speed.value:
        return None
    t = 3 * flops_per_sample * samples / (speed.value * 1e9)
    if batch:
        if c.layer_overhead_us.known and stats is not None:
            t += steps * stats.operators * c.layer_overhead_us.value * 1e-6
        if c.param_overhead_ns.known and params:
            t += steps * params * c.param_overhead_ns.value * 1e-9
    return t


def _value(q, default: float = 0.0) -> float:
    return float(q.value) if q.known and q.value is not None else default


def relative_nnls(a, target, size):
    """Non-negative least squares (costs cannot be negative) on ``a @ x = target`` with each row's
    error relative to ``size``, so small models weigh as much as big ones. Columns are scaled to
    a common range first (their units differ by ten orders of magnitude). scipy's NNLS when
    available, else plain least squares clipped at zero."""
    import numpy as np

    a = np.asarray(a, dtype=float)
    size = np.asarray(size, dtype=float)
    scale = a.max(0)
    scale[scale == 0] = 1
    lhs, rhs = (a / scale) / size[:, None], np.asarray(target, dtype=float) / size
    try:
        from scipy.optimize import nnls

        x = nnls(lhs, rhs)[0]
    except ImportError:
        x = np.clip(np.linalg.lstsq(lhs, rhs, rcond=None)[0], 0, None)
    return x / scale


STEP_TERMS = ("fixed", "operators", "conv_operators", "conv_flops", "transposed_conv_flops", "linear_flops",
              "random_elements", "traffic_bytes", "param_tensors", "params")


def step_columns(stats: ForwardStats, params: int, batch: int) -> list[float]:
    """One measured step's regressors, in :data:`STEP_TERMS` order (the work each term prices)."""
    return [1.0, stats.operators, stats.conv_operators, 3 * stats.conv_flops * batch, 3 * stats.transposed_conv_flops * batch,
            3 * stats.linear_flops * batch, stats.random_elements * batch, stats.traffic_bytes * batch, stats.param_tensors,
            params]


def fit_step_model(rows: list[dict]) -> StepFit:
    """Fit the host terms from measured rows (keys: ``stats`` (a :class:`ForwardStats`), params,
    batch, step_s, memory_measured, and optimizer_s where the optimizer's part of the step was
    timed on its own).

    With ``optimizer_s`` the fit has two stages: the optimizer's time against a fixed cost, the
    parameter tensors and the parameter count, then the forward and backward time against the
    other terms. Fitting all at once let a model whose parameters outweigh its arithmetic
    (VGG-9's FC layer) hand its optimizer time to the matmul rate, which then over-charged the
    CVAEs' small linear layers. Errors count relative to the whole step (the number an estimate
    is judged by) and to the measured peak; every term is kept non-negative."""
    import numpy as np

    a = np.array([step_columns(r["stats"], r["params"], r["batch"]) for r in rows], dtype=float)
    t = np.array([r["step_s"] for r in rows], dtype=float)
    col = {name: i for i, name in enumerate(STEP_TERMS)}
    if all(r.get("optimizer_s") for r in rows):
        t_opt = np.array([r["optimizer_s"] for r in rows], dtype=float)
        optimizer_terms = ["fixed", "param_tensors", "params"]
        # the passes stream the weights too (forward reads them, backward reads them and writes
        # their gradients): a parameter term of their own, apart from the optimizer's
        pass_terms = [name for name in STEP_TERMS if name != "param_tensors"]
        coef = np.zeros(len(STEP_TERMS))
        for terms, target in ((optimizer_terms, t_opt), (pass_terms, np.maximum(t - t_opt, 1e-9))):
            idx = [col[name] for name in terms]
            coef[idx] += relative_nnls(a[:, idx], target, t)
    else:
        coef = relative_nnls(a, t, t)
    fixed, per_op, per_conv, conv, transposed, linear, rand, traffic, per_tensor, per_param = coef
    measured = np.array([r["memory_measured"] for r in rows], dtype=float)
    k, largest, base = relative_nnls([[r["stats"].new_bytes * r["batch"], r["stats"].largest_param_bytes, 1.0] for r in rows],
                                     measured - np.array([r["params"] * 16 for r in rows], dtype=float), measured)
    rate = lambda c: 1 / c / 1e9 if c > 0 else 0.0  # noqa: E731  (s per FLOP -> GFLOP/s; 0: no term)
    return StepFit(fixed * 1e6, per_op * 1e6, per_conv * 1e6, rate(conv), rate(transposed), rate(linear), rand * 1e9,
                   traffic * 1e9, per_tensor * 1e6, per_param * 1e9, float(k), float(base), float(largest))


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
    stats = forward_stats(name, frozen, tuple(input_shape), num_classes)
    act = stats.new_bytes
    factor = profile.memory.activation_factor if profile is not None else None
    memory = info.params * (8 + OPTIMIZER_STATE_BYTES[optimizer]) + act * batch * (factor.value if factor and factor.known else 1.0)
    if profile is not None and profile.memory.step_overhead_bytes.known:
        memory += profile.memory.step_overhead_bytes.value
    if profile is not None and profile.memory.largest_tensor_factor.known:
        memory += profile.memory.largest_tensor_factor.value * stats.largest_param_bytes
    compute_s = transfer_s = None
    if profile is not None:
        compute_s = compute_seconds(profile, info.flops_per_sample, samples * epochs, batch, info.params, stats)
        payload = info.params * 4 if upload_bytes is None else upload_bytes
        transfer_s = transfer_seconds(profile, payload, info.params * 4)
    return CostEstimate(name, frozen, info.kind, info.params, info.flops_per_sample, int(memory), info.params * 4, compute_s, transfer_s)
