"""The trained clients of a one-shot run, kept so that another server half can fuse them again.

In a one-shot method (FedMHO, FedMHO-MD, -SD, FedCVAE-Ens) the clients' side is one round of
local training whose uploads do not depend on the server's method: FedMHO, -MD and -SD differ only
in how the server fuses the same classifiers and decoders. ``simulation.keep_clients = true`` saves
each device's upload (the client half's message, before any upload filter) and its trained state
into ``RUN_DIR/clients/``; ``simulation.clients_from = RUN_DIR`` in another run takes them instead of
training. The server half sees the same messages it would have seen (the uploads still pass the
device's filters, the envelope and every server check), and each device's model holds the trained
weights, so what it is asked to evaluate and what is saved of it are what training would have left.
A run on the same machine gives the numbers of the run that trained (tests/test_kept_clients.py).

Everything here is read back as untrusted input: a bounded manifest, each file's size and SHA-256
checked before it is decoded, messages through :func:`edgefl.messages.decode` and states through
safetensors (no pickle). A source whose clients were trained on another config (data, seed, fleet,
training, or a method whose client half differs) is refused, naming what differs.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from edgefl.configtools import config_differences
from edgefl.errors import ConfigError, PayloadError
from edgefl.messages import Message, decode, encode
from edgefl.methods import get_method
from edgefl.safejson import loads
from edgefl.tensorchecks import nonfinite_problem

CLIENTS_DIR = "clients"
MANIFEST = "clients.json"
FORMAT = "edgefl-kept-clients-1"
MAX_MANIFEST_BYTES = 4 << 20
MAX_DEVICES = 100_000
#: what decides a client's training: the source's and this run's must agree on every one of these
CLIENT_KEYS = ("seed", "rounds", "data", "train", "fleet")

_HINT = "keep the clients with a run of the same config (simulation.keep_clients = true), or drop simulation.clients_from"
KEPT_CHANGED = _CHANGED = ("the folder is not as its run kept it: run that run again with simulation.keep_clients = true, or fuse from an "
            "intact copy (the manifest checks integrity, not who wrote it: keep the folder where only you write)")


def refuse_outside_simulation(cfg: Any, runner: str) -> None:
    """Both keys are the simulation's: a fleet's devices train in their own processes, from their own state."""
    sim = cfg.simulation
    if sim.keep_clients or sim.clients_from:
        key = "keep_clients" if sim.keep_clients else "clients_from"
        raise ConfigError(f"simulation.{key} is for edgefl simulate: in {runner} every device trains in its own process",
                          hint=f"drop simulation.{key}, or run the config with edgefl simulate")


def kept_dir(path: str | Path) -> Path:
    """The clients/ folder ``simulation.clients_from`` names: a run directory or the folder itself."""
    p = Path(path).expanduser()
    if p.is_file():
        raise _problem(p, f"a file, not a run directory (the folder of a run that kept its clients, or its {CLIENTS_DIR}/)")
    return p if (p / MANIFEST).is_file() or p.name == CLIENTS_DIR else p / CLIENTS_DIR


def client_config(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """The part of a config (RunConfig.to_dict()) that decides what a one-shot run's clients train:
    CLIENT_KEYS, the method's client half and the method options that half reads."""
    method = dict(cfg_dict.get("method") or {})
    name = str(method.pop("name", ""))
    try:
        spec = get_method(name)
    except ConfigError:
        return {"client_half": f"(unknown method {name!r})", **{k: cfg_dict.get(k) for k in CLIENT_KEYS}}
    read = getattr(spec.options_model, "client_reads", None)  # None: not declared, so every option may matter
    options = method if read is None else {k: v for k, v in method.items() if k in read}
    return {"client_half": spec.client_path, "method_options": options, **{k: cfg_dict.get(k) for k in CLIENT_KEYS}}


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def save_kept(run_path: Path, cfg_dict: dict[str, Any], uploads: dict[str, Message],
              states: dict[str, dict[str, torch.Tensor]], facts: dict[str, Any]) -> Path:
    """Write every device's upload and trained state, then the manifest (last: a folder without
    one is not a set of kept clients). ``facts``: the commit, machine and threads they trained with."""
    folder = run_path / CLIENTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    devices: dict[str, Any] = {}
    for k, device in enumerate(sorted(uploads)):
        message = encode(uploads[device])
        state = st_save({name: t.detach().contiguous().cpu() for name, t in states[device].items()})
        stem = f"{k:05d}"  # device ids may hold characters a file name should not
        _write(folder / f"{stem}.msg", message)
        _write(folder / f"{stem}.state.safetensors", state)
        devices[device] = {"file": stem, "round": uploads[device].round, "message_bytes": len(message),
                           "message_sha256": _digest(message), "state_bytes": len(state), "state_sha256": _digest(state)}
    manifest = {"format": FORMAT, "client_config": client_config(cfg_dict), "method": (cfg_dict.get("method") or {}).get("name"),
                "devices": devices, **facts}
    _write(folder / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    return folder


def _problem(where: Path, why: str, hint: str = _HINT) -> ConfigError:
    return ConfigError(f"simulation.clients_from: {where}: {why}", hint=hint)


def read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    if path.is_symlink():
        raise _problem(path, "a link: the manifest lies in the folder itself", _CHANGED)
    if not path.is_file():
        what = "no such folder" if not folder.parent.exists() else f"no {CLIENTS_DIR}/{MANIFEST} (a run that kept no clients)"
        raise _problem(folder.parent if folder.name == CLIENTS_DIR else folder, what)
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise _problem(path, f"larger than {MAX_MANIFEST_BYTES} bytes: not a manifest of kept clients")
    try:
        manifest = loads(path.read_bytes(), "kept clients' manifest")
    except (OSError, PayloadError) as exc:
        raise _problem(path, f"cannot be read ({exc})", _CHANGED) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise _problem(path, f"not a manifest of kept clients (format {FORMAT!r} expected)")
    devices = manifest.get("devices")
    if not isinstance(devices, dict) or not 0 < len(devices) <= MAX_DEVICES:
        raise _problem(path, "its 'devices' is not a table of 1 to 100,000 devices")
    for device, entry in devices.items():
        ok = isinstance(entry, dict) and isinstance(entry.get("file"), str) and entry["file"].isdigit() and len(entry["file"]) <= 8 \
            and all(isinstance(entry.get(k), int) and not isinstance(entry.get(k), bool) and entry[k] >= 0
                    for k in ("round", "message_bytes", "state_bytes")) \
            and all(isinstance(entry.get(k), str) and len(entry[k]) == 64 for k in ("message_sha256", "state_sha256"))
        if not ok:
            raise _problem(path, f"device {str(device)[:60]!r}: malformed entry (file, round, sizes and SHA-256 digests expected)",
                           _CHANGED)
    if not isinstance(manifest.get("client_config"), dict):
        raise _problem(path, "it records no client_config")
    return manifest


def _read_checked(path: Path, size: int, digest: str, limit: int, limit_name: str) -> bytes:
    if size > limit:
        raise _problem(path, f"the manifest gives it {size} bytes, over the {limit}-byte limit ({limit_name})", _CHANGED)
    if path.is_symlink() or not path.is_file():  # what the manifest names lies in the folder itself
        raise _problem(path, "missing, or not a plain file in the folder (a link or a folder)", _CHANGED)
    try:
        if path.stat().st_size != size:
            raise _problem(path, f"{path.stat().st_size} bytes, the manifest says {size} (changed since it was kept)", _CHANGED)
        data = path.read_bytes()
    except OSError as exc:
        raise _problem(path, f"cannot be read ({exc.strerror or exc})", _CHANGED) from None
    if _digest(data) != digest:
        raise _problem(path, "its SHA-256 differs from the manifest's (changed since it was kept)", _CHANGED)
    return data


KeptFit = tuple[Message, dict[str, torch.Tensor]]  # a device's upload and its state after training


def load_kept(path: str | Path, cfg_dict: dict[str, Any], devices: list[str], max_bytes: int) -> tuple[dict[str, KeptFit], dict[str, Any]]:
    """Each device's kept (upload, trained state), checked against this run's config and devices;
    and the manifest's facts (source method, commit, machine) for run.json."""
    folder = kept_dir(path)
    manifest = read_manifest(folder)
    differ = [key for key, _, _ in config_differences(manifest["client_config"], client_config(cfg_dict), into_lists=True)]
    if differ:
        shown = ", ".join(differ[:4]) + (f" and {len(differ) - 4} more" if len(differ) > 4 else "")
        raise _problem(folder, f"its clients trained on another config ({shown} differ{'s' if len(differ) == 1 else ''})")
    if sorted(manifest["devices"]) != sorted(devices):
        extra, lacking = sorted(set(manifest["devices"]) - set(devices)), sorted(set(devices) - set(manifest["devices"]))
        said = "; ".join(part for part in (f"devices this run has not: {', '.join(map(repr, extra[:4]))}" if extra else "",
                                           f"none kept for: {', '.join(map(repr, lacking[:4]))}" if lacking else "") if part)
        raise _problem(folder, f"it kept other devices than this run's ({said})")
    out: dict[str, KeptFit] = {}
    for device in devices:
        entry = manifest["devices"][device]
        msg_path, state_path = folder / f"{entry['file']}.msg", folder / f"{entry['file']}.state.safetensors"
        data = _read_checked(msg_path, entry["message_bytes"], entry["message_sha256"], max_bytes, "network.max_message_bytes")
        try:
            message = decode(data, max_bytes)
        except PayloadError as exc:
            raise _problem(msg_path, f"not a message ({exc})", _CHANGED) from None
        if message.sender != device:
            raise _problem(msg_path, f"a message of {message.sender!r}: the manifest says it is {device!r}'s", _CHANGED)
        if message.round != 1 or entry["round"] != 1:
            raise _problem(msg_path, f"a message of round {message.round} (the manifest says {entry['round']}): a device "
                                     "answers round 1 of a one-shot run", _CHANGED)
        raw = _read_checked(state_path, entry["state_bytes"], entry["state_sha256"], max_bytes * 4,
                            "four times network.max_message_bytes")
        try:
            state = st_load(raw)
        except (SafetensorError, ValueError) as exc:
            raise _problem(state_path, f"not a safetensors state ({exc})", _CHANGED) from None
        bad = nonfinite_problem(message.tensors, "its upload") or nonfinite_problem(state, "its trained state")
        if bad:
            raise _problem(folder, f"device {device!r}: {bad}", _CHANGED)
        out[device] = (message, state)
    facts = {k: manifest.get(k) for k in ("method", "edgefl_commit", "machine", "threads", "compute_device") if k in manifest}
    return out, facts


def fit_problem(message: Message, state: dict[str, torch.Tensor], own: dict[str, torch.Tensor], samples: int,
                uploads: tuple[str, ...]) -> str | None:
    """Why a kept (upload, state) cannot be this device's: a state of another model (``own``: the
    device's carry_state), an upload of a kind the method does not send, that counts other samples
    than the device trains on or (a method that uploads model tensors: FedMHO's weights and
    decoders) whose tensors are not the trained model's."""
    if set(state) != set(own):
        odd = sorted(set(state) ^ set(own))
        return f"its state is of another model ({len(odd)} tensor names differ, e.g. {odd[0][:60]!r})"
    for k in own:
        if tuple(state[k].shape) != tuple(own[k].shape) or state[k].dtype != own[k].dtype:
            return (f"its state is of another model ({k[:60]!r}: {tuple(state[k].shape)} {state[k].dtype}, this device's "
                    f"{tuple(own[k].shape)} {own[k].dtype})")
    if message.kind not in uploads:
        return f"a {message.kind!r} upload: the method's clients send {', '.join(uploads)}"
    counted = message.meta.get("num_samples")
    if type(counted) is not int or counted != samples:
        return f"its upload counts {counted!r} training samples, this device holds {samples} (another device's or seed's files)"
    if set(uploads) <= {"weights", "decoder"}:  # every uploaded tensor is one of the trained model's
        for name, t in message.tensors.items():
            mine = state.get(f"model.{name}")
            if mine is None or tuple(mine.shape) != tuple(t.shape) or mine.dtype != t.dtype or not torch.equal(mine, t):
                return (f"its upload's {name[:60]!r} is not its trained model's (an upload and a state of different devices "
                        "or runs)")
    return None
