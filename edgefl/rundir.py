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
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from edgefl.errors import EdgeflError


#: what a run directory may hold (besides temporary ``*.tmp`` files): ``--overwrite`` deletes a
#: folder holding nothing else (a file a run newly writes belongs here)
RUN_ENTRIES = frozenset({"config.toml", "run.json", "partition.json", "metrics.jsonl", "summary.json", "live.json", "plots", "models",
                         "server-state.safetensors", "tensorboard", "mlruns", "export", "ship.json", "baseline"})


def safe_name(label: str) -> str:
    """A model's label (``fedhe-cnn-0(width=0.125)``) as a file name: letters, digits, ``-_.``."""
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in label).strip("_")


class RunDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.made_folder = False  # create() made the folder itself (so discard_unrecorded() may remove it, not only empty it)

    @classmethod
    def create(cls, out: str | Path | None, name: str, seed: int, overwrite: bool = False) -> RunDir:
        """A new run directory. ``overwrite``: replace one that recorded no round (a run that
        failed or was stopped before round 1); one with rounds in metrics.jsonl is never replaced."""
        if out is None:
            out = Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}-s{seed}"
        path = Path(out)
        if path.exists() and any(path.iterdir()):
            if not overwrite:
                raise EdgeflError(f"run directory {path} already exists and is not empty",
                                  hint="pass another --out, or remove it (--overwrite replaces a run that recorded no round)")
            cls(path).discard_unrecorded(check_only=True)  # raises, deleting nothing, unless it is a run without rounds
            shutil.rmtree(path)
        made = not path.exists()
        (path / "plots").mkdir(parents=True, exist_ok=True)
        (path / "models").mkdir(exist_ok=True)
        run = cls(path)
        run.made_folder = made
        return run

    def recorded_rounds(self) -> int:
        """Records in metrics.jsonl: 0 for a run that ended (or failed) before its first round."""
        path = self.path / "metrics.jsonl"
        if not path.is_file():
            return 0
        with path.open("rb") as fh:
            return sum(1 for line in fh if line.strip())

    def finished(self) -> bool:
        """Whether the run's summary says it ended by itself (not interrupted, not crashed)."""
        try:
            return self.read_json("summary.json").get("interrupted") is False
        except (OSError, ValueError, AttributeError):
            return False

    def discard_unrecorded(self, check_only: bool = False, written_here: bool = False) -> None:
        """Delete this run directory, which must have recorded no round and (unless this process
        made and filled it: ``written_here``) hold nothing but what a run writes; else an
        EdgeflError says why not, and nothing is deleted. The folder itself stays when this run
        did not make it (an empty --out folder given by the user)."""
        rounds = self.recorded_rounds()
        if rounds:
            raise EdgeflError(f"run directory {self.path} holds a run with {rounds} round(s) in metrics.jsonl: it is never replaced",
                              hint="pass another --out, or continue that run (edgefl server ... --resume)")
        foreign = [] if written_here else sorted(p.name for p in self.path.iterdir() if p.name not in RUN_ENTRIES and not p.name.endswith(".tmp"))
        if foreign:
            raise EdgeflError(f"{self.path} holds {', '.join(foreign[:5])}, which no run writes: not replaced",
                              hint="pass another --out (--overwrite replaces only a run directory that recorded no round)")
        if check_only:
            return
        if self.made_folder:
            shutil.rmtree(self.path)
            return
        for entry in self.path.iterdir():
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()

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
        write_model_file(path, state, meta)
        return path


def write_model_file(path: str | Path, state: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """A model file: the weights, and ``meta`` as safetensors metadata (each value JSON). The same
    weights and metadata give the same bytes: safetensors writes metadata in its hash map's order,
    which changes from process to process, so the header is written again with the keys sorted
    (same-seed runs' model files then have the same SHA-256)."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    save_file(tensors, str(path), metadata={k: json.dumps(v, sort_keys=True) for k, v in meta.items()})
    _sort_metadata(Path(path))


def _sort_metadata(path: Path) -> None:
    """Rewrite a safetensors file's header with ``__metadata__`` in key order. By hand: safetensors
    has no option for it. The header is JSON after an 8-byte little-endian length; tensor offsets
    count from the end of the header, so a header of the same length is rewritten in place."""
    with open(path, "r+b") as fh:
        length = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(length))
        meta = header.get("__metadata__")
        if not meta:
            return
        header["__metadata__"] = dict(sorted(meta.items()))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(text) <= length:  # the usual case: the same keys and values, in another order
            fh.seek(8)
            fh.write(text.ljust(length, b" "))  # trailing spaces are the format's own padding
            return
        fh.seek(8 + length)
        data = fh.read()
        padded = text.ljust(-(-len(text) // 8) * 8, b" ")
        fh.seek(0)
        fh.write(len(padded).to_bytes(8, "little") + padded + data)
        fh.truncate()


def load_model_file(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Weights and metadata of a file written by :meth:`RunDir.save_model`."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        raw_meta = fh.metadata() or {}
    meta = {}
    for key, value in raw_meta.items():
        try:
            meta[key] = json.loads(value)
        except (ValueError, RecursionError):  # ValueError: not JSON, or an integer of thousands of digits
            raise MetadataError(f"its metadata field {key[:40]!r} is not the JSON edgefl writes ({value[:40]!r}...)") from None
    return load_file(str(path)), meta


class MetadataError(ValueError):
    """A model file's tensors are readable, one of its metadata fields is not."""
