"""Where tensors compute: the run's ``device`` setting resolved to a torch device (one rule for
client halves, simulated or on a device, and for server halves)."""

from __future__ import annotations

import torch

from edgefl.errors import ConfigError


def resolve_device(choice: str) -> torch.device:
    """``auto``: CUDA when torch sees a GPU, else the CPU; ``cuda`` without one is an error that says so."""
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device = \"cuda\" asked for, but torch sees no CUDA device on this machine",
                          hint='use device = "auto" (CUDA when present) or "cpu", or install a CUDA build of torch')
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice not in ("cpu", "cuda"):
        raise ConfigError(f"unknown device {choice!r}", hint='device is "auto", "cpu" or "cuda"')
    return torch.device(choice)
