"""A device's own state on disk, so a device that crashed (power cut, OOM kill) resumes where
it was instead of from its initial weights.

After every round it trains, the device writes, before it sends the upload:

* ``carry.safetensors``: its model and what its method carries between rounds
  (:meth:`~edgefl.algorithms.ClientHalf.carry_state`);
* ``upload.edfl``: the packed upload it is about to send (resent unchanged, same id, when the
  server asks for that round again after the restart: the server counts it once);
* ``state.json``: the round, the run (the server's ``info.run``), the federation, the device id
  and a digest of the config.

When the server announces the end of the run, the device also writes ``model.safetensors``: its
model in the format of a run directory's model files (architecture, options, classes, input shape
and the run in the metadata), so ``edgefl export STATE_DIR/model.safetensors`` turns it into phone
files. That is how the model of a method that keeps one per device (FedHe, CHFL) leaves a fleet:
the server never holds it (docs/export.md).

Each file is written to a temporary name, flushed and renamed, and ``state.json`` last: a crash
at any moment leaves the previous round's complete state. Training is seeded by (seed, device,
round), so a device that crashed mid-round and retrains it from the saved state produces the
same upload as if it had never crashed.

State of another config (or federation, or state format), state of another run and state that
cannot be read (a damaged file) are never deleted: the files are moved into ``old/<UTC time>/`` inside the folder (with the ``export/`` folder
of the model's phone files, when there is one), with a log line, and the
device starts afresh (docs/PROTOCOL.md section 9). State of another device id is an error: two
devices sharing one folder would otherwise keep moving each other's state aside.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from edgefl.errors import EdgeflError, PayloadError
from edgefl.userdirs import check_writable
from edgefl.safejson import loads
from edgefl.rundir import write_model_file
from edgefl.transport.envelope import unpack

STATE_JSON = "state.json"
CARRY = "carry.safetensors"
UPLOAD = "upload.edfl"
MODEL = "model.safetensors"  # the device's model at the end of a run, for edgefl export
# where `edgefl export STATE_DIR/model.safetensors` writes by default (exporters.default_out_dir): phone
# files of the model beside it, so they go aside with it rather than stay to describe a model no longer there
EXPORT = "export"
FORMAT = "edgefl-device-state/1"
#: what a damaged state costs, said with it: the run's server sees only a device that starts over
_LOST = ("; if the server still runs that run, this device's rounds in it are lost and it trains on from its initial "
         "model (a damaged file: check the storage)")
OLD = "old"  # where state of another config or run is kept: <folder>/old/<UTC time>/

log = logging.getLogger("edgefl.device")


def _atomic_write(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def check_state_dir(directory: Path) -> None:
    """:meth:`DeviceStateStore.check_writable` before the store can be made (a device that gets its
    config, and so its store's identity, from the server only after joining)."""
    check_writable(directory, "the device state folder", "pass a writable --state-dir (the device keeps its state and, at the "
                   "run's end, its model there), or --no-state to keep nothing")


class DeviceStateStore:
    """The state folder of one device (``edgefl client --state-dir``)."""

    def __init__(self, directory: str | Path, device: str, federation: str, config_sha256: str) -> None:
        self.directory = Path(directory)
        self.identity = {"format": FORMAT, "device": device, "federation": federation, "config_sha256": config_sha256}
        #: (the run,) whose state :meth:`load` found in the folder, None when it found none: a save
        #: for another run first moves that state aside rather than overwriting it
        self._held: tuple[str | None] | None = None
        #: why :meth:`load` set damaged state aside (None: nothing lost); the device tells the server
        #: with its first upload, so the run's log explains the accuracy it loses
        self.lost: str | None = None

    def check_writable(self) -> None:
        """Refuse a folder this device cannot write, before it joins a run: a device that trained
        every round without being able to save would end the run with its model lost, while the
        run's ship.json may name that model for phones."""
        check_state_dir(self.directory)

    def set_aside(self, why: str) -> Path | None:
        """Move the saved files into ``old/<UTC time>/`` (never deleted) and say so (``why``: what
        the state is, completing "the saved state in FOLDER ..."); returns where they went, None when
        there was nothing to move."""
        present = [self.directory / name for name in (STATE_JSON, CARRY, UPLOAD, MODEL, EXPORT) if (self.directory / name).exists()]
        if not present:
            return None
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        target = self.directory / OLD / stamp
        n = 1
        while target.exists():  # two set-asides within a second keep both
            target = self.directory / OLD / f"{stamp}-{n}"
            n += 1
        try:
            target.mkdir(parents=True)
            for path in present:
                os.replace(path, target / path.name)
        except OSError as exc:
            raise EdgeflError(f"cannot move the device state in {self.directory} aside ({why}): {getattr(exc, 'strerror', None) or exc}",
                              hint="free some space, or pass a writable --state-dir") from None
        log.warning("%s: the saved state in %s %s: moved it to %s (kept, not used); this device starts afresh",
                    self.identity["device"], self.directory, why, target)
        return target

    def save(self, round_no: int, run: str | None, carry: dict[str, torch.Tensor], upload: bytes) -> None:
        if self._held is not None and self._held[0] != run:
            self.set_aside(f"is from another run ({self._held[0]}, not {run})")
        self._held = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            _atomic_write(self.directory / CARRY, lambda p: save_file({k: v.contiguous() for k, v in carry.items()}, str(p)))
            _atomic_write(self.directory / UPLOAD, lambda p: p.write_bytes(upload))
            _atomic_write(self.directory / STATE_JSON,
                          lambda p: p.write_text(json.dumps({**self.identity, "round": round_no, "run": run}, sort_keys=True)))
        except (OSError, SafetensorError) as exc:  # safetensors reports a refused write as its own error
            raise EdgeflError(f"cannot save the device state in {self.directory}: {getattr(exc, 'strerror', None) or exc}",
                              hint="free some space or pass a writable --state-dir") from None

    def save_model(self, state: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
        """Write the device's final model (``model.safetensors``, metadata as a run directory's model
        files carry it: each value JSON) and return its path."""
        path = self.directory / MODEL
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            _atomic_write(path, lambda p: write_model_file(p, state, meta))
        except (OSError, SafetensorError) as exc:
            raise EdgeflError(f"cannot save the device's model in {self.directory}: {getattr(exc, 'strerror', None) or exc}",
                              hint="free some space or pass a writable --state-dir") from None
        return path

    def load(self) -> tuple[int, str | None, dict[str, torch.Tensor], bytes] | None:
        """(round, run, carried tensors, packed upload) of the last round saved; None when the folder
        holds no state, or held state of another config, federation or format (moved aside: a
        changed config starts afresh, section 9). State of another device is an error: continuing
        from it would mix two devices, and moving it would take it from the device it belongs to."""
        path = self.directory / STATE_JSON
        if not path.is_file():
            return None
        # unreadable files (a power cut mid-write of the file system, a full disk, a hand edit) are
        # kept aside, not deleted, and the device starts afresh: failing instead would fail again at
        # every restart (a crash loop under systemd's Restart=always)
        try:
            info: Any = loads(path.read_bytes()[:4096], str(path))
            if not isinstance(info, dict) or not isinstance(info.get("round"), int):
                raise PayloadError("not a device state file")
        except (OSError, PayloadError, ValueError) as exc:
            self.lost = f"{STATE_JSON} cannot be read ({str(exc)[:120]})"
            self.set_aside(f"cannot be read ({str(exc)[:200]}){_LOST}")
            return None
        theirs = {k: info.get(k) for k in self.identity}
        if theirs["device"] != self.identity["device"]:
            raise EdgeflError(f"the device state in {self.directory} belongs to device {str(theirs['device'])[:64]!r}, "
                              f"not {self.identity['device']!r}",
                              hint="give every device its own --state-dir (the default is one folder per device id)")
        if theirs != self.identity:
            differs = ", ".join(k for k in self.identity if theirs[k] != self.identity[k])
            self.set_aside(f"is from another config ({differs} differ)")
            return None
        reading = CARRY  # named in the line: a safetensors error does not name its file
        try:
            tensors = load_file(str(self.directory / CARRY))
            reading = UPLOAD
            upload = (self.directory / UPLOAD).read_bytes()
            # checked here, whole (magic, header, body digest): a damaged upload found only when the
            # server's first message arrives would be blamed on that message, and the device stall
            unpack(upload, len(upload))
        except (OSError, ValueError, RuntimeError, SafetensorError, PayloadError) as exc:
            run = str(info.get("run"))[:64]
            self.lost = f"the state saved after round {info['round']} cannot be read ({reading}: {str(exc)[:120]})"
            self.set_aside(f"(after round {info['round']} of run {run}) cannot be read ({reading}: {str(exc)[:200]}){_LOST}")
            return None
        run = info.get("run") if isinstance(info.get("run"), str) else None
        self._held = (run,)
        return info["round"], run, tensors, upload
