"""What a user meets every day: progress in a log, plots that tell the truth, --show-config that
refuses what the run would refuse."""

from __future__ import annotations

import io
import json
import time

from rich.console import Console

from edgefl.config import validate_config
from edgefl.heartbeat import Heartbeat
from edgefl.rundir import RunDir
from edgefl.sim import Simulation
from tests.conftest import digits_config
from tests.test_cli import ROOT, edgefl


def test_a_log_gets_a_progress_line_while_nothing_else_is_printed():
    sink = io.StringIO()
    console = Console(file=sink, force_terminal=False)
    with Heartbeat(console, every_s=0.3) as beat:
        beat.status("round 1/5: training, 3/10 devices done")
        time.sleep(1.0)
    lines = [line for line in sink.getvalue().splitlines() if line]
    assert len(lines) >= 2 and all("round 1/5: training, 3/10 devices done" in line for line in lines)
    assert lines[0].startswith("[")
    quiet = io.StringIO()
    with Heartbeat(Console(file=quiet, force_terminal=True), every_s=0.1) as beat:  # a terminal shows bars instead
        beat.status("x")
        time.sleep(0.3)
    assert quiet.getvalue() == ""


def test_show_config_refuses_what_the_run_would_refuse():
    res = edgefl("simulate", str(ROOT / "examples" / "fedhe_digits_quick.toml"), "--set", "method.name=fedmho",
                 "--set", "rounds=2", "--show-config")
    assert res.returncode == 2 and "one-shot" in res.stderr and "Traceback" not in res.stderr


def test_plots_of_a_method_that_shares_nothing_and_of_a_single_evaluation(tmp_path):
    cfg = validate_config({**digits_config("local", rounds=2), "eval": {"every": 5}})  # evaluated once: the last round
    run = RunDir.create(tmp_path / "run", cfg.name, cfg.seed)
    Simulation(cfg, run, show_progress=False).run()
    plots = {p.name for p in (run.path / "plots").iterdir()}
    assert "accuracy.png" in plots and "communication.png" not in plots  # no empty chart
    summary = json.loads((run.path / "summary.json").read_text())
    assert summary["interrupted"] is False and summary["rounds_played"] == 2


def test_the_console_names_the_device_classes_and_the_files_read(tmp_path):
    res = edgefl("simulate", str(ROOT / "examples" / "fleet_by_device_class.toml"), "--set", "rounds=1",
                 "--set", "data.samples_per_client=50", "--set", "data.test_samples=200", "--out", str(tmp_path / "run"), "-q")
    assert res.returncode in (0, 3), res.stderr[-2000:]
    assert "devices: " in res.stderr and " -> " in res.stderr
    assert "t10k-labels-idx1-ubyte" in res.stderr  # the exact files
    run_json = json.loads((tmp_path / "run" / "run.json").read_text())
    assert any(f.endswith("train-images-idx3-ubyte.gz") for f in run_json["dataset"]["files"])
