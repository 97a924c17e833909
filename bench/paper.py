"""The seed papers' tables, one command each (issue 38), at the papers' scale or scaled to a CPU.

    ./dev.sh bench paper TABLE [--scale paper|cpu] [--device auto|cpu|cuda] [--seeds 0,1,2]
                               [--out DIR] [--cells KEY,KEY] [--set KEY=VALUE] [--report-only] [--list]
                               [--probe SECONDS] [--merge TABLE_JSON]

TABLE is one of ``fedhe``, ``fedin``, ``felo-velo``, ``fedmho``, ``chfl`` (``--list`` says what each
runs and what the paper reports). Every cell of a table (a method, a partition, a seed) is one
``edgefl simulate`` run of its own in ``OUT/<cell>/`` (OUT defaults to
``bench/results/paper/<table>-<scale>``), so a table can be filled in several sittings and on
several machines:

* a cell whose run finished is not run again;
* a cell that was stopped (Ctrl-C, a closed session, a lent GPU handed back) resumes from its last
  checkpoint (``simulation.checkpoint_every``, and every stop) with the numbers an uninterrupted
  run gives (``edgefl simulate --resume``); CHFL's cells, seconds long, keep no checkpoint and run again;
* a finished cell that ran with another config (another ``--set``) is refused, not counted: a smoke
  run's cells belong in a folder of their own;
* the FedMHO, -MD and -SD cells of one alpha and seed train the same clients: the first of them
  to run trains and keeps them (``simulation.keep_clients``), the others fuse them again
  (``simulation.clients_from``; docs/simulation.md), with the numbers training them would give
  on the same machine, threads and device;
* copy OUT to another machine with the same data and the same command goes on there;
* or keep only the small ``table.json`` of a sitting (a GPU's, or an earlier session's whose run
  directories are gone) and pass it with ``--merge FILE``: its finished cells count in the report
  and are not run again, each checked against this command's config (a cell whose recorded config
  differs is refused; one from a file written before configs were recorded is taken with its
  commit named).

After the cells (or with ``--report-only``, from whatever cells are done) it prints the paper's row
beside its own, writes ``OUT/table.json`` (each cell's accuracy, final or best as the table's metric says, its run directory,
the seeds, the commit, the machine and the device) and draws ``OUT/table.png``. Rows the paper
reports on a data set this machine does not have (MNIST, CIFAR-10) are shown as the paper's, with
the data set named, beside the Fashion-MNIST run: they are not the same experiment.

``--probe SECONDS`` runs each cell only that long and estimates, from its round and evaluation
times, how long the table takes on this machine and device (``OUT/probe.json``): for planning a lent
GPU's minutes. The estimate includes the run's start-up (data, models). A cell that evaluates less
often than every round is probed evaluating every third round, so that an evaluation is timed apart
(``mean_eval_s``); in a cell that evaluates every round the rounds' times include it, and
``mean_eval_s`` is null.

``--scale paper`` is the papers' setting (for a GPU: it is days of CPU time); ``--scale cpu`` keeps
every choice but the length, the number of devices, the models' width, the local epochs and the
data (600 images a device and a 2,000-image test subset where the paper's are larger; FedIN also
trains a quarter of its devices a round, not a tenth; FedMHO keeps the whole training set and FedHe
the authors' contiguous tenths; CHFL's data set is small enough that its cpu scale is the paper's): ``--list`` gives each table's setting. docs/benchmarks.md
says which rows were measured where; a row no GPU ran stays "not measured".
"""

from __future__ import annotations

import argparse
import codecs
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import tomli_w

ROOT = Path(__file__).resolve().parents[1]
# the cells run `python -m edgefl` from this checkout: the driver imports the same edgefl (not a
# shared environment's editable install of another checkout), so table.json's commit is theirs
sys.path.insert(0, str(ROOT))

from common import RESULTS, save_figure, users_path  # noqa: E402

from edgefl.config import apply_overrides  # noqa: E402
from edgefl.configtools import config_differences  # noqa: E402
from edgefl.environment import machine, package_versions, source_commit  # noqa: E402
from edgefl.errors import EdgeflError  # noqa: E402
from edgefl.rundir import RunDir  # noqa: E402
from edgefl.safetext import printable  # noqa: E402

RESNETS = ("resnet10", "resnet14", "resnet18", "resnet22", "resnet26")


@dataclass
class Cell:
    key: str  # the run directory's name: unique within a table
    row: str  # the table row it fills (a method, perhaps with its setting)
    column: str  # the column (a partition or a Dirichlet alpha)
    seed: int
    config: dict[str, Any]
    metric: str = "final"  # "final": the last evaluation; "best": the best over the run (the paper's habit for CHFL)
    extra: Callable[[dict[str, Any]], dict[str, float]] | None = None  # more rows from the same run (FedMHO's FedAvg reference)
    extra_rows: tuple[str, ...] = ()  # the rows ``extra`` may fill
    #: cells of one group train the same clients (FedMHO, -MD and -SD at one alpha and seed): the first
    #: to run keeps them (simulation.keep_clients), the others fuse them again (simulation.clients_from)
    clients_group: str | None = None


@dataclass
class Table:
    title: str
    note: str
    paper: dict[tuple[str, str], float]  # (row, column) -> the paper's number, percent
    paper_source: str
    cells: Callable[[str, int], list[Cell]]  # (scale, seed) -> the cells
    columns: list[str] = field(default_factory=list)
    #: what a seed of it cost where it was measured (docs/benchmarks.md 25), per scale: for planning, not a promise
    cost: dict[str, str] = field(default_factory=dict)


# --- FedHe (paper 002): heterogeneous, FedHe against private training --------------------------------
def _fedhe(scale: str, seed: int) -> list[Cell]:
    paper = scale == "paper"
    cells = []
    for method, row in (("fedhe", "FedHe"), ("local", "Private")):
        raw = {
            "name": f"paper-fedhe-{method}", "seed": seed,
            # the authors' loop: one client of ten per iteration (drawn at random), three batches of 50, Adam 1e-3;
            # a synchronous round with one device selected is one iteration, so the run checkpoints and resumes
            "rounds": 50_000 if paper else 2_000,
            "method": {"name": method, **({"alpha": 1.0, "logit_loss": "mse", "warmup_rounds": 10} if method == "fedhe" else {})},
            "data": {"dataset": "fashion-mnist", "partition": "contiguous", **({} if paper else {"test_samples": 2000})},
            # each client keeps its Adam for the whole run, as the authors' clients do
            "train": {"epochs": 1, "batch_size": 50, "optimizer": "adam", "lr": 1e-3, "max_steps": 3, "optimizer_state": "kept"},
            "fleet": {"sample_ratio": 0.1,
                      "groups": [{"model": f"fedhe-cnn-{i}", **({} if paper else {"options": {"width": 0.25}})} for i in range(10)]},
            "eval": {"every": 1000 if paper else 200},
            "simulation": {"checkpoint_every": 1000 if paper else 200},
        }
        cells.append(Cell(f"{method}-s{seed}", row, "contiguous", seed, raw))
    return cells


# --- FedIN (paper 001) Table 1, Fashion-MNIST -----------------------------------------------------------
def _fedin(scale: str, seed: int) -> list[Cell]:
    paper = scale == "paper"
    cells = []
    for variant, row, options in (("fedin", "FedIN", {}), ("fedavg", "FedAvg", {"in_training": False, "mu_half": 0.0})):
        for partition in ("iid", "dirichlet"):
            raw = {
                "name": f"paper-fedin-{variant}-{partition}", "seed": seed, "rounds": 500 if paper else 30,
                # FedAvg as the paper compares it: the same layer-wise aggregation over the five depths, no IN, no prox
                "method": {"name": "fedin", **options},
                "data": {"dataset": "fashion-mnist", "partition": partition, "alpha": 0.5,
                         **({} if paper else {"samples_per_client": 600, "test_samples": 2000})},
                "train": {"epochs": 5 if paper else 1, "batch_size": 16, "optimizer": "adam", "lr": 1e-3},
                "fleet": {"sample_ratio": 0.1 if paper else 0.25,
                          "groups": [{"model": d, "count": 20 if paper else 4,
                                      "options": {"width": 1.0 if paper else 0.25, "stem": "imagenet"}} for d in RESNETS]},
                "eval": {"every": 10 if paper else 5},
                "simulation": {"checkpoint_every": 10 if paper else 5},
            }
            cells.append(Cell(f"{variant}-{partition}-s{seed}", row, partition, seed, raw))
    return cells


# --- Felo and Velo (paper 000) against FedAvg-groups ---------------------------------------------------------
def _felo_velo(scale: str, seed: int) -> list[Cell]:
    paper = scale == "paper"
    width, feature_dim = (1.0, 512) if paper else (0.25, 128)
    cells = []
    for method, row in (("felo", "Felo"), ("velo", "Velo"), ("fedavg", "FedAvg-groups")):
        for partition in ("iid", "dirichlet"):
            m: dict[str, Any] = {"name": method}
            if method in ("felo", "velo"):
                m["feature_dim"] = feature_dim
            raw = {
                "name": f"paper-{method}-{partition}", "seed": seed, "rounds": 300 if paper else 60,
                "method": m,
                "data": {"dataset": "fashion-mnist", "partition": partition, "alpha": 0.5,
                         **({} if paper else {"samples_per_client": 600, "test_samples": 2000})},
                "train": {"epochs": 1, "batch_size": 50, "optimizer": "adam", "lr": 1e-3},
                "fleet": {"sample_ratio": 0.2, "groups": [{"model": d, "count": 4,
                                                           "options": {"width": width, "stem": "imagenet", "feature_dim": feature_dim}}
                                                          for d in RESNETS]},
                "eval": {"every": 10 if paper else 5},
                "simulation": {"checkpoint_every": 10 if paper else 5},
            }
            cells.append(Cell(f"{method}-{partition}-s{seed}", row, partition, seed, raw))
    return cells


