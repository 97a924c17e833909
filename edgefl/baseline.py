"""What federation bought: the Local-only baseline beside a run, and what FedAvg would have sent.

``simulation.baseline = "local"`` makes ``edgefl simulate`` train, after the run, the same devices
on the same data with the same seed and training settings but the ``local`` method (nothing
shared) into ``RUN_DIR/baseline`` (a run directory of its own: metrics.jsonl, summary.json, plots).
:func:`compare` then puts both side by side in the run's ``summary.json``; ``edgefl report`` and
the plots read ``RUN_DIR/baseline/metrics.jsonl``.

FedAvg's bytes are what a weights exchange would have cost this fleet: each device's model's
state dict serialised as an upload (the body a FedAvg device sends, and its group model coming
down is the same size), counted for the devices each round selected and heard from.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgefl.rundir import RunDir

if TYPE_CHECKING:  # the report reads baselines without loading torch's model zoo
    from edgefl.build import RunParts
    from edgefl.config import RunConfig

BASELINE_DIR = "baseline"
#: the method the baseline runs and how tables and plots name it
BASELINE_METHOD = "local"
BASELINE_LABEL = "Local-only"


def baseline_config(cfg: RunConfig) -> RunConfig:
    """``cfg`` with the Local-only method: devices, data, seed, rounds, training and evaluation as
    they are (so every device draws the same initial weights and batches), nothing exported or
    tracked, and no baseline of its own."""
    from edgefl.config import RunConfig

    raw = cfg.to_dict()
    raw["name"] = f"{cfg.name}-{BASELINE_METHOD}"
    raw["method"] = {"name": BASELINE_METHOD}
    # its clients train every round (nothing one-shot to keep or take from another run)
    sim = {k: v for k, v in raw.get("simulation", {}).items() if k not in ("keep_clients", "clients_from")}
    raw["simulation"] = {**sim, "baseline": "none"}
    raw["export"], raw["track"] = [], []
    raw.pop("tracking_uri", None)
    return RunConfig.model_validate(raw)


def wants_baseline(cfg: RunConfig) -> bool:
    """A baseline is asked for and means something (Local-only beside itself would not)."""
    return cfg.simulation.baseline == BASELINE_METHOD and cfg.method.name != BASELINE_METHOD


def baseline_parts(parts: RunParts) -> RunParts:
    """The run's own devices (models, shares, views) and test set under the baseline's config:
    resolved once, so a device whose model was assigned for the method keeps it."""
    from edgefl.build import RunParts

    return RunParts(baseline_config(parts.cfg), parts.ds, parts.slots, parts.x_test, parts.y_test)


def weights_bytes(parts: RunParts) -> dict[str, int]:
    """Per device, the bytes of an upload carrying its model's whole state dict (what FedAvg sends
    up each round, and receives down as its group's model)."""
    import torch

    from edgefl.messages import Message, encode
    from edgefl.models import build_model

    sizes: dict[tuple, int] = {}
    out: dict[str, int] = {}
    with torch.random.fork_rng(devices=[]):  # building a model draws weights: leave the run's RNG as it was
        for slot in parts.slots:
            shape = tuple(slot.input_shape(parts.ds))
            key = (slot.model, repr(sorted(slot.model_options.items())), shape)
            if key not in sizes:
                model = build_model(slot.model, num_classes=parts.ds.num_classes, input_shape=shape, **slot.model_options)
                sizes[key] = len(encode(Message("weights", 1, slot.client_id, model.state_dict())))
            out[slot.client_id] = sizes[key]
    return out


def fedavg_traffic(metrics: list[dict[str, Any]], per_device: dict[str, int]) -> dict[str, Any]:
    """What FedAvg would have sent over the same rounds: every device heard from uploads its
    weights and every device selected downloads them (asynchronous: one of each per report)."""
    up = down = 0
    for m in metrics:
        reports = m.get("reports_per_client")
        if reports:
            n = sum(per_device.get(d, 0) * k for d, k in reports.items())
            up, down = up + n, down + n
        else:
            up += sum(per_device.get(d, 0) for d in m.get("reported", []))
            down += sum(per_device.get(d, 0) for d in m.get("selected", []))
    return {"weights_bytes_per_device": dict(sorted(per_device.items())), "bytes_up_total": up, "bytes_down_total": down,
            "per_round_up": round(up / len(metrics)) if metrics else 0, "per_round_down": round(down / len(metrics)) if metrics else 0}


def evaluated(metrics: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [m for m in metrics if m.get("accuracy") and m["accuracy"].get("overall") is not None]


def baseline_metrics(run: RunDir) -> list[dict[str, Any]] | None:
    """The baseline's records of a run directory (None: it has no baseline)."""
    path = run.path / BASELINE_DIR / "metrics.jsonl"
    if not path.is_file():
        return None
    return RunDir(run.path / BASELINE_DIR).metrics()


def compare(run: RunDir) -> dict[str, Any] | None:
    """The method against its baseline at the method's last judged round (or the baseline's last,
    when it was interrupted earlier): accuracy per architecture and overall, and the gain."""
    base = baseline_metrics(run)
    if base is None:
        return None
    mine, theirs = evaluated(run.metrics()), evaluated(base)
    if not mine or not theirs:
        return {"method": BASELINE_METHOD, "run_dir": str(Path(run.path) / BASELINE_DIR), "round": None}
    at = {m["round"]: m for m in theirs}
    ours = mine[-1]
    other = at.get(ours["round"])
    if other is None:  # the baseline stopped early: compare where both were judged
        common = [m for m in mine if m["round"] in at]
        if not common:
            return {"method": BASELINE_METHOD, "run_dir": str(Path(run.path) / BASELINE_DIR), "round": None}
        ours, other = common[-1], at[common[-1]["round"]]
    a, b = ours["accuracy"], other["accuracy"]
    per_arch = {arch: round(a["per_arch"][arch] - b["per_arch"][arch], 6)
                for arch in sorted(a["per_arch"]) if b["per_arch"].get(arch) is not None and a["per_arch"][arch] is not None}
    return {
        "method": BASELINE_METHOD,
        "run_dir": str(Path(run.path) / BASELINE_DIR),
        "round": ours["round"],
        "accuracy": {"overall": b["overall"], "per_arch": dict(sorted(b["per_arch"].items()))},
        "method_accuracy": {"overall": a["overall"], "per_arch": dict(sorted(a["per_arch"].items()))},
        "gain": {"overall": round(a["overall"] - b["overall"], 6), "per_arch": per_arch},
        "best_overall_accuracy": max(m["accuracy"]["overall"] for m in theirs),
    }


def verdict(comparison: dict[str, Any] | None, method: str) -> str | None:
    """One plain sentence on what federation bought (None without a baseline to compare)."""
    if not comparison or comparison.get("round") is None:
        return None
    gain = comparison["gain"]["overall"]
    archs = comparison["gain"]["per_arch"]
    better = sum(1 for g in archs.values() if g > 0)
    where = f"; better on {better} of {len(archs)} architectures" if archs else ""
    points = f"{100 * abs(gain):.1f} points"
    if gain > 0:
        return f"{method} beats {BASELINE_LABEL} by {points} overall at round {comparison['round']}{where}"
    if gain < 0:
        return (f"{method} is {points} BELOW {BASELINE_LABEL} overall at round {comparison['round']}{where}: "
                "on this run, federation did not pay")
    return f"{method} equals {BASELINE_LABEL} overall at round {comparison['round']}{where}"
