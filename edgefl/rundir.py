"""The run directory: everything a run leaves behind, written as it goes.

::

    config.toml      the resolved configuration (re-runnable as is)
    run.json         seed, versions and machine, written before the first round
    partition.json   per-client class counts
    metrics.jsonl    one record per round, appended and flushed after each round
    summary.json     final figures (written last)
    plots/           accuracy per round per architecture, partition, communication
    models/          final weights as safetensors, architecture in the metadata
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from edgefl.errors import EdgeflError


class RunDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @classmethod
    def create(cls, out: str | Path | None, name: str, seed: int) -> RunDir:
        if out is None:
            out = Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}-s{seed}"
        path = Path(out)
        if path.exists() and any(path.iterdir()):
            raise EdgeflError(f"run directory {path} already exists and is not empty", hint="pass another --out, or remove it")
        (path / "plots").mkdir(parents=True, exist_ok=True)
        (path / "models").mkdir(exist_ok=True)
        return cls(path)

    def write_json(self, name: str, data: Any) -> None:
        tmp = self.path / f".{name}.tmp"
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str))
        tmp.replace(self.path / name)

    def read_json(self, name: str) -> Any:
        return json.loads((self.path / name).read_text())

    def append_metrics(self, record: dict[str, Any]) -> None:
        with (self.path / "metrics.jsonl").open("a") as fh:
            fh.write(json.dumps(record, sort_keys=True) + "\n")
            fh.flush()

    def metrics(self) -> list[dict[str, Any]]:
        path = self.path / "metrics.jsonl"
        if not path.is_file():
            raise EdgeflError(f"{self.path} has no metrics.jsonl", hint="is this a run directory? runs are under ./runs by default")
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def save_model(self, name: str, state: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
        path = self.path / "models" / f"{name}.safetensors"
        tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
        save_file(tensors, str(path), metadata={k: json.dumps(v) for k, v in meta.items()})
        return path


def load_model_file(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Weights and metadata of a file written by :meth:`RunDir.save_model`."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        raw_meta = fh.metadata() or {}
    return load_file(str(path)), {k: json.loads(v) for k, v in raw_meta.items()}
