"""Which model a phone should get from a run, and why (``RUN_DIR/ship.json``; docs/export.md).

* A method with global models (FedAvg's groups, FedIN, Felo's groups, FedMHO, FedCVAE-Ens): the
  server's global model of each architecture (``models/global-<arch>.safetensors``).
* A method that keeps one model per device (FedHe, CHFL, Velo's and Felo's devices without a
  shared group, local-only): one model per architecture, the device's whose accuracy on its
  own held-out data (or on the shared test set) was best in the last evaluation; ties go to the
  device with more samples. Its weights are written as ``models/ship-<arch>.safetensors`` where
  the run holds them (a simulation); in a fleet they stay on that device, and ship.json names it.
  Averaging the weights of independently trained devices of one architecture is not done: their
  models start from different initialisations, and an average of them is no model at all.

For every phone class of the catalog (``device_class = "phone"``) the plan names the architecture
``edgefl assign`` gives it among the run's architectures; ``edgefl export RUN_DIR`` exports those
files by default (every device's private model only when asked, ``--all``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from edgefl.build import DeviceSlot, held_out_indices
from edgefl.config import RunConfig
from edgefl.data import Dataset
from edgefl.data.views import view_record
from edgefl.models import get_spec
from edgefl.rundir import RunDir

log = logging.getLogger("edgefl.server")

PLAN_FILE = "ship.json"


def safe_name(arch: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in arch).strip("_")


def _phones(cfg: RunConfig, ds: Dataset, shipped: dict[str, dict[str, Any]], slots: list[DeviceSlot]) -> dict[str, Any]:
    """The architecture each phone class of the catalog gets among the run's shipped ones."""
    from edgefl.profile import catalog
    from edgefl.profile.assign import Budgets, assign

    by_arch = {s.arch: s for s in slots}
    candidates = [(by_arch[a].model, dict(by_arch[a].model_options)) for a in shipped if a in by_arch]
    out: dict[str, Any] = {}
    if not candidates:
        return out
    train = cfg.train
    budgets = Budgets(headroom=cfg.clock.headroom, deadline_s=cfg.clock.deadline_s, batch=train.batch_size)
    for profile in catalog().values():
        if profile.device_class != "phone":
            continue
        try:
            result = assign(profile, budgets, cfg.method.name, candidates, input_shape=tuple(ds.input_shape), num_classes=ds.num_classes)
        except Exception as exc:  # the plan must never stop a finished run from being written
            out[profile.id] = {"arch": None, "why": f"could not assign: {type(exc).__name__}: {exc}"}
            continue
        if result.chosen is None:
            out[profile.id] = {"arch": None, "why": result.reason}
            continue
        arch = result.chosen.label  # assign labels a candidate as DeviceSlot.arch names it: model(option=value,...)
        out[profile.id] = {"arch": arch, "file": shipped.get(arch, {}).get("file"), "why": f"edgefl assign: {result.reason}"}
    return out


def _held_out(cfg: RunConfig, slot: DeviceSlot) -> dict[str, Any]:
    held = held_out_indices(cfg, [slot])
    return {"held_out_indices": held} if held else {}


def write_ship_plan(run_dir: RunDir, cfg: RunConfig, ds: Dataset, slots: list[DeviceSlot], server, device_accuracy: dict[str, float],
                    device_models: dict[str, dict[str, torch.Tensor]] | None, meta: dict[str, Any]) -> dict[str, Any]:
    """Decide and write what a phone should get (``device_models``: each device's weights when
    this process holds them, a simulation; None in a fleet)."""
    globals_ = server.global_models()
    shipped: dict[str, dict[str, Any]] = {}
    if globals_:
        for arch in globals_:
            shipped[arch] = {"file": f"models/global-{safe_name(arch)}.safetensors",
                             "why": f"the server's global model of {arch} ({cfg.method.name})"}
        kind = "global"
    else:
        kind = "best device per architecture"
        groups: dict[str, list[DeviceSlot]] = {}
        for slot in slots:
            if get_spec(slot.model).kind == "classifier":
                groups.setdefault(slot.arch, []).append(slot)
        for arch, members in groups.items():
            best = max(members, key=lambda s: (device_accuracy.get(s.client_id, -1.0), len(s.sample_indices)))
            acc = device_accuracy.get(best.client_id)
            judged = f"accuracy {acc:.4f} in the last evaluation" if acc is not None else "no accuracy reported (most samples)"
            entry: dict[str, Any] = {"device": best.client_id, "accuracy": acc,
                                     "why": f"{cfg.method.name} keeps a model per device: {best.client_id}'s, the best of the {len(members)} "
                                            f"device(s) training {arch} ({judged})"}
            if device_models is not None and best.client_id in device_models:
                name = f"ship-{safe_name(arch)}"
                run_dir.save_model(name, device_models[best.client_id],
                                   {**meta, "arch": arch, "model": best.model, "model_options": best.model_options, "scope": "ship",
                                    "client_id": best.client_id, "input_shape": list(best.input_shape(ds)), "accuracy": acc,
                                    "view": view_record(best.view) if best.view else None,
                                    **_held_out(cfg, best)})
                entry["file"] = f"models/{name}.safetensors"
            else:
                entry["file"] = None
                entry["where"] = (f"on device {best.client_id} (its state folder, edgefl client --state-dir: carry.safetensors, "
                                  "tensors model.*): the server never holds a device's private model")
            shipped[arch] = entry
    plan = {"kind": kind, "method": cfg.method.name, "models": shipped, "phones": _phones(cfg, ds, shipped, slots)}
    run_dir.write_json(PLAN_FILE, plan)
    return plan
