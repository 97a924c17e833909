"""Helpers shared by the benchmarks: run a config in-process and collect comparable numbers."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch

from edgefl.config import validate_config
from edgefl.data import load_dataset
from edgefl.environment import machine, package_versions, source_commit
from edgefl.sim import Simulation

RESULTS = Path(__file__).parent / "results"


def users_path(path: str | Path) -> Path:
    """A path the user gave on the command line (also an argparse ``type``): ./dev.sh runs a benchmark
    in the checkout, so a relative one is taken from the folder they ran it in (EDGEFL_CALLER_DIR)."""
    path, caller = Path(path), os.environ.get("EDGEFL_CALLER_DIR")
    return Path(caller) / path if caller and not path.is_absolute() else path


def users_file(path: str | Path) -> Path:
    """An argparse ``type`` for a file the user names (a results file to merge or re-read): taken as
    :func:`users_path` does, and said plainly when it is not there (a traceback was)."""
    import argparse

    found = users_path(path)
    if not found.is_file():
        raise argparse.ArgumentTypeError(f"{found} is not a file (a relative path is taken from the folder you ran in)")
    return found


def read_results(path: Path, key: str) -> list[Any]:
    """The ``key`` list of a benchmark's results file, or an exit that says the file is not one."""
    try:
        held = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise SystemExit(f"{path} cannot be read as a results file: {str(exc)[:120]}") from None
    if not isinstance(held, dict) or not isinstance(held.get(key), list):
        raise SystemExit(f"{path} is not this benchmark's results file (no {key!r} list): give a file it wrote in bench/results/")
    return held[key]


def run_config(raw: dict[str, Any], dataset=None) -> dict[str, Any]:
    cfg = validate_config(raw, "benchmark config")
    sim = Simulation(cfg, None, dataset=dataset, show_progress=False)
    summary = sim.run()
    return {"summary": summary, "history": sim.history}


def load(name: str = "fashion-mnist"):
    return load_dataset(name)


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def checkout_problem(authors: Path, files: tuple[str, ...], repo: str) -> str | None:
    """Why ``authors`` is not a checkout of the authors' ``repo`` (github owner/name) that a
    side-by-side script can run, or None: said before any training, with the clone command."""
    missing = [f for f in files if not (authors / f).is_file()]
    if not missing:
        return None
    where = f"{authors} does not exist" if not authors.exists() else f"{authors} is not a checkout of github.com/{repo} (missing {', '.join(missing)})"
    return f"{where}; git clone https://github.com/{repo} and pass its folder as --authors-dir"


def save(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    payload = {
        **payload,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(),
        "edgefl_commit": source_commit(),  # the code that made the numbers ("-dirty": with uncommitted changes)
        "versions": package_versions(),
        "platform": platform.platform(),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "torch_threads": torch.get_num_threads(),
    }
    path = RESULTS / f"{name}.json"
    part = path.with_suffix(".json.part")  # written whole, then renamed: a run stopped mid-write leaves the last save
    part.write_text(json.dumps(payload, indent=2, default=str))
    part.replace(path)
    return path


def accuracy_logger(log: Callable[[str], None], prefix: str, what: str) -> Callable[[dict[str, Any]], None]:
    """An ``on_round`` callback logging each judged record's overall accuracy: "PREFIX round N: WHAT 0.xxxx"."""

    def on_record(rec: dict[str, Any]) -> None:
        acc = (rec.get("accuracy") or {}).get("overall")
        if acc is not None:
            log(f"{prefix} {rec.get('round')}: {what} {acc:.4f}")

    return on_record


def plot_curves(curves: dict[str, tuple[list, list]], title: str, ylabel: str, out: Path, highlight: str | None = None) -> Path:
    """One accuracy-per-round figure: a line per label, the highlighted one thicker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, (xs, ys) in curves.items():
        ax.plot(xs, ys, label=label, lw=2.2 if label.split(" ")[0] == highlight else 1.2)
    ax.set_xlabel("round")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, out)


def save_figure(fig, out: Path) -> Path:
    """Lay out, write (folders made) and close a benchmark's figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