# --- FedMHO (paper 003) Table IV, Fashion-MNIST -------------------------------------------------------------
def _fedavg_reference(summary: dict[str, Any]) -> dict[str, float]:
    refs = ((summary.get("final_accuracy") or {}).get("references") or {})
    return {"FedAvg": refs["fedavg-of-classifiers"]} if "fedavg-of-classifiers" in refs else {}


def _fedmho(scale: str, seed: int) -> list[Cell]:
    paper = scale == "paper"
    width = 1.0 if paper else 0.5
    vgg = {"model": "vgg9", "count": 5, "options": {"width": width},
           "train": {"optimizer": "sgd", "lr": 1e-3, "momentum": 0.9, "epochs": 200 if paper else 10}}
    cvae = {"model": "cvae-small", "count": 5, "train": {"optimizer": "adam", "lr": 1e-3, "epochs": 40}}
    cells = []
    for method, row in (("fedmho", "FedMHO"), ("fedmho-md", "FedMHO-MD"), ("fedmho-sd", "FedMHO-SD"), ("fedcvae", "FEDCVAE")):
        for alpha in (0.5, 0.3, 0.1):
            m: dict[str, Any] = {"name": method, "global_epochs": 20, "global_lr": 5e-4, "global_batch": 64, "synthetic_samples": 6000}
            groups = [vgg, cvae]
            if method == "fedcvae":  # every client a CVAE; the server trains a VGG-9 from scratch
                m.update(global_model="vgg9", global_model_options={"width": width})
                groups = [{**cvae, "count": 10}]
            raw = {
                "name": f"paper-{method}-a{alpha}", "seed": seed, "rounds": 1, "method": m,
                "data": {"dataset": "fashion-mnist", "partition": "dirichlet", "alpha": alpha, "min_samples": 10},
                "train": {"batch_size": 64},
                "fleet": {"groups": groups},
                # a full-width VGG-9 is 277 MB, over the default message limit
                **({"network": {"max_message_bytes": 320 << 20, "max_partial_bytes_total": 1 << 30}} if paper else {}),
            }
            cells.append(Cell(f"{method}-a{alpha}-s{seed}", row, f"Dir {alpha}", seed, raw,
                              extra=_fedavg_reference if method == "fedmho" else None,
                              extra_rows=("FedAvg",) if method == "fedmho" else (),
                              # FEDCVAE's clients are all CVAEs: its own
                              clients_group=None if method == "fedcvae" else f"fedmho-a{alpha}-s{seed}"))
    return cells


# --- CHFL (paper 004) Table 1, BCD ------------------------------------------------------------------------------
def _chfl(scale: str, seed: int) -> list[Cell]:
    cells = []
    for method, row, options in (("chfl", "CHFL", {"mode": "kd"}), ("local", "SOLO", {}), ("chfl", "AVG", {"mode": "avg"})):
        for partition, column in (("iid", "iid"), ("dirichlet", "non-iid")):
            raw = {
                "name": f"paper-chfl-{row.lower()}-{partition}", "seed": seed, "rounds": 60,
                "method": {"name": method, **options, **({"embedding_dim": 64} if method == "chfl" else {})},
                "data": {"dataset": "breast-cancer", "partition": partition, "alpha": 0.5, "min_samples": 30,
                         "client_test_fraction": 0.3},
                "train": {"epochs": 1, "batch_size": 16, "optimizer": "adam", "lr": 1e-3},
                "fleet": {"groups": [{"model": "mlp", "count": 8, "options": {"hidden": "random", "feature_dim": 64},
                                      "view": {"kind": "features", "fraction": 0.3}}]},
                "eval": {"every": 1},
                "simulation": {"checkpoint_every": 0},  # seconds a run: nothing worth resuming
            }
            cells.append(Cell(f"{row.lower()}-{partition}-s{seed}", row, column, seed, raw, metric="best"))
    return cells


TABLES: dict[str, Table] = {
    "fedhe": Table(
        "FedHe (paper 002): ten heterogeneous CNNs, FedHe against private training",
        "the authors' split (contiguous tenths), one client per iteration, 3 batches of 50, Adam 1e-3 kept per client, alpha 1 (MSE); "
        "paper rows are MNIST, ours Fashion-MNIST (no MNIST copy here)",
        {("FedHe", "contiguous"): 98.5, ("Private", "contiguous"): 98.0}, "paper Table II, MNIST", _fedhe, ["contiguous"],
        {"cpu": "5-9 min a cell, 2 cells a seed, on a 2-core CPU", "paper": "about 30 min a seed on an H200 (estimated from a 30-second probe of each cell)"}),
    "fedin": Table(
        "FedIN (paper 001) Table 1: 100 devices, ResNet10/14/18/22/26, 500 rounds, 5 local epochs",
        "Fashion-MNIST, IID and Dirichlet(0.5); FedAvg with the same layer-wise aggregation, no IN, no prox",
        {("FedIN", "iid"): 91.2, ("FedIN", "dirichlet"): 90.3, ("FedAvg", "iid"): 90.3, ("FedAvg", "dirichlet"): 89.4},
        "paper Table 1, Fashion-MNIST", _fedin, ["iid", "dirichlet"],
        {"cpu": "1.3-3.6 min a cell (FedIN about 3, FedAvg 1.4; 6-7 with tests beside it), 4 cells a seed, on a 2-core CPU",
         "paper": "about 30 h a seed on an H200 (estimated from a probe)"}),
    "felo-velo": Table(
        "Felo and Velo (paper 000) against FedAvg-groups: 20 devices, five ResNet depths, 20 % a round",
        "Fashion-MNIST here, IID and Dirichlet(0.5); the paper's rows are CIFAR-10 (not on this machine); the paper gives "
        "no FedAvg-groups number",
        {("Velo", "iid"): 76.33, ("Felo", "iid"): 76.10, ("Velo", "dirichlet"): 57.17, ("Felo", "dirichlet"): 56.88},
        "paper Table 1, CIFAR-10", _felo_velo, ["iid", "dirichlet"],
        {"cpu": "2.1-4.8 min a cell, 6 cells a seed, on a 2-core CPU", "paper": "about 3.2 h a seed on an H200 (estimated from a probe)"}),
    "fedmho": Table(
        "FedMHO (paper 003) Table IV: one round, 5 VGG-9 + 5 CVAE-small clients",
        "Fashion-MNIST, Dirichlet 0.5 / 0.3 / 0.1; FedAvg = the average of the VGG-9 clients FedMHO fuses from",
        {(r, f"Dir {a}"): v for r, vals in {"FedAvg": (60.24, 47.36, 30.37), "FEDCVAE": (69.11, 68.39, 64.01),
                                            "FedMHO": (75.30, 72.36, 62.14), "FedMHO-MD": (77.27, 75.69, 71.04),
                                            "FedMHO-SD": (77.73, 76.45, 69.65)}.items() for a, v in zip((0.5, 0.3, 0.1), vals)},
        "paper Table IV, Fashion-MNIST", _fedmho, ["Dir 0.5", "Dir 0.3", "Dir 0.1"],
        {"cpu": "11-51 min a cell that trains its clients (FedMHO 15-44, FEDCVAE 11-15 alone and 51 with other work beside it; "
                "each cell's time and machine in docs/benchmarks.md 25), 5-11 min one that fuses a sibling's "
                "kept clients; 6 of a seed's 12 cells train, on a 2-core CPU",
         "paper": "not measured (no round in a 45 s probe on an H200); 6 of a seed's 12 cells train their clients"}),
    "chfl": Table(
        "CHFL (paper 004) Table 1, BCD: 8 devices, each its own 30 % of the features and its own random MLP",
        "breast cancer (scikit-learn's copy of BCD), best accuracy over 60 epochs as the paper reports it",
        {("CHFL", "iid"): 89.88, ("SOLO", "iid"): 81.85, ("AVG", "iid"): 82.65,
         ("CHFL", "non-iid"): 90.66, ("SOLO", "non-iid"): 71.40, ("AVG", "non-iid"): 78.56},
        "paper Table 1, BCD", _chfl, ["iid", "non-iid"],
        {scale: "4-46 s a cell (most about 5), 6 cells a seed, on a 2-core CPU (the paper's own scale)" for scale in ("cpu", "paper")}),
}


# --- running -------------------------------------------------------------------------------------------------
def _summary(run: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run / "summary.json").read_text())
    except (OSError, ValueError):
        return None


def _finished(run: Path) -> bool:
    s = _summary(run)
    return bool(s) and not s.get("interrupted") and s.get("rounds_played") == s.get("rounds")


def _asked(cell: Cell, device: str, overrides: list[str]) -> dict[str, Any]:
    """The config a cell runs with: the table's, the device and the --set overrides."""
    return apply_overrides(dict(cell.config, device=device), overrides)


def ran_otherwise(cell: Cell, out: Path, device: str, overrides: list[str]) -> str | None:
    """How the config a cell's run directory holds differs from the one asked for now (None: the
    same, or nothing run yet). The compute device is not compared: a table may be filled on a CPU
    and a GPU. A cell run with another --set (a smoke run) must not stand in for the table's cell."""
    from edgefl.config import load_config

    saved = out / cell.key / "config.toml"
    if not saved.is_file():
        return None
    try:
        had = load_config(saved).to_dict()
    except EdgeflError as exc:
        return f"its config.toml cannot be read ({exc.message[:120]})"
    return differs_from_asked(had, cell, device, overrides)


