"""What a run records about where it ran: package versions and the machine (its device profile
until measured profiles exist)."""

from __future__ import annotations

import os
import platform
import socket
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import psutil
import torch

PACKAGES = ("edgefl", "torch", "torchvision", "numpy", "safetensors", "pydantic", "paho-mqtt", "matplotlib", "scikit-learn")


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def source_commit() -> str | None:
    """The commit of the git checkout edgefl runs from (an editable install), with "-dirty" when its
    tracked files differ from it; None for an installed package or without git. A version number
    alone does not say which code of a development checkout produced a run's numbers."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True, text=True,
                               timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def cpu_model() -> str | None:
    """The processor's name (Linux: /proc/cpuinfo; elsewhere what ``platform`` knows), or None."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Hardware", "Model") and value.strip():
                    return value.strip()[:200]
    except OSError:
        pass
    return platform.processor() or None


def machine() -> dict[str, Any]:
    freq = psutil.cpu_freq()
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "os": f"{platform.system()} {platform.release()}",
        "arch": platform.machine(),
        "python": platform.python_version(),
        "cpu": cpu_model(),
        # the kernels torch dispatches to (same seed, other kernels: other last digits; docs/methods.md)
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "cpu_mhz": round(freq.max or freq.current) if freq else None,
        "ram_bytes": psutil.virtual_memory().total,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    return info
