"""A device's own state on disk, so a device that crashed (power cut, OOM kill) resumes where
it was instead of from its initial weights.

After every round it trains, the device writes, before it sends the upload:

* ``carry.safetensors``: its model and what its method carries between rounds
  (:meth:`~edgefl.algorithms.ClientHalf.carry_state`);
* ``upload.edfl``: the packed upload it is about to send (resent unchanged, same id, when the
  server asks for that round again after the restart: the server counts it once);
* ``state.json``: the round, the run (the server's ``info.run``), the federation, the device id
  and a digest of the config.

Each file is written to a temporary name, flushed and renamed, and ``state.json`` last: a crash
at any moment leaves the previous round's complete state. Training is seeded by (seed, device,
round), so a device that crashed mid-round and retrains it from the saved state produces the
same upload as if it had never crashed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from edgefl.errors import EdgeflError, PayloadError
from edgefl.safejson import loads

STATE_JSON = "state.json"
CARRY = "carry.safetensors"
UPLOAD = "upload.edfl"
FORMAT = "edgefl-device-state/1"


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class DeviceStateStore:
    """The state folder of one device (``edgefl client --state-dir``)."""

    def __init__(self, directory: str | Path, device: str, federation: str, config_sha256: str) -> None:
        self.directory = Path(directory)
        self.identity = {"format": FORMAT, "device": device, "federation": federation, "config_sha256": config_sha256}

    def save(self, round_no: int, run: str | None, carry: dict[str, torch.Tensor], upload: bytes) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            _atomic_write(self.directory / CARRY, lambda p: save_file({k: v.contiguous() for k, v in carry.items()}, str(p)))
            _atomic_write(self.directory / UPLOAD, lambda p: p.write_bytes(upload))
            _atomic_write(self.directory / STATE_JSON,
                          lambda p: p.write_text(json.dumps({**self.identity, "round": round_no, "run": run}, sort_keys=True)))
        except OSError as exc:
            raise EdgeflError(f"cannot save the device state in {self.directory}: {exc.strerror or exc}",
                              hint="free some space or pass a writable --state-dir") from None

    def load(self) -> tuple[int, str | None, dict[str, torch.Tensor], bytes] | None:
        """(round, run, carried tensors, packed upload) of the last round saved; None when the folder
        holds no state. State of another device, federation or config is an error, not ignored:
        continuing from it would silently mix two runs."""
        path = self.directory / STATE_JSON
        if not path.is_file():
            return None
        try:
            info: Any = loads(path.read_bytes()[:4096], str(path))
            if not isinstance(info, dict) or not isinstance(info.get("round"), int):
                raise PayloadError("not a device state file")
            tensors = load_file(str(self.directory / CARRY))
            upload = (self.directory / UPLOAD).read_bytes()
        except (OSError, PayloadError, ValueError, RuntimeError) as exc:
            raise EdgeflError(f"the device state in {self.directory} is unreadable: {exc}",
                              hint="delete that folder to start this device afresh") from None
        theirs = {k: info.get(k) for k in self.identity}
        if theirs != self.identity:
            differs = ", ".join(k for k in self.identity if theirs[k] != self.identity[k])
            raise EdgeflError(f"the device state in {self.directory} belongs to another run ({differs} differ)",
                              hint="pass another --state-dir, or delete that folder to start this device afresh")
        run = info.get("run") if isinstance(info.get("run"), str) else None
        return info["round"], run, tensors, upload
