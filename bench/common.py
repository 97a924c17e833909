"""Helpers shared by the benchmarks: run a config in-process and collect comparable numbers."""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from edgefl.config import validate_config
from edgefl.data import load_dataset
from edgefl.environment import machine, package_versions
from edgefl.sim import Simulation

RESULTS = Path(__file__).parent / "results"


def run_config(raw: dict[str, Any], dataset=None) -> dict[str, Any]:
    cfg = validate_config(raw, "benchmark config")
    sim = Simulation(cfg, None, dataset=dataset, show_progress=False)
    summary = sim.run()
    return {"summary": summary, "history": sim.history}


def load(name: str = "fashion-mnist"):
    return load_dataset(name)


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def save(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    payload = {
        **payload,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(),
        "versions": package_versions(),
        "platform": platform.platform(),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "torch_threads": torch.get_num_threads(),
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path
