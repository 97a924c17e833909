"""The edgefl command as a user runs it: a real subprocess of the installed console script."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
EDGEFL = shutil.which("edgefl", path=str(Path(sys.executable).parent)) or "edgefl"


def edgefl(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([EDGEFL, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


def test_models_table_lists_the_zoo():
    res = edgefl("models")
    assert res.returncode == 0, res.stderr
    for name in ("resnet18", "resnet50", "fedhe-cnn-9", "vgg9", "cvae-small", "cvae-large", "mlp", "lenet5", "cnn-small"):
        assert name in res.stdout
    assert "252.9M" in res.stdout  # VGG-9 FLOPs per sample, measured
    # the DP-SGD column (issue 36): ready as it is, or with the GroupNorm builder option
    rows = {line.split("│")[1].strip(): line for line in res.stdout.splitlines() if line.count("│") > 3}
    assert "DP-SGD" in res.stdout and "│ yes " in rows["lenet5"] and "│ norm=group " in rows["resnet18"]


def test_simulate_example_then_report(tmp_path):
    out = tmp_path / "run"
    res = edgefl("simulate", str(ROOT / "examples" / "fedhe_digits_quick.toml"), "--set", "rounds=2", "--out", str(out), "-q")
    assert res.returncode == 0, res.stderr
    assert "overall" in res.stdout and str(out) in res.stdout
    assert json.loads((out / "summary.json").read_text())["rounds"] == 2
    for png in ("accuracy.png", "communication.png", "partition.png"):
        (out / "plots" / png).unlink()
    res = edgefl("report", str(out))
    assert res.returncode == 0, res.stderr
    assert (out / "plots" / "accuracy.png").stat().st_size > 1000


def test_show_config_prints_resolved_preset():
    res = edgefl("simulate", "--show-config", "--set", "rounds=3")
    assert res.returncode == 0 and "rounds = 3" in res.stdout and 'name = "fedavg"' in res.stdout and 'baseline = "local"' in res.stdout
    res = edgefl("simulate", "--show-config", "--preset", "paper")
    assert res.returncode == 0 and "rounds = 50" in res.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (("simulate", "--set", "data.partiton=iid"), "did you mean 'partition'"),
        (("simulate", "--set", "fleet.groups.0.model=resnet19"), "did you mean 'resnet18'"),
        (("simulate", "no-such-file.toml"), "cannot read config"),
        (("simulate", "--preset", "papr"), "did you mean 'paper'"),
        (("report", "no-such-dir"), "is not a directory"),
    ],
)
def test_bad_input_is_a_clear_error_without_traceback(args, message):
    res = edgefl(*args)
    assert res.returncode == 2
    assert message in res.stderr and "Traceback" not in res.stderr


def test_report_on_a_folder_that_is_not_a_run(tmp_path):
    res = edgefl("report", str(tmp_path))
    assert res.returncode == 2 and "has no metrics.jsonl" in res.stderr


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM"])
def test_interrupt_finishes_the_round_and_writes_models_summary_and_plots(tmp_path, signame):
    """Ctrl-C or SIGTERM mid-run: no traceback; the current round finishes, then the models, the
    summary and the plots of what ran are written."""
    import signal
    import time

    out = tmp_path / "run"
    proc = subprocess.Popen(
        [EDGEFL, "simulate", str(ROOT / "examples" / "fedhe_digits_quick.toml"), "--set", "rounds=500", "--out", str(out), "-q"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # a test runner started in the background inherits SIGINT ignored; a user's terminal does not
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.time() + 120
    while time.time() < deadline and not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().count("\n") >= 2):
        time.sleep(0.2)
    proc.send_signal(getattr(signal, signame))
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert f"interrupted ({signame}) after" in stderr and "Traceback" not in stderr
    rounds = (out / "metrics.jsonl").read_text().count("\n")
    assert rounds >= 2 and (out / "plots" / "accuracy.png").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["rounds_played"] == rounds
    assert list((out / "models").glob("*.safetensors"))


def test_a_run_ends_with_its_exports_and_export_command_reexports(tmp_path):
    pytest.importorskip("litert_torch")
    import tomli_w

    cfg = {
        "name": "export-at-end", "seed": 0, "rounds": 1, "export": ["onnx", "tflite"],
        "method": {"name": "fedavg"},
        "data": {"dataset": "digits", "partition": "iid"},
        "train": {"epochs": 1, "batch_size": 32},
        "fleet": {"groups": [{"model": "fedhe-cnn-0", "count": 2, "options": {"width": 0.125}}]},
    }
    path = tmp_path / "run.toml"
    path.write_text(tomli_w.dumps(cfg))
    out = tmp_path / "run"
    res = edgefl("simulate", str(path), "--out", str(out), "-q", timeout=600)
    assert res.returncode == 0, res.stderr
    names = sorted(p.name for p in (out / "export").iterdir())
    assert "global-fedhe-cnn-0_width_0.125.onnx" in names and "global-fedhe-cnn-0_width_0.125.tflite.json" in names, names
    meta = json.loads((out / "export" / "global-fedhe-cnn-0_width_0.125.tflite.json").read_text())
    assert meta["source"]["round"] == 1 and meta["normalisation"]["scale"] == pytest.approx(1 / 16)
    # the command on one weights file, ONNX only, into another folder
    weights = next((out / "models").glob("*.safetensors"))
    res = edgefl("export", str(weights), "--format", "onnx", "--no-dynamic-batch", "--out", str(tmp_path / "again"))
    assert res.returncode == 0, res.stderr
    assert "max |diff|" in res.stdout and sorted(p.suffix for p in (tmp_path / "again").iterdir()) == [".json", ".onnx"]
    # a wrong architecture is a clear error, not a traceback
    res = edgefl("export", str(weights), "--model", "lenet5")
    assert res.returncode != 0 and "holds a fedhe-cnn-0, not a lenet5" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("quorum, message", [("1.5", "a whole number"), ("9", "a round selects only")])
def test_a_quorum_no_round_could_meet_is_a_config_error_not_clipped(quorum, message):
    res = edgefl("simulate", str(ROOT / "examples" / "fedhe_digits_quick.toml"), "--set", f"network.quorum={quorum}", "--show-config")
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("command", ["simulate", "fleet", "server"])
def test_missing_data_is_reported_before_anything_is_written(tmp_path, command):
    out = tmp_path / "run"
    (tmp_path / "empty").mkdir()
    args = [command, *(["--config"] if command == "server" else []), str(ROOT / "examples" / "fedhe_digits_quick.toml"),
            "--set", "data.dataset=mnist", "--data-dir", str(tmp_path / "empty"),
            "--out", str(out), *(["--broker", "mqtt://127.0.0.1:1"] if command == "server" else [])]
    res = edgefl(*args)
    assert res.returncode == 2, res.stderr
    assert "mnist not found in" in res.stderr and "--data-dir DIR" in res.stderr and "Traceback" not in res.stderr
    assert "install it with put" not in res.stderr
    assert not out.exists()


def test_export_refuses_an_empty_format_and_an_unwritable_folder_in_one_line(tmp_path):
    run = tmp_path / "run"
    res = edgefl("simulate", str(ROOT / "examples" / "fedhe_digits_quick.toml"), "--set", "method.name=fedavg", "--set", "rounds=1",
                 "--out", str(run), "-q")
    assert res.returncode == 0, res.stderr[-2000:]
    res = edgefl("export", str(run), "--format", "")
    assert res.returncode == 2 and "--format names no format" in res.stderr and "Traceback" not in res.stderr
    res = edgefl("export", str(run), "--format", "onnx", "--micro")
    assert res.returncode == 2 and "--micro needs the TFLite format" in res.stderr and "Traceback" not in res.stderr
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    res = edgefl("export", str(run), "--format", "onnx", "--out", str(blocker / "exports"))
    assert res.returncode == 2 and "cannot write into" in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) <= 3


def test_ctrl_c_while_the_server_waits_for_devices_ends_it_as_interrupted(tmp_path):
    """No device joined yet: the first Ctrl-C stops the wait and the run ends before round 1, as
    an interruption (exit 130, a run directory to resume), not as a missing-metrics error."""
    import signal
    import time

    from tests.mosquitto import mosquitto

    with mosquitto(tmp_path) as url:
        proc = subprocess.Popen([EDGEFL, "server", "--broker", url, "--config", str(ROOT / "examples" / "fedhe_digits_quick.toml"),
                                 "--out", str(tmp_path / "run")], stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not (tmp_path / "run" / "run.json").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "interrupted (SIGINT) after 0 of" in stderr and "Traceback" not in stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--devices", "x:y"], "expected A:B"),
    (["--devices", "50:60"], "selects none of the fleet's 6 devices"),
    (["--dropout", "2"], "load settings out of range: dropout"),
])
def test_loadgen_refuses_bad_options_with_a_reason(args: list[str], message: str):
    res = edgefl("loadgen", "--broker", "mqtt://127.0.0.1:1", "--config", str(ROOT / "examples" / "fedhe_digits_quick.toml"), *args)
    assert res.returncode != 0 and message in res.stderr and "Traceback" not in res.stderr


def test_the_local_only_baseline_runs_beside_the_method_in_table_summary_and_plots(tmp_path):
    """simulation.baseline = "local": the same devices, data and seed under Local-only, in
    RUN_DIR/baseline, compared per architecture and overall in the table, summary.json and the
    plot, with what FedAvg would have sent beside the method's bytes; edgefl report shows it again."""
    out = tmp_path / "run"
    res = edgefl("simulate", str(ROOT / "examples" / "fedhe_digits_quick.toml"), "--set", "rounds=2", "--set", "threads=1",
                 "--set", 'simulation.baseline="local"', "--out", str(out), "-q")
    assert res.returncode == 0, res.stderr[-2000:]
    base = [json.loads(line) for line in (out / "baseline" / "metrics.jsonl").read_text().splitlines()]
    mine = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in base] == [1, 2] and all(m["bytes_up"] == 0 and m["bytes_down"] == 0 for m in base)
    # FedHe's first round is cross-entropy only (its warm-up): the same devices, data, initial weights
    # and batches must then give Local-only's numbers exactly
    assert base[0]["accuracy"] == mine[0]["accuracy"] and base[0]["train_loss"] == mine[0]["train_loss"]
    assert 'name = "local"' in (out / "baseline" / "config.toml").read_text()

    summary = json.loads((out / "summary.json").read_text())
    cmp = summary["baseline"]
    assert cmp["round"] == 2 and cmp["method"] == "local"
    assert cmp["accuracy"]["overall"] == base[-1]["accuracy"]["overall"]
    assert cmp["method_accuracy"]["overall"] == mine[-1]["accuracy"]["overall"]
    assert cmp["gain"]["overall"] == pytest.approx(mine[-1]["accuracy"]["overall"] - base[-1]["accuracy"]["overall"], abs=1e-6)
    assert set(cmp["gain"]["per_arch"]) == set(mine[-1]["accuracy"]["per_arch"]) and len(cmp["gain"]["per_arch"]) == 3
    assert cmp["verdict"].startswith("FedHe ") and "Local-only" in cmp["verdict"]
    fedavg = summary["fedavg_equivalent"]
    per_device = fedavg["weights_bytes_per_device"]
    assert len(per_device) == 6 and per_device["client-0"] == per_device["client-1"] > per_device["client-4"]
    assert fedavg["bytes_up_total"] == fedavg["bytes_down_total"] == 2 * sum(per_device.values())  # every device, both rounds
    assert fedavg["bytes_up_total"] > 20 * summary["bytes_up_total"]

    for text in (res.stdout, edgefl("report", str(out)).stdout):
        assert "Local-only" in text and "gain (points)" in text and "FedAvg would send" in text
        assert cmp["verdict"][:40] in text.replace("\n", " ")
    assert (out / "plots" / "accuracy.png").stat().st_size > 1000


