"""A cost model for training a zoo model on a device, and the budget -> architecture rule.

Time per round: ``3 x forward FLOPs x samples x epochs / effective FLOP/s`` (backward costs about
twice the forward pass, as FedScale assumes; torch's counter measured 2.96x) plus the model's
upload and download at the profile's bandwidth. Memory: ``params x (4 weights + 4 gradients +
optimizer state)`` plus the activations autograd keeps for a batch (measured once per model by
forward hooks: the bytes every leaf module outputs per sample). Storage: the parameter bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import torch
from torch import nn

from edgefl.models import build_model, example_inputs, model_info
from edgefl.profile.schema import DeviceProfile

OPTIMIZER_STATE_BYTES = {"sgd": 0, "momentum": 4, "adam": 8}


@lru_cache(maxsize=128)
def activation_bytes_per_sample(name: str, frozen_options: tuple, input_shape: tuple[int, ...], num_classes: int) -> int:
    """Bytes of every leaf module's output for one sample: what autograd keeps for backward."""
    model = build_model(name, num_classes=num_classes, input_shape=input_shape, **dict(frozen_options))
    total = 0

    def hook(_m: nn.Module, _i, out) -> None:
        nonlocal total
        for t in out if isinstance(out, tuple) else (out,):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()

    handles = [m.register_forward_hook(hook) for m in model.modules() if not list(m.children())]
    model.eval()
    with torch.no_grad():
        model(*example_inputs(model, 2, input_shape, num_classes))
    for h in handles:
        h.remove()
    return total // 2


def compute_seconds(profile: DeviceProfile, flops_per_sample: int, samples: int) -> float | None:
    """Training time for ``samples`` at the profile's effective speed (None when unknown)."""
    speed = profile.compute.effective_gflops
    if not speed.known or not speed.value:
        return None
    return 3 * flops_per_sample * samples / (speed.value * 1e9)


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
    frozen = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in options.items()))
    info = model_info(name, num_classes=num_classes, input_shape=input_shape, **options)
    act = activation_bytes_per_sample(name, frozen, tuple(input_shape), num_classes)
    memory = info.params * (8 + OPTIMIZER_STATE_BYTES[optimizer]) + act * batch
    compute_s = transfer_s = None
    if profile is not None:
        compute_s = compute_seconds(profile, info.flops_per_sample, samples * epochs)
        payload = info.params * 4 if upload_bytes is None else upload_bytes
        transfer_s = transfer_seconds(profile, payload, info.params * 4)
    return CostEstimate(name, frozen, info.kind, info.params, info.flops_per_sample, int(memory), info.params * 4, compute_s, transfer_s)
