"""Which model a phone should get from a run, and why (``RUN_DIR/ship.json``; docs/export.md).

* A method with global models (FedAvg's groups, FedIN, Felo's groups, FedMHO, FedCVAE-Ens): the
  server's global model of each architecture (``models/global-<arch>.safetensors``).
* A method that keeps one model per device (FedHe, CHFL, Velo's and Felo's devices without a
  shared group, local-only): one model per architecture, the device's whose accuracy on its
  own held-out data (or on the shared test set) was best in the last evaluation; ties go to the
  device with more samples. Its weights are written as ``models/ship-<arch>.safetensors`` where
  the run holds them (a simulation); in a fleet they stay on that device, and ship.json names it
  (the device writes them as ``model.safetensors`` in its state folder when the run ends).
  Averaging the weights of independently trained devices of one architecture is not done: their
  models start from different initialisations, and an average of them is no model at all.

For every phone class of the catalog (``device_class = "phone"``) the plan names, of the shipped
models that fit it by ``edgefl assign``'s budgets, the most accurate in the run's last evaluation
(the largest that fits when the run measured none); ``edgefl export RUN_DIR`` exports those files
by default (every device's private model only when asked, ``--all``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from edgefl.build import DeviceSlot, device_model_meta
from edgefl.config import RunConfig
from edgefl.data import Dataset
from edgefl.models import get_spec
from edgefl.rundir import RunDir, safe_name

log = logging.getLogger("edgefl.server")

PLAN_FILE = "ship.json"


def _phones(cfg: RunConfig, ds: Dataset, shipped: dict[str, dict[str, Any]], slots: list[DeviceSlot]) -> dict[str, Any]:
    """The model each phone class of the catalog gets among the run's shipped ones: of those that fit
    it (``edgefl assign``'s budgets: it could train it in a round too), the most accurate in the run's
    last evaluation; without accuracies, the largest that fits, as ``edgefl assign`` picks."""
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
        largest = result.chosen.label  # assign labels a candidate as DeviceSlot.arch names it: model(option=value,...)
        fitting = [v.label for v in result.verdicts if v.fits and v.label in shipped and v.estimate.kind == "classifier"]
        scored = {a: acc for a in fitting if isinstance(acc := shipped[a].get("accuracy"), (int, float))}
        arch, why = largest, f"edgefl assign: {result.reason}"
        if len(scored) > 1:
            # a bigger model is not always the better one (a group with fewer devices, less data): of those
            # that fit, the phone gets the one the run measured best; ties keep the larger
            best = max(scored, key=lambda a: (scored[a], a == largest))
            if best != largest:
                arch = best
                why = (f"the most accurate of the {len(fitting)} shipped models that fit it ({scored[best]:.4f} against "
                       + (f"{scored[largest]:.4f} for the largest that fits, {largest}" if largest in scored
                          else f"the largest that fits, {largest}, unmeasured") + ")")
            else:
                why += f"; also the most accurate of the {len(fitting)} that fit ({scored[best]:.4f})"
        out[profile.id] = {"arch": arch, "file": shipped.get(arch, {}).get("file"), "accuracy": scored.get(arch),
                           "largest_that_fits": largest, "why": why,
                           **({"device": shipped[arch]["device"]} if shipped.get(arch, {}).get("device") else {})}
    return out


def _judged_on(cfg: RunConfig, slot: DeviceSlot, shared_test_samples: int | None, validation: int | None = None) -> str:
    """What a device's reported accuracy was measured on, with the count where the server knows it: a
    best device picked on a handful of held-out samples should say so. ``validation``: the count a
    device holding its own data enrolled with."""
    if cfg.data.device_held:
        return f"its {validation} validation samples" if validation else "its own validation data"
    if slot.test_indices is not None:
        return f"its {len(slot.test_indices)} held-out samples"
    return f"the shared test set ({shared_test_samples} samples)" if shared_test_samples else "the shared test set"


def write_ship_plan(run_dir: RunDir, cfg: RunConfig, ds: Dataset, slots: list[DeviceSlot], server, device_accuracy: dict[str, float],
                    device_models: dict[str, dict[str, torch.Tensor]] | None, run_id: str | None = None,
                    arch_accuracy: dict[str, float] | None = None, shared_test_samples: int | None = None,
                    validation_samples: dict[str, int] | None = None) -> dict[str, Any]:
    """Decide and write what a phone should get (``device_models``: each device's weights when
    this process holds them, a simulation; None in a fleet). ``run_id``: the server's id of the run
    (a fleet device's model file names it, so the two can be matched). ``arch_accuracy``: each
    architecture's accuracy in the run's last evaluation (its ``per_arch``), for the global models;
    ``shared_test_samples``: the size of the test set devices judge on when they hold no split of their own;
    ``validation_samples``: each device's validation count as it enrolled, when devices hold their data."""
    globals_ = server.global_models()
    shipped: dict[str, dict[str, Any]] = {}
    if globals_:
        for arch in globals_:
            acc = (arch_accuracy or {}).get(arch)
            shipped[arch] = {"file": f"models/global-{safe_name(arch)}.safetensors",
                             "accuracy": float(acc) if isinstance(acc, (int, float)) else None,
                             "why": f"the server's global model of {arch} ({cfg.method.name})"}
        kind = "global"
    else:
        kind = "best device per architecture"
        groups: dict[str, list[DeviceSlot]] = {}
        for slot in slots:
            if get_spec(slot.model).kind == "classifier":
                groups.setdefault(slot.arch, []).append(slot)
        for arch, members in groups.items():
            # best first: accuracy in the last evaluation, ties to more samples; the rest is the order to fall back
            # in when the best device's model is gone (an asynchronous device that reported, then died before the
            # run ended, never writes its final model)
            ranked = sorted(members, key=lambda s: (-device_accuracy.get(s.client_id, -1.0), -len(s.sample_indices)))
            reported = [m for m in ranked if m.client_id in device_accuracy]
            best = ranked[0]
            acc = device_accuracy.get(best.client_id)
            on = _judged_on(cfg, best, shared_test_samples, (validation_samples or {}).get(best.client_id))
            judged = (f"accuracy {acc:.4f} on {on} in the last evaluation" if acc is not None else "no accuracy reported (most samples)")
            # counted among those that reported: a device that declined or never joined was no candidate
            judged_devices = len(reported) or len(members)
            among = f"the {judged_devices} of {len(members)} device(s) training {arch} that reported" if judged_devices < len(members) \
                else f"the {len(members)} device(s) training {arch}"
            entry: dict[str, Any] = {"device": best.client_id, "accuracy": acc, "judged_on": on if acc is not None else None,
                                     "why": f"{cfg.method.name} keeps a model per device: {best.client_id}'s, the best of {among} ({judged})"}
            if len(reported) > 1:
                entry["ranked"] = [{"device": m.client_id, "accuracy": device_accuracy[m.client_id]} for m in reported]
            if device_models is not None and best.client_id in device_models:
                name = f"ship-{safe_name(arch)}"
                run_dir.save_model(name, device_models[best.client_id], {**device_model_meta(cfg, ds, best, "ship"), "accuracy": acc})
                entry["file"] = f"models/{name}.safetensors"
            else:
                entry["file"] = None
                entry["where"] = (f"on device {best.client_id}: model.safetensors in its state folder (edgefl client --state-dir), "
                                  f"written when the run ended (its metadata's run is {run_id}; a later run moves it into old/); "
                                  f"copy it and run edgefl export on it with --dataset {ds.name}. The server never holds a device's "
                                  "private model")
            shipped[arch] = entry
    plan = {"kind": kind, "method": cfg.method.name, "dataset": ds.name, "run_id": run_id, "models": shipped, "phones": _phones(cfg, ds, shipped, slots)}
    run_dir.write_json(PLAN_FILE, plan)
    return plan


def adopt_device_models(run_dir: RunDir, state_dirs: dict[str, Any]) -> list[str]:
    """A local fleet (``edgefl fleet``, every device's state folder on this machine): copy each
    device's final model (``model.safetensors``, written when the run ended) into the run
    directory as a simulation saves it (``models/<device>-<arch>.safetensors``), and the model
    ship.json names into ``models/ship-<arch>.safetensors``, so the run directory exports alike
    whichever runner played it. Returns the files written. A method with global models ships
    those, and nothing is copied.

    It runs after the devices have exited, not in the server's own finish: a device writes its file
    only when it hears the server's end of the run, after the server wrote ship.json."""
    import shutil

    from edgefl.device_state import MODEL
    from edgefl.rundir import load_model_file

    path = run_dir.path / PLAN_FILE
    try:
        plan = run_dir.read_json(PLAN_FILE) if path.is_file() else None
    except ValueError:
        plan = None
    if not isinstance(plan, dict) or plan.get("kind") == "global":
        return []
    written: list[str] = []
    arch_of: dict[str, str] = {}
    for device, folder in sorted(state_dirs.items()):
        source = Path(folder) / MODEL
        if not source.is_file():
            continue
        try:
            _, meta = load_model_file(source)
        except Exception as exc:  # a device's file this process did not write: said, and left out
            log.warning("%s: its model file %s is unreadable (%s); not copied into the run directory", device, source, exc)
            continue
        arch = meta.get("arch")
        if not isinstance(arch, str) or not arch:
            continue
        arch_of[device] = arch
        target = run_dir.path / "models" / f"{device}-{safe_name(arch)}.safetensors"
        shutil.copyfile(source, target)
        written.append(str(target.relative_to(run_dir.path)))
    for arch, entry in (plan.get("models") or {}).items():
        if not isinstance(entry, dict) or entry.get("file") is not None:
            continue
        device = _adoptable(arch, entry, arch_of)
        if device is not None:
            name = f"models/ship-{safe_name(arch)}.safetensors"
            shutil.copyfile(Path(state_dirs[device]) / MODEL, run_dir.path / name)
            entry["file"] = name
            entry.pop("where", None)
            written.append(name)
            for pick in (plan.get("phones") or {}).values():  # the phone classes given this architecture get its file too
                if isinstance(pick, dict) and pick.get("arch") == arch:
                    pick["file"] = name
                    if "device" in pick:
                        pick["device"], pick["accuracy"] = device, entry.get("accuracy")
    if written:
        run_dir.write_json(PLAN_FILE, plan)
        try:
            summary = run_dir.read_json("summary.json")
            summary["ship"] = plan
            run_dir.write_json("summary.json", summary)
        except (OSError, ValueError, TypeError):
            pass  # the summary is the server's; ship.json is the plan's own record
    return written


def _adoptable(arch: str, entry: dict[str, Any], arch_of: dict[str, str]) -> str | None:
    """The device whose final model ships for ``arch``: the one ship.json names when it left its file,
    else the next best in its ``ranked`` list that did (``entry`` is updated to say so), else None."""
    named = entry.get("device")
    if arch_of.get(named) == arch:
        return named
    for pick in entry.get("ranked") or []:
        device = pick.get("device") if isinstance(pick, dict) else None
        if device != named and arch_of.get(device) == arch:
            acc = pick.get("accuracy")
            entry["why"] = (f"{named}, the best that reported, left no final model (its process ended before the run did); "
                            f"{device}'s instead, the next best that did"
                            + (f" (accuracy {acc:.4f})" if isinstance(acc, (int, float)) else ""))
            entry["device"], entry["accuracy"] = device, acc
            entry.pop("judged_on", None)  # it described the first pick's data
            return device
    return None
