"""Checks of tensors that came over the network, shared by the device's downloads and the
server's uploads: finite values within bounds, and names, dtypes and shapes against what is
expected. Each returns why the tensors cannot be used, or None."""

from __future__ import annotations

from collections.abc import Mapping

import torch


def nonfinite_problem(tensors: Mapping[str, torch.Tensor], what: str = "the message") -> str | None:
    """A floating tensor holding NaN or an infinity, named."""
    for name, t in tensors.items():
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            return f"{what}: {name[:64]} holds NaN or Inf"
    return None


def bounded_problem(tensors: Mapping[str, torch.Tensor], max_abs: float) -> str | None:
    """Every floating value finite and within +-``max_abs`` (network.max_abs_value)."""
    problem = nonfinite_problem(tensors)
    if problem:
        return problem
    for name, t in tensors.items():
        if t.is_floating_point() and t.numel() and float(t.abs().max()) > max_abs:
            return f"{name[:64]} holds a value of magnitude {float(t.abs().max()):.3g} (limit {max_abs:g}, network.max_abs_value)"
    return None


def layout_problem(tensors: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[torch.dtype | None, tuple[int, ...]]],
                   what: str) -> str | None:
    """``tensors`` hold exactly the names of ``expected``, each with its dtype (None: any floating
    type) and shape."""
    if set(tensors) != set(expected):
        missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
        return f"{what}: missing {[m[:64] for m in missing[:3]]}, unexpected {[e[:64] for e in extra[:3]]}"
    for name, (dtype, shape) in expected.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(shape):
            return f"{what}: {name[:64]} is {list(t.shape)}, expected {list(shape)}"
        if dtype is None and not t.is_floating_point():
            return f"{what}: {name[:64]} is {t.dtype}, expected a floating type"
        if dtype is not None and t.dtype != dtype:
            return f"{what}: {name[:64]} is {t.dtype}, expected {dtype}"
    return None


def state_layout(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.dtype | None, tuple[int, ...]]]:
    """What a model's state dict expects of weights sent for it (floating tensors: any float type,
    as load_state_dict converts them; integer buffers such as batch-norm counters: their own)."""
    return {k: (None if v.is_floating_point() else v.dtype, tuple(v.shape)) for k, v in state.items()}