#: what a cell's config may differ in and still be the table's cell: the compute device, and whether its
#: clients were kept or taken from a sibling's (the same numbers either way: tests/test_kept_clients.py)
NOT_COMPARED = ("device", "simulation.keep_clients", "simulation.clients_from")


def differs_from_asked(had: dict[str, Any], cell: Cell, device: str, overrides: list[str]) -> str | None:
    """How a config a cell ran with (its run directory's, or one a table.json recorded) differs from
    the one asked for now, the compute device aside; None when it does not."""
    from edgefl.config import validate_config

    want = validate_config(_asked(cell, device, overrides), cell.key).to_dict()
    # (into lists: a group's epochs are named fleet.groups.0.train.epochs, not shown as both whole lists)
    differ = [f"{key}: {printable(repr(a), 80)} there, {printable(repr(b), 80)} asked"
              for key, a, b in config_differences(had, want, into_lists=True) if key not in NOT_COMPARED]
    return "; ".join(differ[:3]) + (f" (and {len(differ) - 3} more)" if len(differ) > 3 else "") if differ else None


MERGE_MAX_BYTES = 16 << 20  # a table.json is kilobytes; a file this large is not one
MERGE_MAX_CELLS = 10_000  # a table's cells times its seeds is dozens
MERGE_MAX_DEPTH = 16  # a run's config nests four levels: one nested hundreds deep would stop the comparison's recursion


class MergeRefused(EdgeflError):
    """A --merge file that is not a table.json of this table, scale and config (``about_out``: the
    refusal is of --out's own table.json, said as such)."""

    about_out = False


def _nested_deeper(value: Any, limit: int) -> bool:
    """Whether ``value`` nests tables or lists more than ``limit`` levels deep (walked without recursion)."""
    level = [value]
    for _ in range(limit + 1):
        level = [v for item in level for v in (item.values() if isinstance(item, dict) else item if isinstance(item, list) else ())]
        if not level:
            return False
    return True


def _json_kind(value: Any) -> str:
    """What a JSON value is, in JSON's words."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    kinds = {str: "a string", int: "a number", float: "a number", list: "a list", dict: "a table"}
    return kinds.get(type(value), f"a {type(value).__name__}")


def _fraction_problem(value: Any) -> str | None:
    """Why ``value`` is not an accuracy (a fraction in [0, 1]); None when it is one."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{_json_kind(value)} ({json.dumps(value)[:20]}), not a number"
    if isinstance(value, int) and abs(value) > 10**6:  # (math.isfinite overflows on a 4000-digit integer)
        return f"{str(value)[:12]}..., not a fraction in [0, 1]"
    if not math.isfinite(value) or not 0 <= value <= 1:
        return f"{value:g}, not a fraction in [0, 1]" + (" (a percentage?)" if 1 < value <= 100 else "")
    return None


def _merged_entry(raw: Any, cell: Cell, rows: set[str], where: str) -> dict[str, Any]:
    """One cell of a --merge file, every field checked (a file is trusted no more than a message)."""
    said = f"{where}: cell {cell.key}"
    accuracy = raw.get("accuracy")
    if not isinstance(accuracy, dict) or not accuracy or len(accuracy) > 8:
        raise MergeRefused(f"{said} has no accuracy table (\"accuracy\": {{\"{cell.row}\": 0.0-1.0}})")
    if cell.row not in accuracy:  # a finished cell has its own row's result
        raise MergeRefused(f"{said} has no {cell.row} accuracy (its own row)")
    for row, value in accuracy.items():
        if row not in (cell.row, *cell.extra_rows):
            theirs = "the table does not have" if row not in rows else "another cell fills"
            raise MergeRefused(f"{said} reports a row {printable(row, 40)!r} {theirs}")
        problem = None if value is None and row != cell.row else _fraction_problem(value)
        if problem:  # (the cell's own row must have a number: a finished cell without one is not finished)
            raise MergeRefused(f"{said}'s {row} accuracy is {problem}")
    seed = raw.get("seed")
    seed_is_int = isinstance(seed, int) and not isinstance(seed, bool)  # (false == 0 and "0" print alike: say which)
    if (raw.get("row"), raw.get("column")) != (cell.row, cell.column) or not seed_is_int or seed != cell.seed:
        told = f"seed {seed}" if seed_is_int and abs(seed) < 10**9 else f"seed {json.dumps(seed)[:20]}, {_json_kind(seed)}"
        raise MergeRefused(f"{said} is recorded as ({str(raw.get('row'))[:30]}, {str(raw.get('column'))[:30]}, "
                           f"{told}), the table has it as ({cell.row}, {cell.column}, seed {cell.seed})",
                           hint="a cell's row, column and seed are the ones its key names (-s0: the integer 0); "
                                "merge the table.json a `bench paper` run wrote, as it wrote it")
    if raw.get("metric", cell.metric) != cell.metric:
        raise MergeRefused(f"{said} reports its {str(raw.get('metric'))[:20]} accuracy, the table its {cell.metric} one")
    kept = {k: raw.get(k) for k in ("run", "compute_device", "wall_time_s", "machine", "commit", "config")}
    for key, kind in (("run", str), ("compute_device", str), ("commit", str), ("machine", dict), ("config", dict)):
        if kept[key] is not None and not isinstance(kept[key], kind):
            raise MergeRefused(f"{said}'s {key} is {_json_kind(kept[key])}, not {'a string' if kind is str else 'a table'}")
    for key in ("machine", "config"):
        if kept[key] is not None and _nested_deeper(kept[key], MERGE_MAX_DEPTH):
            raise MergeRefused(f"{said}'s {key} nests deeper than {MERGE_MAX_DEPTH} levels: not one a run recorded",
                               hint="merge the table.json a `bench paper` run wrote, as it wrote it")
    for key in ("run", "compute_device", "commit"):
        if kept[key] is not None:
            kept[key] = printable(kept[key], 300)
    wall = kept["wall_time_s"]
    if wall is not None and (isinstance(wall, bool) or not isinstance(wall, (int, float)) or wall < 0
                             or (isinstance(wall, int) and wall > 10**9) or not math.isfinite(wall)):
        raise MergeRefused(f"{said}'s wall_time_s is {json.dumps(wall)[:20]}, not a number of seconds")
    fused = _merged_clients_from(raw.get("clients_from"), kept["config"], said)
    return {"cell": cell.key, "row": cell.row, "column": cell.column, "seed": cell.seed, "metric": cell.metric,
            "accuracy": {str(r): v for r, v in accuracy.items()}, **kept, **fused}


def _merged_clients_from(told: Any, config: dict[str, Any] | None, said: str) -> dict[str, Any]:
    """The run whose clients a merged cell fused, kept through a merge (it was dropped, and each
    sitting's table lost it); a cell merged before that keeps it only in its config's path, whose
    last part is the run's name (its commit is not recorded there)."""
    if told is None:
        path = ((config or {}).get("simulation") or {}).get("clients_from")
        if not isinstance(path, str) or not path.strip("/"):
            return {}
        told = {"run": Path(path).name, "commit": None}
    run, commit = (told.get("run"), told.get("commit")) if isinstance(told, dict) else (None, None)
    if not isinstance(run, str) or not run or (commit is not None and not isinstance(commit, str)):
        got = (_json_kind(told) if not isinstance(told, dict) else f"its run {_json_kind(run)}"
               if not isinstance(run, str) or not run else f"its commit {_json_kind(commit)}")
        raise MergeRefused(f"{said}'s clients_from is not {{\"run\": a string, \"commit\": a string or null}} "
                           f"(got {got})", hint="merge the table.json a `bench paper` run wrote, as it wrote it")
    return {"clients_from": {"run": printable(run, 120), "commit": None if commit is None else printable(commit, 60)}}


def _read_table_json(path: Path) -> dict[str, Any]:
    """An earlier sitting's table.json, as far as its shape: a table with a list of cells."""
    what = "--merge takes the table.json an earlier `bench paper` run wrote"
    try:
        if path.exists() and not path.is_file():  # a FIFO or a device would be read without end
            raise MergeRefused(f"{path} is not a regular file (a pipe, a device or a folder)", hint=what + " (a file on disk)")
        size = path.stat().st_size
        if size > MERGE_MAX_BYTES:
            raise MergeRefused(f"{path} is {size / (1 << 20):.1f} MiB: not a table.json (those are kilobytes)", hint=what)
        text = path.read_text()
        if not text.strip():
            raise MergeRefused(f"{path} is empty: not a table.json", hint=what)
        held = json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)[:120]
        raise MergeRefused(f"{path} cannot be read as a table.json ({why}: a file cut short or edited by hand?)",
                           hint=what) from None
    if not isinstance(held, dict) or not isinstance(held.get("cells"), list):
        shape = "a table with no list of cells" if isinstance(held, dict) else _json_kind(held)
        raise MergeRefused(f"{path} is not a table.json ({shape}, where a table.json is a table with a list of cells)", hint=what)
    return held


