"""Experiment tracking in the tools researchers already use: TensorBoard event files and MLflow,
through their own libraries (``pip install -e '.[track]' in the edgefl checkout``).

Switched on with ``track = ["tensorboard", "mlflow"]`` in the config or ``--track`` on the command
line. The run session calls the trackers (the same in a simulation and a fleet): at the start
(the config as parameters / text), after every round (accuracy overall and per architecture,
bytes up and down, mean training loss, round time) and at the end (the summary, the plots as
artifacts, the run's status). TensorBoard writes into ``RUN_DIR/tensorboard``; MLflow into
``tracking_uri`` (default: a local file store in ``RUN_DIR/mlruns``), experiment = the run name.
"""

from __future__ import annotations

import json
import os
import re
import statistics
from pathlib import Path
from typing import Any

from edgefl.config import RunConfig
from edgefl.errors import EdgeflError

TRACKERS = ("tensorboard", "mlflow")


def round_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of one round a tracker plots, by name."""
    out: dict[str, float] = {"comm/bytes_up": float(record["bytes_up"]), "comm/bytes_down": float(record["bytes_down"]),
                             "time/round_s": float(record.get("round_time_s") or 0.0)}
    acc = record.get("accuracy")
    if acc and acc.get("overall") is not None:
        out["accuracy/overall"] = float(acc["overall"])
        for arch, value in sorted((acc.get("per_arch") or {}).items()):
            if value is not None:
                out[f"accuracy/{arch}"] = float(value)
    rate = record.get("lr")  # train.lr_milestones: one rate, or each architecture's
    if isinstance(rate, (int, float)):
        out["train/lr"] = float(rate)
    elif isinstance(rate, dict):
        out.update({f"train/lr/{arch}": float(value) for arch, value in sorted(rate.items())})
    losses = [v for v in (record.get("train_loss") or {}).values() if v is not None]
    if losses:
        out["train/loss_mean"] = float(statistics.fmean(losses))
    return out


def _flat(prefix: str, value: Any, out: dict[str, str]) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flat(f"{prefix}.{key}" if prefix else str(key), inner, out)
    else:
        out[prefix] = json.dumps(value)[:500] if not isinstance(value, str) else value[:500]


class TensorBoardTracker:
    def __init__(self, cfg: RunConfig, run_path: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise EdgeflError("track = tensorboard needs the tensorboard package", hint="pip install -e '.[track]' in the edgefl checkout") from None
        self.directory = run_path / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.directory))
        self.writer.add_text("config", "```toml\n" + cfg.to_toml() + "\n```", 0)

    def log_round(self, record: dict[str, Any]) -> None:
        for name, value in round_scalars(record).items():
            self.writer.add_scalar(name, value, record["round"])
        self.writer.flush()

    def finish(self, summary: dict[str, Any], run_path: Path, interrupted: bool) -> None:
        self.writer.add_text("summary", "```json\n" + json.dumps(summary, indent=1, default=str)[:20000] + "\n```", 0)
        self.writer.close()


class MlflowTracker:
    def __init__(self, cfg: RunConfig, run_path: Path, tracking_uri: str | None) -> None:
        try:
            import mlflow
        except ImportError:
            raise EdgeflError("track = mlflow needs the mlflow package", hint="pip install -e '.[track]' in the edgefl checkout") from None
        self.mlflow = mlflow
        self.uri = tracking_uri or (run_path / "mlruns").resolve().as_uri()
        if self.uri.startswith("file:"):
            # MLflow 3 keeps its file store only on request; a run directory's own store needs no
            # database server (or the SQLAlchemy a SQLite store would pull onto a device's host)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        mlflow.set_tracking_uri(self.uri)
        mlflow.set_experiment(cfg.name)
        self.run = mlflow.start_run(run_name=run_path.name)
        params: dict[str, str] = {}
        _flat("", cfg.to_dict(), params)
        mlflow.log_params(params)
        mlflow.set_tags({"edgefl.method": cfg.method.name, "edgefl.dataset": cfg.data.dataset, "edgefl.run_dir": str(run_path)})

    def log_round(self, record: dict[str, Any]) -> None:
        # MLflow names allow letters, digits and _-. :/ only: "fedhe-cnn-0(width=0.25)" -> "fedhe-cnn-0_width_0.25_"
        scalars = {re.sub(r"[^A-Za-z0-9_\-. :/]", "_", name.replace("/", ".")): value for name, value in round_scalars(record).items()}
        self.mlflow.log_metrics(scalars, step=record["round"])

    def finish(self, summary: dict[str, Any], run_path: Path, interrupted: bool) -> None:
        for name in ("summary.json", "config.toml", "run.json"):
            if (run_path / name).is_file():
                self.mlflow.log_artifact(str(run_path / name))
        if (run_path / "plots").is_dir():
            self.mlflow.log_artifacts(str(run_path / "plots"), artifact_path="plots")
        self.mlflow.end_run(status="KILLED" if interrupted else "FINISHED")


class Trackers:
    """The trackers a config asks for; a no-op without any."""

    def __init__(self, cfg: RunConfig, run_path: Path | None) -> None:
        self.items: list[Any] = []
        self.run_path = run_path
        if run_path is None or not cfg.track:
            return
        for name in cfg.track:
            self.items.append(TensorBoardTracker(cfg, run_path) if name == "tensorboard" else MlflowTracker(cfg, run_path, cfg.tracking_uri))

    def log_round(self, record: dict[str, Any]) -> None:
        for tracker in self.items:
            tracker.log_round(record)

    def finish(self, summary: dict[str, Any], interrupted: bool) -> None:
        for tracker in self.items:
            tracker.finish(summary, self.run_path, interrupted)  # type: ignore[arg-type]
        self.items = []