def test_no_baseline_unless_asked_and_none_for_local_only_itself(tmp_path):
    out = tmp_path / "run"
    res = edgefl("simulate", str(ROOT / "examples" / "fedhe_digits_quick.toml"), "--set", "rounds=1", "--set", "threads=1",
                 "--set", 'method.name="local"', "--set", 'simulation.baseline="local"', "--out", str(out), "-q")
    assert res.returncode == 0, res.stderr[-2000:]
    assert not (out / "baseline").exists() and "no baseline: the method is local itself" in res.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert "baseline" not in summary and summary["fedavg_equivalent"]["bytes_up_total"] > 0
    assert "gain (points)" not in res.stdout and "Local-only on digits" in res.stdout  # the title names the method


def test_a_run_whose_devices_judge_on_their_own_shares_says_so_in_its_data_line(tmp_path):
    from typer.testing import CliRunner

    from edgefl.cli import app

    example = Path(__file__).resolve().parent.parent / "examples" / "chfl_breast_cancer.toml"
    res = CliRunner().invoke(app, ["simulate", str(example), "--set", "rounds=1", "--out", str(tmp_path / "run"), "--quiet"])
    assert res.exit_code == 0, res.output
    assert "569 samples pooled, each device keeping 25% of its share to judge on" in res.output and "/ 0 test" not in res.output


def test_every_help_text_shows_its_square_brackets():
    # an outside trial's: typer reads help as rich markup, and "[method]", "[[filters]]" and
    # "[default: 32, ...]" vanished from --help (a bracket meant as text is escaped: "\[")
    import typer
    from rich.text import Text

    from edgefl.cli import app

    lost = []

    def walk(command, path: str) -> None:
        for text in [command.help or "", *(getattr(p, "help", None) or "" for p in command.params)]:
            if "[" in text and Text.from_markup(text).plain != text.replace("\\[", "["):
                lost.append(f"{path}: {text[:80]}")
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, f"{path} {name}")

    walk(typer.main.get_command(app), "edgefl")
    assert not lost, lost