def _is_seed(value: Any) -> bool:
    """A seed as a table.json records one (true and false are ints to Python, not seeds)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 10**6


def _seeds_flag(seeds: Any) -> str:
    """" --seeds 0,1" for the seeds a table.json records (a hint without it shows seed 0 alone), or ""."""
    if not (isinstance(seeds, list) and 0 < len(seeds) <= 64 and all(map(_is_seed, seeds))):
        return ""
    return f" --seeds {','.join(map(str, seeds))}" if seeds != [0] else ""


def _check_fits(held: dict[str, Any], path: Path, name: str, scale: str) -> list[str]:
    """Refuse a table.json of another table or scale than this command's; the --set list it records."""
    if (held.get("table"), held.get("scale")) != (name, scale):
        theirs = ("no table and scale" if held.get("table") is None and held.get("scale") is None else
                  f"the {printable(held.get('table'), 40)} table at --scale {printable(held.get('scale'), 20)}")
        fix = (f"merge it into a report of its own table and scale (./dev.sh bench paper {printable(held.get('table'), 40)} --scale "
               f"{printable(held.get('scale'), 20)}{_seeds_flag(held.get('seeds'))} --report-only --merge {path})"
               if isinstance(held.get("table"), str)
               and isinstance(held.get("scale"), str) else "merge the table.json a `bench paper` run wrote, as it wrote it")
        raise MergeRefused(f"{path} holds {theirs}, not {name} at --scale {scale}", hint=fix)
    theirs_set = held.get("overrides")
    if not (isinstance(theirs_set, list) and len(theirs_set) <= 64 and all(isinstance(o, str) for o in theirs_set)):
        raise MergeRefused(f"{path}'s overrides are {_json_kind(theirs_set)}, not the list of --set strings a table.json records")
    return theirs_set


def load_merged(paths: list[Path], name: str, table: Table, scale: str, cells: list[Cell], device: str,
                overrides: list[str], carried: Path | None = None
                ) -> tuple[dict[str, dict[str, Any]], list[str], list[dict[str, Any]]]:
    """The finished cells of earlier sittings' table.json files (``--merge``), by cell key, what
    was said of them, and the held cells. A file of another table or scale, a cell recorded with
    another config than this command's (the --set it ran with among them), a malformed entry, or
    one cell given two different results is refused (:class:`MergeRefused`).

    ``carried``: the output folder's own table.json, whose cells merged in an earlier report are
    taken again (a report without ``--merge`` would otherwise drop them); its own cells are not
    (their run directories are the record: one deleted to be run again is run again). Held: a
    merged cell this command does not show (a seed not asked for; in --out's own table.json or
    in a file's "held" list, also a config that no longer fits or a malformed entry, said in a
    note, not refused), as it was recorded: the report keeps it in table.json's "held" list, so
    that a later report asking for it shows it again (once the file it came from is gone, it is
    recorded nowhere else). A file's "held" list is read as its cells are."""
    by_key = {c.key: c for c in cells}
    rows = {c.row for c in cells} | {r for r, _ in table.paper}
    prefixes = {c.key.rsplit("-s", 1)[0] for c in cells}
    merged: dict[str, dict[str, Any]] = {}
    read_in: dict[str, Path] = {}  # the file each merged cell was read from (a second result names both)
    notes: list[str] = []
    held_back: dict[str, dict[str, Any]] = {}  # (by cell key: one entry a cell)

    def hold(raw: Any, path: Path, own: bool) -> str:
        """Keep ``raw`` of ``path`` for the report's "held" list (``from`` naming the file another
        sitting's came from, as a shown cell's does); what became of it, for a note."""
        key = raw.get("cell") if isinstance(raw, dict) else None
        if not isinstance(key, str):
            return "is dropped (it names no cell)"
        if _nested_deeper(raw, MERGE_MAX_DEPTH + 2):  # (no run's record: written back, it would recurse)
            return "is dropped (nested past any run's record)"
        held_back.setdefault(key, raw if own else {**raw, "from": str(path)})
        return "stays in --out's \"held\" list"

    for path in [*paths, *([carried] if carried is not None and carried.is_file() and carried not in paths else [])]:
        own = path == carried
        try:
            held = _read_table_json(path)
            if own and not isinstance(held.get("held", []), list):
                raise MergeRefused(f"{path}'s \"held\" list is {_json_kind(held.get('held'))}, not a list")
        except MergeRefused as exc:
            if own:  # its merged cells are recorded nowhere else: writing it anew would lose them
                refused = MergeRefused(f"this folder's own {exc.message}; nothing was written",
                                       hint=f"restore {path} (or move it aside to start the table's record anew)")
                refused.about_out = True
                raise refused from None
            raise
        if len(held["cells"]) > MERGE_MAX_CELLS:  # (a table has dozens of cells: the rest are not read, and said so)
            notes.append(f"{path}: only its first {MERGE_MAX_CELLS:,} of {len(held['cells']):,} cells were read")
        kept = held.get("held", [])
        if not isinstance(kept, list):
            notes.append(f"{path}: its \"held\" list is {_json_kind(kept)}, not a list: not read")
            kept = []
        # (--out's own cells, without "from", are their run directories' to count)
        entries = [(f"cells[{i}]", raw, False) for i, raw in enumerate(held["cells"][:MERGE_MAX_CELLS])
                   if not own or (isinstance(raw, dict) and raw.get("from"))]
        entries += [(f"held[{i}]", raw, True) for i, raw in enumerate(kept[:MERGE_MAX_CELLS])]
        if not entries:
            continue
        try:
            recorded_set = _check_fits(held, path, name, scale)
        except MergeRefused as exc:
            if not own:
                raise
            staying = sum(hold(raw, path, own).startswith("stays") for _, raw, _ in entries)
            notes.append(f"the {len(entries)} cell(s) merged into {path} earlier are not shown: {exc.message} "
                         f"({staying} stay in its \"held\" list)")
            continue
        unasked, untold, unasked_seeds = 0, [], set()
        for at, raw, was_held in entries:
            soft = own or was_held  # said and held, not refused: a cell an earlier report merged or held
            try:
                entry = _merged_cell(raw, at, path, f"{name} at --scale {scale}", by_key, prefixes, rows, device, overrides,
                                     own, recorded_set)
            except MergeRefused as exc:
                if not soft:
                    raise
                notes.append(f"{path}: a cell merged earlier is not shown and {hold(raw, path, own)}: {exc.message}")
                continue
            if entry is None:
                unasked += 1
                seed = raw.get("seed") if isinstance(raw, dict) else None
                if _is_seed(seed):
                    unasked_seeds.add(seed)
                hold(raw, path, own)
                continue
            key = entry["cell"]
            if key in merged:
                if merged[key]["accuracy"] != entry["accuracy"]:
                    refused = _two_results(key, merged[key], entry, read_in[key], path)
                    refused.about_out = carried in (read_in[key], path)
                    raise refused
                continue
            if entry["config"] is None:
                untold.append(key)
            merged[key], read_in[key] = entry, path
        if unasked:
            seeds = ",".join(map(str, sorted(unasked_seeds)))
            every = ",".join(map(str, sorted(unasked_seeds | {c.seed for c in cells})))
            which = f" (seed{'s' if len(unasked_seeds) > 1 else ''} {seeds})" if seeds else ""
            notes.append(f"{path}: {unasked} cell(s) of seeds not asked for left out of this report{which}, kept in --out's "
                         "\"held\" list (--seeds takes them in" + (f": --seeds {every})" if seeds else ")"))
        if untold:
            notes.append(f"{path}: {len(untold)} cell(s) recorded no config (a table.json written before configs were): taken as "
                         f"this table's at commit(s) {', '.join(sorted({merged[k]['commit'] or 'unknown' for k in untold}))}")
    return merged, notes, [raw for key, raw in held_back.items() if key not in merged]


def _two_results(key: str, first: dict[str, Any], second: dict[str, Any], first_in: Path, second_in: Path) -> MergeRefused:
    """The refusal of a cell given two different results: ``first`` read from ``first_in``, ``second`` from ``second_in``."""
    if first_in == second_in:
        return MergeRefused(f"{key} has two results, twice in {second_in}: {first['accuracy']} and {second['accuracy']}",
                            hint=f"keep one of the two: remove the other entry from {second_in}")
    return MergeRefused(f"{key} has two results, {first['accuracy']} in {first_in}, {second['accuracy']} in {second_in}",
                        hint=f"keep one of the two: remove the cell from {first_in} or from {second_in}")


def _merged_cell(raw: Any, at: str, path: Path, table_of: str, by_key: dict[str, Cell], prefixes: set[str], rows: set[str],
                 device: str, overrides: list[str], own: bool, recorded_set: list[str]) -> dict[str, Any] | None:
    """Entry ``at`` (cells[i], held[i]) of a --merge file, checked: the cell's record with ``from``
    set; None for a cell of a seed not asked for. Refused (:class:`MergeRefused`): a malformed entry
    and another config than this command's, by the config the cell recorded or, for a cell that
    recorded none, by the --set its file recorded (``recorded_set``; a second result for a cell is
    :func:`load_merged`'s to refuse)."""
    key = raw.get("cell") if isinstance(raw, dict) else None
    if not isinstance(key, str):
        raise MergeRefused(f"{path}: {at} names no cell (each entry is a table with a \"cell\" key)")
    cell = by_key.get(key)
    if cell is None:
        other_seed = re.fullmatch(r"(.+)-s(\d{1,9})", key)
        if other_seed and other_seed[1] in prefixes:
            return None  # the same cell at another seed
        raise MergeRefused(f"{path}: {printable(key, 60)!r} is not a cell of {table_of}")
    entry = _merged_entry(raw, cell, rows, str(path))
    source = by_key.get(entry.get("clients_from", {}).get("run", ""))
    if "clients_from" in entry and (cell.clients_group is None or source is None
                                    or source.clients_group != cell.clients_group):
        raise MergeRefused(f"{path}: cell {key} says it fused the clients of "
                           f"{printable(entry['clients_from']['run'], 60)!r}, not a cell that trains this cell's clients "
                           f"(its alpha and seed)", hint="merge the table.json a `bench paper` run wrote, as it wrote it")
    if entry["config"] is not None:
        why = differs_from_asked(entry["config"], cell, device, overrides)
        if why:
            raise MergeRefused(f"{path}: cell {key} ran with another config than this command's: {why}",
                               hint="the table's setting changed since (see its commit), or its cells ran with another --set"
                                    + (f" (its file records --set {printable(recorded_set, 200)})" if recorded_set != overrides else ""))
    elif recorded_set != overrides:
        raise MergeRefused(f"{path}'s cells ran with --set {printable(recorded_set, 200)}, this command's with --set {overrides}, "
                           f"and cell {key} recorded no config to tell otherwise: pass the same --set (a smoke run's cells are "
                           "not the table's)")
    told = raw.get("from")
    return {**entry, "from": printable(told, 300) if own and isinstance(told, str) and told else str(path)}


def _simulate_command(config: dict[str, Any], cfg_path: Path, run: Path) -> list[str]:
    """``edgefl simulate`` of ``config`` (written to ``cfg_path``) into ``run``."""
    cfg_path.parent.mkdir(parents=True, exist_ok=True)
    cfg_path.write_text(tomli_w.dumps(config))
    return [sys.executable, "-m", "edgefl", "simulate", str(cfg_path), "--out", str(run)]


def _kept_by(out: Path, keys: list[str]) -> Path | None:
    """The first finished run among ``keys`` in ``out`` that kept its clients."""
    return next((out / k for k in keys if _finished(out / k) and (out / k / "clients" / "clients.json").is_file()), None)


def _with_clients(cell: Cell, config: dict[str, Any], out: Path, resumed: Path | None, siblings: list[str]) -> dict[str, Any]:
    """A cell of a clients group fuses the clients a sibling kept, or trains and keeps them itself.
    A resumed cell goes on as it started (a resume refuses a changed config)."""
    sim = dict(config.get("simulation") or {})
    started = _run_config(resumed) if resumed is not None else None
    if started is not None:
        held = started.get("simulation") or {}
        sim.update({k: held[k] for k in ("keep_clients", "clients_from") if k in held})
    else:
        source = _kept_by(out, [k for k in siblings if k != cell.key])
        if source is not None:
            sim["clients_from"] = str(source.resolve())
            print(f"{cell.key}: fusing the clients {source.name} trained and kept (simulation.clients_from)", flush=True)
        else:
            sim["keep_clients"] = True
    return {**config, "simulation": sim}


def run_cell(cell: Cell, out: Path, device: str, overrides: list[str], sibling_keys: list[str] | None = None) -> tuple[int, bool]:
    """``edgefl simulate`` for one cell: skipped when finished, resumed when a checkpoint is there.
    (its exit status, whether a stop was asked for while it ran)"""
    run = out / cell.key
    config = _asked(cell, device, overrides)
    if _finished(run):
        print(f"{cell.key}: finished earlier ({run})", flush=True)
        return 0, False
    resuming = (run / "server-state.safetensors").is_file()
    if cell.clients_group is not None:
        config = _with_clients(cell, config, out, run if resuming else None, sibling_keys or [])
    cmd = _simulate_command(config, out / "configs" / f"{cell.key}.toml", run)
    if resuming:
        cmd.append("--resume")
        print(f"{cell.key}: resuming its checkpoint in {run}", flush=True)
    elif run.exists():
        # stopped before its first checkpoint: nothing to go on from (its config and records are in the folder)
        never = (config.get("simulation") or {}).get("checkpoint_every") == 0
        print(f"{cell.key}: {run} {'keeps no checkpoint (seconds long)' if never else 'has no checkpoint yet'}: starting it again",
              flush=True)
        shutil.rmtree(run)
    else:
        print(f"{cell.key}: starting ({cell.row}, {cell.column}, seed {cell.seed})", flush=True)
    return _run_forwarding_stops(cmd)


def _run_forwarding_stops(cmd: list[str]) -> tuple[int, bool]:
    """Run a cell's ``edgefl simulate`` and pass it each Ctrl-C, SIGTERM or SIGHUP this driver gets, once: the
    first makes it finish its round and checkpoint, a second stops it at once. It runs in a session of
    its own, so a terminal's Ctrl-C reaches it only through here (not twice), and this driver waits for
    its checkpoint instead of dying first (subprocess.call kills its child on KeyboardInterrupt)."""
    # not a terminal (`| head`, a log file): the cell's output passes through this driver's stdout and stderr,
    # so a reader that has gone costs only the output, not the cell (which died of its own broken pipe)
    piped = {name: not getattr(sys, name).isatty() for name in ("stdout", "stderr")}
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE if piped["stdout"] else None,
                            stderr=subprocess.PIPE if piped["stderr"] else None)
    relays = [threading.Thread(target=_relay, args=(getattr(proc, name), name), daemon=True)
              for name, on in piped.items() if on]
    for relay in relays:
        relay.start()
    stops: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        stops.append(signum)
        if proc.poll() is None:  # a closed terminal (SIGHUP) stops it as a scheduler would: cleanly
            proc.send_signal(signal.SIGTERM if signum == signal.SIGHUP else signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for relay in relays:
        relay.join()
    return code, bool(stops)  # (a stop that came as the cell ended leaves it finished: its status says so)


def _relay(pipe: Any, stream: str) -> None:
    """Copy a cell's stdout or stderr to this driver's as it comes (its progress lines stay live)."""
    decode = codecs.getincrementaldecoder("utf-8")(errors="replace")
    while chunk := os.read(pipe.fileno(), 65536):
        to = getattr(sys, stream)
        to.write(decode.decode(chunk))
        to.flush()
    pipe.close()


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def estimate_cell(times: list[float], evaluated: list[bool], rounds: int, every: int,
                  startup: float) -> tuple[float | None, list[float], bool, float | None]:
    """From a probe's round times (and which rounds evaluated), a cell's seconds a round, its evaluations'
    extra seconds, whether only the first round was timed, and the whole cell's estimated seconds."""
    # the first round carries one-off costs (allocations, kernels' first launch); an evaluation round costs its
    # round plus the evaluation (the devices asked for their accuracy too): the two are timed apart
    later = [t for t, e in zip(times[1:], evaluated[1:]) if not e]
    first_only = False
    if later:
        per_round = statistics.median(later)
    elif every == 1 and len(times) > 1:  # every round evaluates: a round's time includes it
        per_round = statistics.median(times[1:])
    elif times:  # only the first round (and perhaps an evaluation round) timed: one-off costs included
        per_round, first_only = times[0], True
    else:
        return None, [], False, None
    # an evaluation is timed apart only against a plain round's time, not the first round's one-off costs
    evals = [max(0.0, t - per_round) for t, e in zip(times, evaluated) if e] if every > 1 and not first_only else []
    eval_cost = (statistics.fmean(evals) if evals else 0.0) * (rounds // every + 1)
    return per_round, evals, first_only, per_round * rounds + eval_cost + startup


def probe_cell(cell: Cell, out: Path, device: str, overrides: list[str], seconds: float) -> dict[str, Any]:
    """Run one cell for ``seconds`` (then kill it: a probe is not meant to resume) and estimate, from
    its per-round times, the wall time of the whole cell on this machine and device."""
    run = out / "probe" / cell.key
    shutil.rmtree(run, ignore_errors=True)
    run.parent.mkdir(parents=True, exist_ok=True)
    config = _asked(cell, device, overrides)
    every = int((config.get("eval") or {}).get("every", 1) or 1)
    # while probing, evaluate every third round: two plain rounds are timed first, then an evaluation
    # (the estimate uses the cell's own interval)
    probed = apply_overrides(config, ["eval.every=3"]) if every > 3 else config
    cmd = _simulate_command(probed, out / "probe" / f"{cell.key}.toml", run)
    print(f"{cell.key}: probing for {seconds:g} s", flush=True)
    t0, started_unix = time.perf_counter(), time.time()
    with (out / "probe" / f"{cell.key}.log").open("w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            pass
        finally:  # also on Ctrl-C or a SIGTERM: a probe left running would hold a lent GPU
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the run and whatever it started
                proc.wait()
    wall = time.perf_counter() - t0
    finished = proc.returncode == 0
    try:
        records = RunDir(run).metrics()
    except (EdgeflError, ValueError):  # killed before its first round, or in the middle of writing one
        records = []
    rounds = int(config["rounds"])
    times = [float(r.get("round_time_s", 0.0)) for r in records]
    evaluated = [r.get("accuracy") is not None for r in records]
    last_closed = records[-1].get("closed_unix") if records else None
    # process start, data, models: up to the last timed round's end, less the rounds themselves
    startup = max(0.0, (float(last_closed) - started_unix if last_closed else wall) - sum(times))
    per_round, evals, first_only, estimate = estimate_cell(times, evaluated, rounds, every, startup)
    if finished:  # the whole cell ran within the probe: its time is known
        estimate, first_only = wall, False
    result = {"cell": cell.key, "row": cell.row, "column": cell.column, "rounds": rounds, "rounds_timed": len(records),
              "probe_s": round(wall, 1), "finished": finished, "median_round_s": per_round,
              "mean_eval_s": statistics.fmean(evals) if evals else None,
              "estimated_cell_s": round(estimate, 1) if estimate is not None else None,
              "from_first_round_only": first_only,
              # no round in the probe: all that is known is that the cell takes longer than the probe
              "lower_bound_cell_s": None if estimate is not None else round(wall, 1)}
    if finished:
        told = f"the whole cell ran in {_duration(wall)}"
    elif estimate is None:
        told = (f"no round finished in {wall:.0f} s (start-up included): the cell takes longer than that; "
                "a longer --probe times its rounds")
    else:
        told = (f"{len(records)} round(s) in {wall:.0f} s, {per_round:.3f} s a round"
                + (f", {statistics.fmean(evals):.1f} s an evaluation" if evals else
                   " (its evaluation included: the cell evaluates every round)" if every == 1
                   else ", no evaluation timed (a longer --probe times one)")
                + f", {startup:.0f} s of start-up"
                + f": the whole cell about {_duration(estimate)}"
                + (" (from the first round alone, its one-off costs included: an upper estimate; a longer --probe "
                   "times more rounds)" if first_only else ""))
    print(f"  {told}", flush=True)
    return result


def probe(name: str, table: Table, cells: list[Cell], out: Path, scale: str, device: str, overrides: list[str],
          seconds: float) -> dict[str, Any]:
    import torch

    resolved = device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    results = [probe_cell(c, out, device, overrides, seconds) for c in cells]
    known = [r["estimated_cell_s"] if r["estimated_cell_s"] is not None else r["lower_bound_cell_s"] for r in results]
    lower = any(r["estimated_cell_s"] is None for r in results)
    total = sum(known)
    print(f"\n{name} at scale {scale} on {resolved}: {'more than' if lower else 'about'} {_duration(total)} for these "
          f"{len(cells)} cell(s)" + (" (a cell finished no round in its probe)" if lower else ""))
    payload = {"table": name, "scale": scale, "device": resolved, "overrides": overrides, "probe_seconds": seconds,
               "cells": results, "estimated_total_s": round(total, 1), "total_is_lower_bound": lower, "commit": _commit(),
               "machine": machine(), "versions": package_versions(), "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "command": " ".join([Path(sys.executable).name, *sys.argv])}
    (out / "probe.json").write_text(json.dumps(payload, indent=2, default=str))
    print(f"wrote {out / 'probe.json'}")
    return payload


def _accuracy(summary: dict[str, Any], metric: str) -> float | None:
    if metric == "best":
        return summary.get("best_overall_accuracy")
    final = summary.get("final_accuracy") or {}
    return final.get("overall")


def _run_config(run: Path) -> dict[str, Any] | None:
    """The config a finished cell ran with, as its run directory holds it: kept in table.json so that
    a later sitting can check the cell before it counts it (``--merge``)."""
    from edgefl.config import load_config

    try:
        return load_config(run / "config.toml").to_dict()
    except EdgeflError:
        return None


def _clients_source(run: Path) -> dict[str, Any]:
    """Where a cell's clients were trained, when it fused clients another run kept (run.json)."""
    try:
        source = json.loads((run / "run.json").read_text())["simulation"]["clients_from"]
        return {"clients_from": {"run": Path(source["path"]).parent.name, "commit": source.get("edgefl_commit")}}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def _commit() -> str:
    """The checkout's commit, with "-dirty" when tracked files differ from it (the numbers came from that code)."""
    return source_commit() or "unknown"


def _first_few(names: list[str], shown: int, sep: str = ", ") -> str:
    """A list cut for a line of text: the first ``shown`` names and how many more."""
    return sep.join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def report(name: str, table: Table, cells: list[Cell], out: Path, scale: str, device: str, overrides: list[str],
           seeds: list[int] | None = None, report_only: bool = False,
           merged: dict[str, dict[str, Any]] | None = None, held: list[dict[str, Any]] | None = None,
           selected: set[str] | None = None) -> dict[str, Any]:
    """The table from the cells finished in ``out`` and, where ``out`` has none, in ``merged``
    (earlier sittings' table.json files): printed beside the paper's, written to table.json/png.
    ``held``: merged cells this report does not show, kept in table.json as they were
    (:func:`load_merged`); ``selected``: the cells ``--cells`` ran, when it was given."""
    merged = merged or {}
    got: dict[tuple[str, str], list[float]] = {}
    asked: dict[tuple[str, str], int] = {}
    done: list[dict[str, Any]] = []
    missing: list[str] = []
    partial: dict[tuple[str, str], list[dict[str, Any]]] = {}
    otherwise: dict[str, str] = {}
    shadowed: list[str] = []  # merged cells whose run directory here finished too: the run directory counts
    for cell in cells:
        for row in (cell.row, *cell.extra_rows):  # (FedMHO's cell fills the FedAvg row too)
            asked[row, cell.column] = asked.get((row, cell.column), 0) + 1
        why = ran_otherwise(cell, out, device, overrides)
        s = None if why else _summary(out / cell.key)
        if s and not s.get("interrupted") and cell.key in merged:
            here, there = _accuracy(s, cell.metric), merged[cell.key]["accuracy"].get(cell.row)
            shadowed.append(f"{cell.key} ({merged[cell.key]['from']}" + ("" if here == there else f": {there} there, {here} here") + ")")
        if (not s or s.get("interrupted")) and cell.key in merged:  # finished in another sitting
            entry = merged[cell.key]
        elif why:  # (--report-only without the --set the cell ran with): not this table's cell
            otherwise[cell.key] = why
            continue
        elif not s or s.get("interrupted"):
            if s:  # stopped part-way: said as such, not as a cell never started
                partial.setdefault((cell.row, cell.column), []).append(
                    {"cell": cell.key, "rounds_played": s.get("rounds_played"), "rounds": s.get("rounds")})
            else:
                missing.append(cell.key)
            continue
        else:
            values = {cell.row: _accuracy(s, cell.metric), **(cell.extra(s) if cell.extra else {})}
            entry = {"cell": cell.key, "row": cell.row, "column": cell.column, "seed": cell.seed, "metric": cell.metric,
                     "accuracy": values, "run": str(out / cell.key), "compute_device": s.get("compute_device"),
                     "wall_time_s": s.get("wall_time_s"), "machine": s.get("machine"), "commit": s.get("edgefl_commit"),
                     "config": _run_config(out / cell.key), **_clients_source(out / cell.key)}
        for row, value in entry["accuracy"].items():
            if value is not None:
                got.setdefault((row, cell.column), []).append(100 * value)
        done.append(entry)
    other_at = {(c.row, c.column) for c in cells if c.key in otherwise}
    rows = list(dict.fromkeys([c.row for c in cells] + [r for r, _ in got] + [r for r, _ in table.paper]))
    ran_on = sorted({str(d["compute_device"]) for d in done if d.get("compute_device")})
    # the cells' own devices, not the flag: a report may show cells run elsewhere (or none, asked for cuda)
    where = (f"cells ran on {', '.join(ran_on)}" if ran_on else "no cell done yet") if report_only else \
        f"device {device}" + (f" (the cells shown ran on {', '.join(ran_on)})" if ran_on and ran_on != [device] else "")
    same = [c.config for c in table.cells("cpu", 0)] == [c.config for c in table.cells("paper", 0)]
    # the title is the paper's setting: say this scale's beside it (it was only in the plot)
    setting = _setting(_asked(cells[0], device, overrides)) if cells else ""
    print(f"\n{table.title}\n{table.note}\nscale {scale}" + (" (for this table the paper's own)" if same else "")
          + (f": {setting}" if setting and not same else "") + f"; {where}; the paper's numbers: {table.paper_source}")
    if overrides:
        print(f"overridden for every cell: {', '.join(overrides)} (not the table's setting: a smoke run, not a row to compare)")
    lines, shown = [], {}
    for row in rows:
        for column in table.columns:
            mine, theirs = got.get((row, column), []), table.paper.get((row, column))
            stopped = partial.get((row, column), [])
            state = "done" if mine else "stopped" if stopped else "other config" if (row, column) in other_at else "not run"
            ours = (f"{statistics.fmean(mine):.2f}" + (f"+-{statistics.stdev(mine):.2f}" if len(mine) > 1 else "")) if mine else \
                f"stopped at {stopped[0]['rounds_played']}/{stopped[0]['rounds']}" if stopped else state
            if mine and len(mine) < asked.get((row, column), 0):  # a mean over fewer seeds than asked for says so
                ours += f" [{len(mine)} of {asked[row, column]} seeds]"
            shown[row, column] = f"{ours} ({'not in paper' if theirs is None else f'{theirs:.2f}'})"
            lines.append({"row": row, "column": column, "ours": mine, "ours_mean": statistics.fmean(mine) if mine else None,
                          "seeds_done": len(mine), "seeds_asked": asked.get((row, column), 0), "paper": theirs,
                          "state": state})
    label = max(len(r) for r in rows)
    width = max([len(c) for c in table.columns] + [len(v) for v in shown.values()])
    head = " " * label + "".join(f" | {c:>{width}s}" for c in table.columns)
    print(head + "\n" + "-" * len(head))
    for row in rows:
        print(f"{row:{label}s}" + "".join(f" | {shown[row, c]:>{width}s}" for c in table.columns))
    seeds_in = sorted({d["seed"] for d in done if isinstance(d.get("seed"), int)})
    print("(ours, paper's in parentheses; " + ("no cell done yet)" if not seeds_in else
          f"seed {seeds_in[0]} alone)" if len(seeds_in) == 1 else f"mean +- sd over seeds {','.join(map(str, seeds_in))})"))
    if shadowed:
        print(f"{len(shadowed)} merged cell(s) finished in {out} too; the run directories there count, not the merged results: "
              + _first_few(shadowed, 4, "; "))
    earlier = [d for d in done if d.get("from")]
    if earlier:
        by_file: dict[str, list[dict[str, Any]]] = {}
        for d in earlier:  # grouped by the file they came from: one path per cell was a wall of text for 21 cells
            by_file.setdefault(str(d["from"]), []).append(d)
        print(f"{len(earlier)} cell(s) from earlier sittings: " + "; ".join(
            f"{len(these)} from {path} (commit(s) {', '.join(sorted({str(d.get('commit')) for d in these}))})"
            for path, these in by_file.items()))
    if otherwise:
        print(f"not counted: {len(otherwise)} cell(s) ran with another config than asked: "
              + "; ".join(f"{key} ({why})" for key, why in list(otherwise.items())[:3]) + " (pass the --set they ran with)")
    if missing or partial:
        unselected = selected is not None and any(k not in selected for k in [*missing, *(p["cell"] for v in partial.values() for p in v)])
        goes_on = ("the same command without --report-only" + (" and --cells" if unselected else "") + " goes on"
                   + (", once the cells not counted are moved away" if otherwise else "")
                   if report_only else "--cells left some out: the same command without --cells goes on" if unselected
                   else "the same command goes on")
        cost = table.cost.get(scale)  # going on is hours at some tables' scales: say so before someone types it
        stopped = [p["cell"] for v in partial.values() for p in v]
        named = "; ".join(f"{len(keys)} {what} ({_first_few(keys, 6)})"
                          for what, keys in (("not started", missing), ("stopped part-way", stopped)) if keys)
        print(f"not finished: {named} ({goes_on})" + (f"; where measured: {cost}" if cost else ""))
    payload = {"table": name, "title": table.title, "note": table.note, "paper_source": table.paper_source, "scale": scale,
               "seeds": seeds if seeds is not None else sorted({c.seed for c in cells}),
               "missing": missing, "partial": [p for v in partial.values() for p in v],
               "device": device, "compute_devices": ran_on,
               "overrides": overrides, "rows": lines, "cells": done, "not_counted": otherwise,
               # merged earlier, not shown here (a seed not asked for, a config that no longer fits): kept for a later report
               "held": held or [],
               "merged_from": sorted({d["from"] for d in done if d.get("from")}),
               # the code each cell ran (cells filled over several sittings may differ) and this report's
               "cell_commits": sorted({str(d["commit"]) for d in done if d.get("commit")}), "commit": _commit(), "machine": machine(),
               "versions": package_versions(), "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "command": " ".join([Path(sys.executable).name, *sys.argv])}
    if report_only and otherwise:  # (most likely the --set they ran with was left out): the folder's table stays as it was
        print(f"{out / 'table.json'} and table.png not written: this report leaves out cells run with another config")
        return payload
    written = out / "table.json.tmp"  # a report stopped while writing leaves the earlier table.json whole
    written.write_text(json.dumps(payload, indent=2, default=str))
    os.replace(written, out / "table.json")
    print(f"wrote {out / 'table.json'}")
    figure = plot(table, lines, out / "table.png", scale, setting, overrides, seeds_in)
    print(f"wrote {figure}")
    return payload


def plot(table: Table, lines: list[dict[str, Any]], path: Path, scale: str, setting: str = "",
         overrides: list[str] | None = None, seeds: list[int] | None = None) -> Path:
    """The table as bars, ours (mean over seeds, +- sd when there are several) beside the paper's;
    the title says at which scale and setting ours ran, a cell not run is marked so, and so is a mean over
    fewer seeds than were asked for."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(dict.fromkeys(ln["row"] for ln in lines))
    width = 3.4 * len(table.columns) + 1.5
    fig, axes = plt.subplots(1, len(table.columns), figsize=(width, 4.6), squeeze=False, sharey=True)
    # the legend says what a bar and its cap are: a mean over which seeds, +- one sd
    over = (f", seed {seeds[0]}" if len(seeds) == 1 else f", mean +- sd over seeds {','.join(map(str, seeds))}") if seeds else ""
    ours_label = f"edgefl, --scale {scale}{over}" + (" with --set (a smoke run)" if overrides else "")
    for ax, column in zip(axes[0], table.columns):
        found = [next((ln for ln in lines if ln["row"] == r and ln["column"] == column), None) for r in rows]
        mine = [ln["ours_mean"] if ln else None for ln in found]
        spread = [statistics.stdev(ln["ours"]) if ln and len(ln["ours"]) > 1 else 0.0 for ln in found]
        theirs = [table.paper.get((r, column)) for r in rows]
        xs = list(range(len(rows)))
        ax.bar([x - 0.2 for x in xs], [v or 0 for v in mine], 0.4, label=ours_label, color="C0")
        with_sd = [(x - 0.2, v, sd) for x, v, sd in zip(xs, mine, spread) if sd]  # a cap only where several seeds give one
        if with_sd:
            ax.errorbar([x for x, _, _ in with_sd], [v for _, v, _ in with_sd], [sd for _, _, sd in with_sd], fmt="none",
                        ecolor="black", capsize=3, linewidth=1)
        ax.bar([x + 0.2 for x in xs], [v or 0 for v in theirs], 0.4, label=table.paper_source, color="C7")
        for x, value, ln in zip(xs, mine, found):
            if value is None:  # a blank bar would read as 0 %
                ax.text(x - 0.2, 2, ln["state"] if ln else "not run", rotation=90, ha="center", va="bottom", fontsize=7, color="C3")
            elif ln["seeds_done"] < ln["seeds_asked"]:  # a mean over fewer seeds than asked says so, as the text does
                ax.text(x - 0.2, 2, f"{ln['seeds_done']} of {ln['seeds_asked']} seeds", rotation=90, ha="center", va="bottom",
                        fontsize=7, color="black")
        for x, value in zip(xs, theirs):
            if value is None:  # an empty slot read as a bar lost
                ax.text(x + 0.2, 2, "not in paper", rotation=90, ha="center", va="bottom", fontsize=7, color="C7")
        ax.set_xticks(xs, rows, rotation=35, ha="right", fontsize=8)
        ax.set_title(column, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("accuracy (%)")
    axes[0][0].set_ylim(0, 130)  # room above 100 % for the legend: it covered bars in a corner
    axes[0][0].set_yticks(range(0, 101, 20))
    axes[0][0].legend(fontsize=7, loc="upper left")
    title = table.title + (f"\nedgefl ran at --scale {scale}: {setting}" if setting else "") \
        + (f"; --set {', '.join(overrides)}" if overrides else "")
    # wrapped to the figure's width (about 15 characters an inch at 8 points): a long title was cut off at both sides
    fig.suptitle("\n".join(textwrap.fill(part, int(width * 15)) for part in title.split("\n")), fontsize=8)
    return save_figure(fig, path)


def _setting(config: dict[str, Any]) -> str:
    """What a scale changes, in a line: rounds, devices, width, epochs."""
    groups = (config.get("fleet") or {}).get("groups") or []
    devices = sum(int(g.get("count", 1)) for g in groups)
    widths = sorted({g["options"]["width"] for g in groups if "width" in (g.get("options") or {})})  # models that have one
    train = config.get("train") or {}
    # each model's epochs by name where they differ ("10/40" read as 40/200 at the other scale, swapped)
    by_model = {str(g.get("model")): (g.get("train") or {}).get("epochs") or train.get("epochs") or 1 for g in groups}
    epochs = sorted(set(by_model.values()))
    # a round cut to a few batches (FedHe's authors' iterations) is not an epoch: "1 local epoch(s)" misread it
    local = (f"{train['max_steps']} batches of {train.get('batch_size', '?')} a round" if train.get("max_steps")
             else f"{epochs[0] if epochs else 1} local epoch(s)" if len(epochs) <= 1
             else "local epochs " + ", ".join(f"{m} {e}" for m, e in by_model.items()))
    rounds = config["rounds"]
    per_round = (config.get("fleet") or {}).get("sample_ratio")
    picked = max(1, round(per_round * devices)) if per_round else devices
    length = (f"{rounds} rounds of one device each (the authors' iterations)" if picked == 1
              else "1 round (one-shot)" if rounds == 1 else f"{rounds} rounds")
    data = config.get("data") or {}
    share = (f", {per_round:g} of them a round" if per_round and picked > 1 else "")
    cut = ", ".join(([f"{data['samples_per_client']} images a device"] if data.get("samples_per_client") else [])
                    + ([f"a {data['test_samples']:,}-sample test subset"] if data.get("test_samples") else []))
    return (f"{length}, {devices} devices{share}" + (f", width {'/'.join(f'{w:g}' for w in widths)}" if widths else "")
            + f", {local}" + (f", {cut}" if cut else ""))


SCALES = {"paper": "the paper's length, devices, widths and epochs: a GPU's work",
          "cpu": "every choice of the paper's but length, devices, widths, epochs and data (600 images a device, a 2,000-image "
                 "test subset; FedIN: a quarter of the devices a round; FedMHO: the whole data set; FedHe: the authors' contiguous "
                 "tenths, about 6,000 images a device), cut to fit a 2-core CPU; CHFL's cpu scale is the paper's"}


def _seeds(text: str, ap: argparse.ArgumentParser) -> list[int]:
    """``--seeds``: comma-separated non-negative integers, each once (a usage error otherwise)."""
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() for p in parts):
        ap.error(f"--seeds takes comma-separated non-negative integers, e.g. 0,1,2 (got {text!r})")
    seeds = [int(p) for p in parts]
    if len(set(seeds)) != len(seeds):
        ap.error(f"--seeds names a seed twice ({text!r})")
    return seeds


def _other_table(out: Path, name: str, scale: str) -> str | None:
    """What ``out`` holds when it is another table's (or another scale's) folder, from its table.json."""
    try:
        held = json.loads((out / "table.json").read_text())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(held, dict) or (held.get("table"), held.get("scale")) == (name, scale):
        return None
    return f"the {held.get('table')!s:.40} table at --scale {held.get('scale')!s:.20}"


def _check_cells(ap: argparse.ArgumentParser, cells: list[Cell], device: str, overrides: list[str], running: bool = True) -> None:
    """Said once, before any cell runs (or is reported): a --set that makes a config invalid, or
    CUDA asked for on a machine without it when cells are to run here (else every cell would fail
    with the same reason; a report of a GPU's cells may be made on any machine)."""
    from edgefl.config import validate_config

    for cell in cells:
        try:
            validate_config(_asked(cell, device, overrides), cell.key)
        except EdgeflError as exc:
            ap.error(exc.message + (f" (hint: {exc.hint})" if exc.hint else ""))
    if device == "cuda" and running:
        import torch

        if not torch.cuda.is_available():
            ap.error("--device cuda, but torch sees no CUDA device on this machine: --device auto (or cpu) runs here")


def _stopped_line(cell: Cell, out: Path, code: int) -> str:
    """What a stop during ``cell`` left, and what the same command does next."""
    if code == 0 and _finished(out / cell.key):
        return f"stopped as {cell.key} finished: the same command goes on with the next cell"
    if (out / cell.key / "server-state.safetensors").is_file():
        return f"stopped during {cell.key}: the same command resumes it from its checkpoint"
    every = (cell.config.get("simulation") or {}).get("checkpoint_every")
    why = "its cells keep no checkpoint (each is seconds long)" if every == 0 else "it stopped before its first checkpoint"
    return f"stopped during {cell.key}: {why}, so the same command runs it again from the start"


class _OutputThatMayClose:
    """sys.stdout (and stderr) for `bench paper ... | head`: once the reader has gone, the rest of what is printed
    goes to /dev/null and the command goes on (a report still writes table.json and table.png, a
    table run its cells), where the default SIGPIPE killed it before its files were written."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def _gone(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._gone()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._gone()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def main() -> None:
    sys.stdout, sys.stderr = _OutputThatMayClose(sys.stdout), _OutputThatMayClose(sys.stderr)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("table", nargs="?", choices=sorted(TABLES))
    ap.add_argument("--scale", choices=tuple(SCALES), default="cpu",
                    help="; ".join(f"{k}: {v}" for k, v in SCALES.items()) + " (default: cpu)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="where the cells train: auto (cuda when torch sees a GPU, else cpu; the default), cpu, or cuda "
                         "(refused before any cell runs when there is none). A cell's device is recorded with it; a "
                         "report names the devices its cells ran on")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds (default: 0 alone; CHFL's paper uses five: 0,1,2,3,4)")
    ap.add_argument("--out", type=users_path, default=None,
                    help="the table's folder (default bench/results/paper/<table>-<scale> in the checkout; through ./dev.sh a "
                         "relative --out or --merge is taken from the folder you ran it in)")
    ap.add_argument("--cells", default=None, help="run only these cells (keys as listed by --list); the report still covers "
                                                   "every cell of the seeds, those not run shown as such")
    ap.add_argument("--report-only", action="store_true", help="no training: the table from the cells done so far, in --out's folder (which must exist) and in "
                         "the --merge files (either will do)")
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    help="override a key of every cell's config, e.g. --set rounds=5 (a smoke run: use its own --out)")
    ap.add_argument("--list", action="store_true", help="the tables, their settings and their cells")
    ap.add_argument("--probe", type=float, default=None, metavar="SECONDS",
                    help="no table: run each cell SECONDS, then estimate from its round times how long the table takes "
                         "here (writes OUT/probe.json; for planning a lent GPU's minutes)")
    ap.add_argument("--merge", type=users_path, action="append", default=[], metavar="TABLE_JSON",
                    help="count the finished cells of an earlier sitting's table.json (another machine's, a GPU's, a "
                         "session whose run directories are gone): they are not run again; each is checked against "
                         "this command's config. Repeatable")
    args = ap.parse_args()
    seeds = _seeds(args.seeds, ap)
    given = [flag for flag, on in (("--merge", args.merge), ("--report-only", args.report_only), ("--cells", args.cells is not None),
                                   ("--probe", args.probe is not None), ("--set", args.overrides), ("--out", args.out)) if on]
    if args.table is None and given and not args.list:
        ap.error(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} a TABLE: one of {', '.join(sorted(TABLES))} "
                 "(--list says what each holds)")
    if args.list or args.table is None:
        print(f"--scale {args.scale}: {SCALES[args.scale]} (--scale {'paper' if args.scale == 'cpu' else 'cpu'} lists the other)\n")
        for name, table in TABLES.items():
            if args.table is not None and name != args.table:  # `paper.py fedin --list`: that table only
                continue
            listed = [c for s in seeds for c in table.cells(args.scale, s)]
            print(f"{name}: {table.title}\n  {table.note}\n  at --scale {args.scale}: {_setting(listed[0].config)}"
                  f"\n  cost: {table.cost.get(args.scale, 'not measured')} (--probe SECONDS estimates it on this machine)"
                  f"\n  cells: {', '.join(c.key for c in listed)}")
        return
    table = TABLES[args.table]
    cells = every_cell = [c for s in seeds for c in table.cells(args.scale, s)]  # the report covers every cell of the seeds
    if args.cells is not None:
        wanted = {k.strip() for k in args.cells.split(",")}
        if "" in wanted:
            ap.error(f"--cells names cells, comma-separated (got {args.cells!r}); leave it out to run every cell")
        unknown = wanted - {c.key for c in cells}
        if unknown:
            ap.error(f"no cells {sorted(unknown)} in {args.table}: it has {', '.join(c.key for c in cells)}"
                     + (" (a cell of another seed needs --seeds)" if any("-s" in k for k in unknown) else ""))
        cells = [c for c in cells if c.key in wanted]
    out = args.out or RESULTS / "paper" / f"{args.table}-{args.scale}"
    if out.exists() and not out.is_dir():
        ap.error(f"--out {out} is a file: the table's folder holds its cells' run directories and table.json (name a folder)")
    if args.report_only and not out.is_dir() and not args.merge:
        ap.error(f"{out} does not exist: --report-only reads the cells a table run wrote there (check --out and --scale, "
                 "or pass an earlier sitting's table.json with --merge)"
                 + ("; no cell of this table has run at --scale paper here: its rows are not measured on this machine "
                    "(docs/benchmarks.md 25 says which rows ran where)" if args.scale == "paper" else ""))
    if (out / "table.json").exists() and not (out / "table.json").is_file():  # (a pipe would be read without end)
        ap.error(f"--out {out}: its table.json is not a regular file (a pipe, a device or a folder): move it aside")
    other = _other_table(out, args.table, args.scale)
    if other:
        ap.error(f"{out} holds {other}: give this table its own --out (its cells and table.json would mix with those)")
    if args.probe is not None and not (math.isfinite(args.probe) and args.probe > 0):
        ap.error(f"--probe takes the seconds to run each cell, a number above 0 (got {args.probe:g})")
    if args.probe is not None and args.report_only:
        ap.error("--probe runs cells and --report-only runs none: give one of them")
    _check_cells(ap, cells, args.device, args.overrides, running=not args.report_only)
    if args.merge and args.probe is not None:
        ap.error("--probe times cells and --merge counts finished ones: give one of them")
    try:
        merged, merge_notes, held = load_merged(args.merge, args.table, table, args.scale, every_cell, args.device,
                                                args.overrides, carried=out / "table.json")
    except MergeRefused as exc:  # (a damaged table.json of --out's own is refused here too, --merge given or not)
        ap.error(f"{'--out' if exc.about_out else '--merge'}: {exc.message}" + (f" (hint: {exc.hint})" if exc.hint else ""))
    for line in merge_notes:
        print(f"merged cells: {line}", flush=True)
    if not args.report_only:
        if args.probe is None:
            otherwise = [(c.key, why) for c in cells if (why := ran_otherwise(c, out, args.device, args.overrides))]
            if otherwise:
                ap.error(f"{len(otherwise)} cell(s) in {out} ran with another config than this command's: "
                         + "; ".join(f"{key} ({why})" for key, why in otherwise[:3])
                         + ". A cell's folder is taken as it is (a finished cell is not run again, a stopped one resumes), so it "
                           "would stand in this table: give this run its own --out (a smoke run's --set belongs in a folder of its "
                           "own), or pass the --set it ran with")
    try:
        out.mkdir(parents=True, exist_ok=True)
        if not os.access(out, os.W_OK | os.X_OK):
            raise PermissionError(13, "not writable by you")
    except OSError as exc:  # (a file on the way, /proc, a read-only disk: said before any cell runs)
        ap.error(f"--out {out} cannot be made or written ({exc.strerror or exc}): name a folder you can write")
    if args.probe is not None:
        try:
            probe(args.table, table, cells, out, args.scale, args.device, args.overrides, args.probe)
        except KeyboardInterrupt:
            print("stopped: the cell being probed was stopped too; no probe.json written", flush=True)
            raise SystemExit(130) from None
        return
    failed = []
    if not args.report_only:
        for i, cell in enumerate(cells, 1):
            print(f"[{i}/{len(cells)}] {cell.key}", flush=True)
            if cell.key in merged and not _finished(out / cell.key):
                print(f"{cell.key}: finished in another sitting ({merged[cell.key]['from']})", flush=True)
                continue
            siblings = [c.key for c in every_cell if cell.clients_group and c.clients_group == cell.clients_group]
            code, stopped = run_cell(cell, out, args.device, args.overrides, siblings)
            if stopped or code == 130:
                print(_stopped_line(cell, out, code), flush=True)
                report(args.table, table, every_cell, out, args.scale, args.device, args.overrides, seeds, merged=merged,
                       held=held, selected={c.key for c in cells} if args.cells is not None else None)
                raise SystemExit(130)
            if code != 0:
                failed.append((cell.key, code))
    report(args.table, table, every_cell, out, args.scale, args.device, args.overrides, seeds, args.report_only, merged, held,
           {c.key for c in cells} if args.cells is not None else None)
    if failed:
        raise SystemExit(f"cells that failed: {', '.join(f'{k} (exit {c})' for k, c in failed)}; their run directories say why")


if __name__ == "__main__":
    main()
