"""The seed papers' tables as one command each (bench/paper.py, issue 38): every cell's config,
at the papers' scale and scaled to a CPU, is one edgefl accepts (so a lent GPU never meets a
config error), and a table run from its command fills its rows, goes on from what is done, and
records the paper's numbers beside its own with the commit and the machine."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from edgefl.config import validate_config

ROOT = Path(__file__).resolve().parents[1]


def torch_has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _paper():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec = importlib.util.spec_from_file_location("bench_paper", ROOT / "bench" / "paper.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["bench_paper"] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "bench"))


@pytest.mark.parametrize("scale", ["paper", "cpu"])
def test_every_cell_of_every_table_is_a_valid_config(scale):
    paper = _paper()
    for name, table in paper.TABLES.items():
        cells = table.cells(scale, 0)
        assert len({c.key for c in cells}) == len(cells), name
        for cell in cells:
            cfg = validate_config(dict(cell.config, device="cuda"), f"{name}/{cell.key}")
            assert cfg.seed == 0 and cell.column in table.columns
        assert {r for r, _ in table.paper} <= {c.row for c in cells} | {"FedAvg"}, name  # every paper row has a cell


def test_a_table_runs_its_cells_skips_the_finished_ones_and_records_the_paper_beside_its_own(tmp_path):
    out = tmp_path / "chfl"
    cmd = [sys.executable, str(ROOT / "bench" / "paper.py"), "chfl", "--out", str(out), "--cells", "chfl-iid-s0,solo-iid-s0",
           "--set", "rounds=3"]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert first.returncode == 0, first.stderr[-3000:] + first.stdout[-2000:]
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert again.returncode == 0 and again.stdout.count("finished earlier") == 2, again.stdout + again.stderr[-3000:]
    assert "--cells left some out: the same command without --cells goes on" in again.stdout  # (it said "the same command")
    table = json.loads((out / "table.json").read_text())
    row = {(ln["row"], ln["column"]): ln for ln in table["rows"]}
    assert row[("CHFL", "iid")]["paper"] == 89.88 and 0 < row[("CHFL", "iid")]["ours_mean"] <= 100
    assert row[("SOLO", "non-iid")]["ours"] == []  # not run: shown as such
    assert table["commit"] and table["machine"] and (out / "table.png").stat().st_size > 0
    assert table["compute_devices"] == ["cpu"] or torch_has_cuda()  # the device the cells ran on, not "auto"
    assert "not run" in again.stdout and "(89.88)" in again.stdout
    # the report covers the whole table of the seeds asked, not only the cells this command ran
    assert table["seeds"] == [0] and table["partial"] == []
    assert sorted(table["missing"]) == ["avg-dirichlet-s0", "avg-iid-s0", "chfl-dirichlet-s0", "solo-dirichlet-s0"]
    # the report of more seeds than were run says how many each mean stands on, and which cells are missing
    more = subprocess.run([sys.executable, str(ROOT / "bench" / "paper.py"), "chfl", "--out", str(out), "--cells",
                           "chfl-iid-s0,chfl-iid-s1", "--seeds", "0,1", "--report-only", "--set", "rounds=3"], capture_output=True, text=True, timeout=120)
    assert more.returncode == 0, more.stderr[-2000:]
    assert "[1 of 2 seeds]" in more.stdout and "10 not started (" in more.stdout
    table = json.loads((out / "table.json").read_text())
    assert table["seeds"] == [0, 1] and "chfl-iid-s1" in table["missing"] and len(table["missing"]) == 10
    assert table["cells"][0]["commit"] and table["cell_commits"]  # the code each cell ran
    # the cells ran with --set rounds=3 (a smoke run): the table's own command does not take them as its cells
    plain = subprocess.run(cmd[:-2], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert plain.returncode == 2 and "ran with another config than this command's" in plain.stderr, plain.stderr[-2000:]
    assert "rounds: 3 there, 60 asked" in plain.stderr and "finished earlier" not in plain.stdout
    told = subprocess.run([*cmd[:-2], "--report-only"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert told.returncode == 0 and "not counted: 2 cell(s) ran with another config" in told.stdout, told.stdout
    assert "table.png not written" in told.stdout  # the smoke run's own table is not overwritten by an empty one
    assert json.loads((out / "table.json").read_text())["rows"][0]["ours"]


def test_a_wrong_cell_or_a_missing_report_folder_is_a_usage_error(tmp_path):
    script = str(ROOT / "bench" / "paper.py")
    bad = subprocess.run([sys.executable, script, "chfl", "--cells", "nope", "--out", str(tmp_path / "t")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no cells ['nope'] in chfl" in bad.stderr and "chfl-iid-s0" in bad.stderr
    missing = subprocess.run([sys.executable, script, "chfl", "--report-only", "--out", str(tmp_path / "absent")],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    assert not (tmp_path / "absent").exists()
    # through ./dev.sh (which runs benchmarks in the checkout) a relative --out or --merge is the user's folder's
    import os
    theirs = {**os.environ, "EDGEFL_CALLER_DIR": str(tmp_path)}
    for args, said in [(["--out", "rel"], f"{tmp_path / 'rel'} does not exist"), (["--merge", "m.json"], f"{tmp_path / 'm.json'} cannot")]:
        relative = subprocess.run([sys.executable, script, "chfl", "--report-only", *args], capture_output=True, text=True,
                                  timeout=120, cwd=ROOT, env=theirs)
        assert relative.returncode == 2 and said in relative.stderr, relative.stderr[-2000:]
    # an outside trial's mistakes: each a usage error before anything is run or written
    other = tmp_path / "fedhe-cpu"
    other.mkdir()
    (other / "table.json").write_text(json.dumps({"table": "fedhe", "scale": "cpu"}))
    for args, said in [(["--report-only", "--out", str(other)], "holds the fedhe table at --scale cpu"),
                       (["--out", str(other)], "give this table its own --out"),
                       (["--seeds", "0,,x"], "comma-separated non-negative integers"), (["--seeds", "0-2"], "got '0-2'"),
                       (["--seeds", ""], "non-negative integers"), (["--seeds", "-1"], "non-negative"),
                       (["--seeds", "1,1"], "twice"), (["--cells", ""], "leave it out to run every cell")]:
        bad = subprocess.run([sys.executable, script, "chfl", *args, *([] if "--out" in args else ["--out", str(tmp_path / "t")])],
                             capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and said in bad.stderr, (args, bad.stderr[-2000:])
    assert json.loads((other / "table.json").read_text()) == {"table": "fedhe", "scale": "cpu"}  # left as it was
    piped = tmp_path / "piped"  # a second trial's: a pipe as --out's table.json was read without end
    piped.mkdir()
    os.mkfifo(piped / "table.json")
    hung = subprocess.run([sys.executable, script, "chfl", "--report-only", "--out", str(piped)], capture_output=True, text=True,
                          timeout=120)
    assert hung.returncode == 2 and "its table.json is not a regular file" in hung.stderr
    assert not (tmp_path / "t").exists()


def test_every_benchmarks_relative_path_is_the_callers_through_dev_sh(monkeypatch, tmp_path):
    # an --authors-dir or --out given to ./dev.sh bench was taken from the checkout, where dev.sh cds
    import re

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from common import users_path
    finally:
        sys.path.remove(str(ROOT / "bench"))
    monkeypatch.setenv("EDGEFL_CALLER_DIR", str(tmp_path))
    assert users_path("FedMHO") == tmp_path / "FedMHO" and users_path("/abs/x") == Path("/abs/x")
    monkeypatch.delenv("EDGEFL_CALLER_DIR")
    assert users_path("FedMHO") == Path("FedMHO")  # run as python bench/X.py: the working folder's, as any program's
    paths = "out|merge|plot|plot-dir|keep|replot|from-results|authors-dir|root|profile-server"
    for script in sorted((ROOT / "bench").glob("*.py")):  # a path option of a benchmark is read by users_path
        text = script.read_text()
        plain = re.findall(r'add_argument\("(--[a-z-]+)", type=Path\b', text)
        assert not plain, f"{script.name}: {plain} would be taken from the checkout through ./dev.sh (type=users_path)"
        for line in re.findall(rf'add_argument\("--(?:{paths})",[^\n]*', text):
            assert "type=users_" in line or "users_path(args." in text, f"{script.name}: {line[:80]} (type=users_path or users_file)"


def test_a_probe_times_a_few_rounds_and_estimates_the_whole_cell_without_a_table(tmp_path):
    out = tmp_path / "chfl"
    # a cell that cannot finish in the probe (many rounds) and one that does (three rounds): both estimated
    cmd = [sys.executable, str(ROOT / "bench" / "paper.py"), "chfl", "--out", str(out), "--cells", "chfl-iid-s0",
           "--set", "rounds=100000", "--set", "eval.every=5", "--probe", "20"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-2000:]
    probe = json.loads((out / "probe.json").read_text())
    (cell,) = probe["cells"]
    assert cell["cell"] == "chfl-iid-s0" and not cell["finished"] and cell["rounds"] == 100_000
    # how many rounds fit in the probe depends on the machine and its load (a CI runner with two test
    # workers timed two in 8 s): the arithmetic on them is tested apart, in estimate_cell
    assert cell["rounds_timed"] >= 1 and cell["median_round_s"] > 0
    assert (cell["mean_eval_s"] is not None) == ("s an evaluation" in run.stdout)
    # 100,000 rounds at the measured rate: far longer than the probe itself
    assert cell["estimated_cell_s"] > 100 * cell["probe_s"]
    assert probe["machine"] and not (out / "table.json").exists() and not (out / "chfl-iid-s0").exists()
    assert "the whole cell about" in run.stdout and probe["device"] in ("cpu", "cuda")
    # no round in the probe: all that is known is that the cell takes longer than the probe, not rounds x probe
    short = subprocess.run(cmd[:-1] + ["0.3"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert short.returncode == 0, short.stderr[-3000:]
    (cell,) = json.loads((out / "probe.json").read_text())["cells"]
    assert cell["estimated_cell_s"] is None and 0.3 <= cell["lower_bound_cell_s"] < 30
    assert "no round finished" in short.stdout and "more than" in short.stdout
    for bad in ("0", "-3", "nan"):
        refused = subprocess.run(cmd[:-1] + [bad], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert refused.returncode == 2 and "a number above 0" in refused.stderr


def test_the_estimate_times_plain_rounds_and_evaluations_apart_and_leaves_out_the_first_round():
    estimate = _paper().estimate_cell
    # rounds 1-6, evaluating every third: round 1 carries one-off costs, rounds 3 and 6 an evaluation
    times, evaluated = [5.0, 1.0, 3.0, 1.2, 0.8, 3.0], [False, False, True, False, False, True]
    per_round, evals, first_only, total = estimate(times, evaluated, rounds=100, every=5, startup=4.0)
    assert per_round == 1.0 and evals == [2.0, 2.0] and not first_only
    assert total == pytest.approx(1.0 * 100 + 2.0 * (100 // 5 + 1) + 4.0)
    # two rounds, the second an evaluation: only the first is known, an upper estimate
    per_round, evals, first_only, total = estimate([5.0, 3.0], [False, True], rounds=10, every=2, startup=0.0)
    assert per_round == 5.0 and first_only and evals == [] and total == pytest.approx(50.0)
    # every round evaluates: a round's time includes its evaluation, nothing is taken apart
    per_round, evals, first_only, total = estimate([5.0, 2.0, 4.0], [True] * 3, rounds=10, every=1, startup=1.0)
    assert per_round == 3.0 and evals == [] and total == pytest.approx(31.0)
    assert estimate([], [], rounds=10, every=1, startup=3.0) == (None, [], False, None)


def test_the_list_says_what_each_scale_sets():
    script = str(ROOT / "bench" / "paper.py")
    paper = subprocess.run([sys.executable, script, "--list", "--scale", "paper"], capture_output=True, text=True, timeout=120)
    cpu = subprocess.run([sys.executable, script, "--list", "--scale", "cpu"], capture_output=True, text=True, timeout=120)
    assert "at --scale paper: 50000 rounds of one device each (the authors' iterations), 10 devices, 3 batches of 50 a round" in paper.stdout
    assert "at --scale cpu: 2000 rounds of one device each (the authors' iterations), 10 devices, width 0.25" in cpu.stdout
    assert "at --scale paper: 1 round (one-shot), 10 devices, width 1, local epochs vgg9 200, cvae-small 40" in paper.stdout  # FedMHO
    assert "cost: about 30 min a seed on an H200" in paper.stdout and "cost: 5-9 min a cell" in cpu.stdout
    assert cpu.stdout.startswith("--scale cpu: every choice of the paper's but") and "--scale paper lists the other" in cpu.stdout
    one = subprocess.run([sys.executable, script, "fedin", "--list"], capture_output=True, text=True, timeout=120)
    assert "fedin: FedIN" in one.stdout and "chfl:" not in one.stdout and "fedhe:" not in one.stdout  # the table named only


def test_an_invalid_set_or_a_missing_gpu_is_said_once_before_any_cell_runs(tmp_path):
    import torch

    script = str(ROOT / "bench" / "paper.py")
    bad = subprocess.run([sys.executable, script, "chfl", "--set", "rounds=abc", "--out", str(tmp_path / "t")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "rounds: Input should be a valid integer" in bad.stderr and "run directories" not in bad.stderr
    (tmp_path / "done").mkdir()
    report = subprocess.run([sys.executable, script, "chfl", "--report-only", "--set", "rounds=abc", "--out", str(tmp_path / "done")],
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 2 and "rounds: Input should be a valid integer" in report.stderr and "Traceback" not in report.stderr
    if not torch.cuda.is_available():
        gpu = subprocess.run([sys.executable, script, "chfl", "--device", "cuda", "--out", str(tmp_path / "t")],
                             capture_output=True, text=True, timeout=120)
        assert gpu.returncode == 2 and gpu.stderr.count("no CUDA device") == 1 and "--device auto" in gpu.stderr
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("whom", ["group", "driver", "hangup"])
def test_a_stopped_table_run_waits_for_its_cell_to_checkpoint(tmp_path, whom):
    """Ctrl-C at a terminal signals the driver and its cell together ("group"); a scheduler may signal
    the driver alone ("driver"). Either way the cell finishes its round and checkpoints, and the same
    command goes on from there (an outside trial lost a cell's 145 rounds: the driver died first,
    killing the cell before its checkpoint)."""
    import os
    import signal
    import time

    out = tmp_path / "chfl"
    cmd = [sys.executable, str(ROOT / "bench" / "paper.py"), "chfl", "--out", str(out), "--cells", "chfl-iid-s0",
           "--set", "rounds=100000", "--set", "simulation.checkpoint_every=1000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, start_new_session=True)
    metrics = out / "chfl-iid-s0" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.5)
    assert proc.poll() is None, proc.stdout.read()[-3000:]
    if whom == "group":
        os.killpg(proc.pid, signal.SIGINT)
    elif whom == "hangup":  # the terminal closed: the cell stops cleanly too, rather than run on unseen
        proc.send_signal(signal.SIGHUP)
    else:
        proc.send_signal(signal.SIGINT)
    printed, _ = proc.communicate(timeout=240)
    assert proc.returncode == 130, printed[-3000:]
    assert "stopped during chfl-iid-s0: the same command resumes it from its checkpoint" in printed
    run = out / "chfl-iid-s0"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted"] and summary["rounds_played"] >= 2
    assert (run / "server-state.safetensors").is_file()  # checkpointed at the stop, though the interval is 1000 rounds
    assert "Traceback" not in printed
    assert f"stopped at {summary['rounds_played']}/100000" in printed and "1 stopped part-way" in printed
    assert json.loads((out / "table.json").read_text())["partial"] == [
        {"cell": "chfl-iid-s0", "rounds_played": summary["rounds_played"], "rounds": 100000}]


def test_a_table_is_filled_from_an_earlier_sittings_table_json_each_cell_checked(tmp_path):
    """A session whose run directories are gone (or a GPU's sitting) keeps only its table.json:
    --merge counts its finished cells and does not run them again; a file of another config, or one
    whose cells were tampered with, is refused before anything runs."""
    script, smoke = str(ROOT / "bench" / "paper.py"), ["--set", "rounds=3"]
    first, second = tmp_path / "first", tmp_path / "second"
    ran = subprocess.run([sys.executable, script, "chfl", "--out", str(first), "--cells", "chfl-iid-s0", *smoke],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert ran.returncode == 0, ran.stderr[-3000:]
    earlier = json.loads((first / "table.json").read_text())
    assert earlier["cells"][0]["config"]["rounds"] == 3  # each cell keeps the config it ran with
    merge = ["--merge", str(first / "table.json")]
    both = subprocess.run([sys.executable, script, "chfl", "--out", str(second), "--cells", "chfl-iid-s0,solo-iid-s0",
                           *smoke, *merge], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert both.returncode == 0, both.stderr[-3000:]
    assert "chfl-iid-s0: finished in another sitting" in both.stdout and "solo-iid-s0: starting" in both.stdout
    assert not (second / "chfl-iid-s0").exists()  # not run again
    table = json.loads((second / "table.json").read_text())
    row = {(ln["row"], ln["column"]): ln for ln in table["rows"]}
    assert row[("CHFL", "iid")]["ours"] == [100 * earlier["cells"][0]["accuracy"]["CHFL"]]
    assert row[("SOLO", "iid")]["state"] == "done" and table["merged_from"] == [str(first / "table.json")]
    assert f"1 cell(s) from earlier sittings: 1 from {first / 'table.json'} (commit(s) " in both.stdout
    # cells still to run: the report says what a cell costs where measured (hours at some tables' scales)
    assert "not finished:" in both.stdout and "; where measured: " in both.stdout

    paper = _paper()  # the refusals in this process: each a command's seconds of start-up otherwise

    def refused(payload: dict, overrides: tuple[str, ...] = ("rounds=3",)) -> str:
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(payload))
        table = paper.TABLES["chfl"]
        with pytest.raises(paper.MergeRefused) as exc:
            paper.load_merged([bad], "chfl", table, "cpu", table.cells("cpu", 0), "auto", list(overrides))
        return exc.value.message

    assert "rounds: 3 there, 60 asked" in refused(earlier, ())  # a smoke run's cells are not the table's
    bare = [{k: v for k, v in c.items() if k != "config"} for c in earlier["cells"]]  # (a file from before cells kept one)
    assert "this command's with --set [], and cell chfl-iid-s0 recorded no config" in refused({**earlier, "cells": bare}, ())
    assert "holds the fedhe table" in refused({**earlier, "table": "fedhe"})
    cell = earlier["cells"][0]
    assert "not a fraction in [0, 1]" in refused({**earlier, "cells": [{**cell, "accuracy": {"CHFL": 2.5}}]})
    assert "a row 'Oracle' the table does not have" in refused({**earlier, "cells": [{**cell, "accuracy": {"CHFL": 0.9, "Oracle": 0.9}}]})
    assert "'chfl-iid-s0; rm'" in refused({**earlier, "cells": [{**cell, "cell": "chfl-iid-s0; rm"}]})
    changed = {**cell, "config": {**cell["config"], "method": {**cell["config"]["method"], "name": "fedavg"}}}
    assert "method.name: 'fedavg' there, 'chfl' asked" in refused({**earlier, "cells": [changed]})
    assert "is not a table.json" in refused(["not", "a", "table"])
    # an outside trial's: a null result counted a cell as finished that was never reported nor run
    assert "CHFL accuracy is null" in refused({**earlier, "cells": [{**cell, "accuracy": {"CHFL": None}}]})
    assert 'a string ("0.8"), not a number' in refused({**earlier, "cells": [{**cell, "accuracy": {"CHFL": "0.8"}}]})
    assert "(a percentage?)" in refused({**earlier, "cells": [{**cell, "accuracy": {"CHFL": 81.5}}]})
    assert "its final accuracy, the table its best one" in refused({**earlier, "cells": [{**cell, "metric": "final"}]})
    assert "config is a string" in refused({**earlier, "cells": [{**cell, "config": "hello"}]})
    assert "wall_time_s is -5" in refused({**earlier, "cells": [{**cell, "wall_time_s": -5}]})
    assert "cells[0] names no cell" in refused({**earlier, "cells": ["chfl-iid-s0"]})
    # a fourth look's: false and "0" were taken for seed 0 (or said as "seed 0" beside seed 0)
    assert "seed false, a boolean), the table has it as" in refused({**earlier, "cells": [{**cell, "seed": False}]})
    assert 'seed "0", a string), the table has it as' in refused({**earlier, "cells": [{**cell, "seed": "0"}]})
    groups = cell["config"]["fleet"]["groups"]  # a group's field differing is named, not shown as two whole lists
    regrouped = {**cell, "config": {**cell["config"], "fleet": {**cell["config"]["fleet"],
                                                               "groups": [{**groups[0], "count": groups[0]["count"] + 1}, *groups[1:]]}}}
    assert f"fleet.groups.0.count: {groups[0]['count'] + 1} there, {groups[0]['count']} asked" in refused({**earlier, "cells": [regrouped]})
    # a third trial's: tracebacks on deep nesting and 4000-digit numbers, a FIFO read without end
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(paper.MergeRefused, match="nested too deeply"):
        paper._read_table_json(tmp_path / "deep.json")
    assert "not a fraction in [0, 1]" in refused({**earlier, "cells": [{**cell, "accuracy": {"CHFL": 10**4000}}]})
    deep: dict = {}  # an outside trial's: 700 levels pass the JSON reader and stopped the config comparison's recursion
    for _ in range(700):
        deep = {"x": deep}
    assert "config nests deeper than 16 levels" in refused({**earlier, "cells": [{**cell, "config": {"train": deep}}]})
    assert "overrides are a table, not the list of --set strings" in refused({**earlier, "overrides": {"a": 1}})
    assert "a list, where a table.json is a table" in refused(["not", "a", "table"])
    assert "wall_time_s is" in refused({**earlier, "cells": [{**cell, "wall_time_s": 10**4000}]})
    import os
    os.mkfifo(tmp_path / "fifo.json")
    with pytest.raises(paper.MergeRefused, match="not a regular file"):
        paper._read_table_json(tmp_path / "fifo.json")
    # a second trial's: a result for another row only (the cell counted as finished again), or beside its own
    assert "has no CHFL accuracy (its own row)" in refused({**earlier, "cells": [{**cell, "accuracy": {"SOLO": 0.8}}]})
    assert "a row 'SOLO' another cell fills" in refused({**earlier, "cells": [{**cell, "accuracy": {"CHFL": 0.8, "SOLO": 0.1}}]})
    (tmp_path / "bad.json").write_text(json.dumps({**earlier, "cells": [cell, {**cell, "accuracy": {"CHFL": 0.5}}]}))
    two = subprocess.run([sys.executable, script, "chfl", "--out", str(tmp_path / "third"), "--report-only", *smoke,
                          "--merge", str(tmp_path / "bad.json")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert two.returncode == 2 and "chfl-iid-s0 has two results" in two.stderr
    assert two.stderr.count("hint:") == 1  # (the hint was printed twice)
    (tmp_path / "bad.json").write_text("{not json")
    garbled = subprocess.run([sys.executable, script, "chfl", "--out", str(tmp_path / "third"), "--report-only", *smoke,
                              "--merge", str(tmp_path / "bad.json")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert garbled.returncode == 2 and "cannot be read as a table.json" in garbled.stderr
    # a table.json written before cells recorded their config is taken, with its commit named
    untold = {**earlier, "cells": [{k: v for k, v in cell.items() if k != "config"}]}
    (tmp_path / "old.json").write_text(json.dumps(untold))
    old = subprocess.run([sys.executable, script, "chfl", "--out", str(tmp_path / "third"), "--report-only", *smoke,
                          "--merge", str(tmp_path / "old.json")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert old.returncode == 0 and "recorded no config" in old.stdout and cell["commit"] in old.stdout, old.stderr[-2000:]
    # --report-only --merge into a folder that does not exist yet (the run directories are gone)
    fresh = tmp_path / "fresh"
    made = subprocess.run([sys.executable, script, "chfl", "--out", str(fresh), "--report-only", *smoke, *merge],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert made.returncode == 0 and json.loads((fresh / "table.json").read_text())["merged_from"] == [str(first / "table.json")]
    # a later report of that folder without --merge keeps the merged cell (it dropped it before)
    later = subprocess.run([sys.executable, script, "chfl", "--out", str(fresh), "--report-only", *smoke],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    kept = json.loads((fresh / "table.json").read_text())
    assert later.returncode == 0 and [c["cell"] for c in kept["cells"]] == ["chfl-iid-s0"], later.stdout[-2000:]
    assert kept["cells"][0]["from"] == str(first / "table.json")
    # a carried cell that no longer fits the command (the table's setting changed since) is said, not an error
    kept["cells"][0]["config"]["method"]["name"] = "fedavg"
    (fresh / "table.json").write_text(json.dumps(kept))
    moved = subprocess.run([sys.executable, script, "chfl", "--out", str(fresh), "--report-only", *smoke],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert moved.returncode == 0 and 'is not shown and stays in --out\'s "held" list' in moved.stdout, moved.stdout[-2000:]
    assert "method.name: 'fedavg' there" in moved.stdout
    # ... and stays in the folder's table.json, held (it was dropped from it: recorded nowhere else)
    assert [c["cell"] for c in json.loads((fresh / "table.json").read_text())["held"]] == ["chfl-iid-s0"]
    # an outside trial's: a merged cell of a seed a later report does not ask for was dropped from table.json
    seven = {**cell, "cell": "chfl-iid-s7", "seed": 7, "config": {**cell["config"], "seed": 7}}
    (tmp_path / "seven.json").write_text(json.dumps({**earlier, "cells": [seven]}))
    sevens = tmp_path / "sevens"

    def report_of(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, script, "chfl", "--out", str(sevens), "--report-only", *smoke, *extra],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)

    assert report_of("--seeds", "0,7", "--merge", str(tmp_path / "seven.json")).returncode == 0
    without = report_of()
    assert without.returncode == 0 and '(seed 7), kept in --out\'s "held" list (--seeds takes them in: --seeds 0,7)' in without.stdout, without.stdout[-2000:]
    assert [c["cell"] for c in json.loads((sevens / "table.json").read_text())["held"]] == ["chfl-iid-s7"]
    back = report_of("--seeds", "0,7")
    shown = json.loads((sevens / "table.json").read_text())
    assert back.returncode == 0 and [c["cell"] for c in shown["cells"]] == ["chfl-iid-s7"] and shown["held"] == [], back.stdout[-2000:]
    # a second trial's: a report with another --set held the cells, and the next plain report said they ran with it
    other_set = subprocess.run([sys.executable, script, "chfl", "--out", str(sevens), "--report-only", "--seeds", "0,7"],
                               capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert other_set.returncode == 0 and "rounds: 3 there, 60 asked" in other_set.stdout, other_set.stdout[-2000:]
    again = report_of("--seeds", "0,7")
    assert again.returncode == 0 and [c["cell"] for c in json.loads((sevens / "table.json").read_text())["cells"]] == ["chfl-iid-s7"]
    # ... and a copied table.json's held cells are read with --merge, as its cells are (they were ignored)
    report_of()  # (seed 0 only: chfl-iid-s7 held again)
    copied = tmp_path / "copied"
    taken = subprocess.run([sys.executable, script, "chfl", "--out", str(copied), "--report-only", *smoke, "--seeds", "0,7",
                            "--merge", str(sevens / "table.json")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert taken.returncode == 0 and [c["cell"] for c in json.loads((copied / "table.json").read_text())["cells"]] == ["chfl-iid-s7"]
    elsewhere = tmp_path / "elsewhere"  # a seed not asked for, of a --merge file: held too, naming the file it came from
    assert subprocess.run([sys.executable, script, "chfl", "--out", str(elsewhere), "--report-only", *smoke, "--merge",
                           str(copied / "table.json")], capture_output=True, text=True, timeout=120, cwd=ROOT).returncode == 0
    assert [c["from"] for c in json.loads((elsewhere / "table.json").read_text())["held"]] == [str(copied / "table.json")]
    # the folder's own table.json damaged: refused, not written anew without its merged cells
    made = subprocess.run([sys.executable, script, "chfl", "--out", str(fresh), "--report-only", *smoke, *merge],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert made.returncode == 0, made.stderr[-2000:]
    damaged = (fresh / "table.json").read_bytes().replace(b'"cells"', b'"c\xffells"', 1)
    (fresh / "table.json").write_bytes(damaged)
    lost = subprocess.run([sys.executable, script, "chfl", "--out", str(fresh), "--report-only", *smoke],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert lost.returncode == 2 and "this folder's own" in lost.stderr and (fresh / "table.json").read_bytes() == damaged, lost.stderr
    assert "error: --out: this folder's own" in lost.stderr  # (no --merge was given: it said "--merge:")
    # a later --merge with another result for a cell the folder holds: refused, as two files are
    (fresh / "table.json").write_text(json.dumps(earlier | {"cells": [{**cell, "from": "x.json"}]}))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**earlier, "cells": [{**cell, "accuracy": {"CHFL": 0.123}}]}))
    replaced = subprocess.run([sys.executable, script, "chfl", "--out", str(fresh), "--report-only", *smoke, "--merge", str(other)],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert replaced.returncode == 2 and "chfl-iid-s0 has two results" in replaced.stderr, replaced.stdout[-2000:]
    # two results within --out's own table.json, no --merge given: said as --out's, naming that file alone
    (fresh / "table.json").write_text(json.dumps(earlier | {"cells": [{**cell, "from": "x.json"},
                                                                       {**cell, "from": "y.json", "accuracy": {"CHFL": 0.1}}]}))
    twice = subprocess.run([sys.executable, script, "chfl", "--out", str(fresh), "--report-only", *smoke],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert twice.returncode == 2 and f"error: --out: chfl-iid-s0 has two results, twice in {fresh / 'table.json'}" in twice.stderr
    # --out naming a file
    named = subprocess.run([sys.executable, script, "chfl", "--out", str(other), "--report-only", *smoke],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert named.returncode == 2 and "is a file" in named.stderr and "Traceback" not in named.stderr
    # options that need a table, without one, are a usage error (they were ignored)
    bare = subprocess.run([sys.executable, script, "--report-only", *merge], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bare.returncode == 2 and "--merge, --report-only need a TABLE" in bare.stderr


def test_fedmho_cells_of_one_alpha_and_seed_train_their_clients_once(tmp_path):
    """The first FedMHO/-MD/-SD cell to run keeps its clients, the others fuse them (simulation.clients_from),
    a resumed cell goes on as it started, and neither key makes a cell another config than the table's."""
    paper = _paper()
    cells = {c.key: c for c in paper.TABLES["fedmho"].cells("cpu", 0)}
    md, sd, cvae = cells["fedmho-md-a0.5-s0"], cells["fedmho-sd-a0.5-s0"], cells["fedcvae-a0.5-s0"]
    siblings = [k for k, c in cells.items() if c.clients_group == md.clients_group]
    assert siblings == ["fedmho-a0.5-s0", "fedmho-md-a0.5-s0", "fedmho-sd-a0.5-s0"] and cvae.clients_group is None
    asked = paper._asked(md, "auto", [])
    first = paper._with_clients(md, asked, tmp_path, None, siblings)
    assert first["simulation"] == {"keep_clients": True}  # nobody kept them yet: this cell trains and keeps
    source = tmp_path / "fedmho-a0.5-s0"
    (source / "clients").mkdir(parents=True)
    (source / "clients" / "clients.json").write_text("{}")
    (source / "summary.json").write_text(json.dumps({"rounds_played": 1, "rounds": 1}))
    then = paper._with_clients(sd, paper._asked(sd, "auto", []), tmp_path, None, siblings)
    assert then["simulation"] == {"clients_from": str(source.resolve())}
    # a cell stopped while it trained its own clients resumes so, though a sibling has kept some since
    started = tmp_path / "fedmho-md-a0.5-s0"
    started.mkdir()
    (started / "config.toml").write_text(__import__("tomli_w").dumps(validate_config(first, "md").to_dict()))
    assert paper._with_clients(md, asked, tmp_path, started, siblings)["simulation"]["keep_clients"] is True
    had = validate_config(then, "sd").to_dict()
    assert paper.differs_from_asked(had, sd, "auto", []) is None


def test_a_merged_cell_keeps_the_run_whose_clients_it_fused():
    """clients_from goes on through a merge (it was dropped, so every later sitting's table lost
    it); a cell merged before that has it back from its config's path; a malformed one is refused."""
    paper = _paper()
    cell = {c.key: c for c in paper.TABLES["fedmho"].cells("cpu", 0)}["fedmho-md-a0.5-s0"]
    raw = {"cell": cell.key, "row": cell.row, "column": cell.column, "seed": 0, "metric": "final",
           "accuracy": {cell.row: 0.7}, "commit": "abc"}
    told = paper._merged_entry({**raw, "clients_from": {"run": "fedmho-a0.5-s0", "commit": "abc"}}, cell, set(), "x.json")
    assert told["clients_from"] == {"run": "fedmho-a0.5-s0", "commit": "abc"}
    config = {"simulation": {"clients_from": "/tmp/w05/bench/results/paper/fedmho-cpu/fedmho-a0.5-s0"}}
    assert paper._merged_entry({**raw, "config": config}, cell, set(), "x.json")["clients_from"] == {
        "run": "fedmho-a0.5-s0", "commit": None}
    assert "clients_from" not in paper._merged_entry(raw, cell, set(), "x.json")  # a cell that trained its own
    for bad in ("fedmho-a0.5-s0", {"run": 3}, {"run": "r", "commit": 5}):
        with pytest.raises(paper.MergeRefused, match="clients_from is not"):
            paper._merged_entry({**raw, "clients_from": bad}, cell, set(), "x.json")
    # a run that did not train this cell's clients (another alpha, or no cell at all) is refused, not recorded
    cells = paper.TABLES["fedmho"].cells("cpu", 0)
    by_key, prefixes = {c.key: c for c in cells}, {c.key.rsplit("-s", 1)[0] for c in cells}
    rows = {c.row for c in cells} | {"FedAvg"}

    def merged(run: str) -> dict:
        entry = {**raw, "clients_from": {"run": run, "commit": None}}
        return paper._merged_cell(entry, "cells[0]", Path("x.json"), "fedmho", by_key, prefixes, rows, "auto", [], False, [])

    assert merged("fedmho-a0.5-s0")["clients_from"]["run"] == "fedmho-a0.5-s0"
    for wrong in ("fedmho-a0.1-s0", "nosuch-cell", "fedcvae-a0.5-s0"):
        with pytest.raises(paper.MergeRefused, match="not a cell that trains this cell's clients"):
            merged(wrong)


def test_a_report_says_its_scales_setting_and_a_merge_hint_names_the_files_seeds(tmp_path, capsys):
    """The header says the setting this scale ran beside the paper's title (which names the paper's
    length); the hint to report another scale's file names its seeds, and nothing for a hostile list."""
    paper = _paper()
    table = paper.TABLES["fedmho"]
    paper.report("fedmho", table, table.cells("cpu", 0), tmp_path, "cpu", "auto", [], seeds=[0], report_only=True, merged={})
    assert "scale cpu: 1 round (one-shot), 10 devices, width 0.5, local epochs vgg9 10, cvae-small 40; no cell done yet" \
        in capsys.readouterr().out
    assert paper._seeds_flag([0, 1, 2]) == " --seeds 0,1,2" and paper._seeds_flag([0]) == ""  # seed 0 is the default
    for hostile in ("0,1", [True], [-1], [0.5], list(range(65)), None):
        assert paper._seeds_flag(hostile) == ""


def test_the_fedavg_row_a_fedmho_cell_fills_counts_the_seeds_asked_of_it(tmp_path):
    """Table IV's FedAvg row comes from the FedMHO cells (the classifiers they fuse from): it is asked
    for as often as they are, so a row of two seeds with one done says so."""
    paper = _paper()
    table = paper.TABLES["fedmho"]
    cells = [c for seed in (0, 1) for c in table.cells("cpu", seed)]
    merged = {"fedmho-a0.5-s0": {"cell": "fedmho-a0.5-s0", "row": "FedMHO", "column": "Dir 0.5", "seed": 0, "metric": "final",
                                 "accuracy": {"FedMHO": 0.74, "FedAvg": 0.17}, "from": "earlier.json", "commit": "abc"}}
    payload = paper.report("fedmho", table, cells, tmp_path, "cpu", "auto", [], seeds=[0, 1], report_only=True, merged=merged)
    rows = {(ln["row"], ln["column"]): ln for ln in payload["rows"]}
    assert (rows["FedAvg", "Dir 0.5"]["seeds_done"], rows["FedAvg", "Dir 0.5"]["seeds_asked"]) == (1, 2)
    assert (rows["FedMHO", "Dir 0.5"]["seeds_done"], rows["FedMHO", "Dir 0.5"]["seeds_asked"]) == (1, 2)


def test_the_plot_marks_a_mean_over_fewer_seeds_than_asked_and_a_cell_not_run(tmp_path, monkeypatch):
    """The bars say what the text says: "1 of 2 seeds" on a mean of one seed where two were asked,
    "not run" where no seed is done, and nothing on a bar all its seeds filled."""
    paper = _paper()
    table = paper.TABLES["chfl"]
    cells = [c for seed in (0, 1) for c in table.cells("cpu", seed)]
    done = [c for c in cells if c.seed == 0][:2] + [c for c in cells if c.seed == 1][:1]
    merged = {c.key: {"cell": c.key, "row": c.row, "column": c.column, "seed": c.seed, "metric": "final",
                      "accuracy": {c.row: 0.9}, "from": "earlier.json", "commit": "abc"} for c in done}
    figures = []
    monkeypatch.setattr(paper, "save_figure", lambda fig, path: figures.append(fig) or path)
    payload = paper.report("chfl", table, cells, tmp_path, "cpu", "auto", [], seeds=[0, 1], report_only=True, merged=merged)
    marks = [t.get_text() for ax in figures[0].axes for t in ax.texts]
    lines = {(ln["row"], ln["column"]): ln for ln in payload["rows"]}
    both, one = (done[0].row, done[0].column), (done[1].row, done[1].column)
    assert (lines[both]["seeds_done"], lines[one]["seeds_done"]) == (2, 1), lines
    assert marks.count("1 of 2 seeds") == 1 and marks.count("not run") == len(lines) - 2, marks
    legend = [t.get_text() for t in figures[0].axes[0].get_legend().get_texts()]
    assert legend[0] == "edgefl, --scale cpu, mean +- sd over seeds 0,1", legend
    figures.clear()  # Felo/Velo's paper gives no FedAvg-groups number: its slot says so, not an empty bar
    (tmp_path / "fv").mkdir()
    paper.report("felo-velo", paper.TABLES["felo-velo"], paper.TABLES["felo-velo"].cells("cpu", 0), tmp_path / "fv", "cpu",
                 "auto", [], seeds=[0], report_only=True, merged={})
    assert [t.get_text() for ax in figures[0].axes for t in ax.texts].count("not in paper") == 2  # one row, two columns


def test_a_report_piped_into_head_still_writes_its_files_and_says_which_seeds_it_left_out(tmp_path):
    # an outside trial's: `--report-only ... | head` was killed by SIGPIPE before table.json and
    # table.png were written, and "seeds not asked for" did not say which
    script, kept = str(ROOT / "bench" / "paper.py"), str(ROOT / "docs" / "data" / "paper" / "chfl-cpu.json")
    out = tmp_path / "report"
    piped = subprocess.run(f"{sys.executable} {script} chfl --report-only --merge {kept} --out {out} | head -c 1",
                           shell=True, capture_output=True, text=True, timeout=120, executable="/bin/bash")
    assert piped.returncode == 0, piped.stderr[-2000:]
    assert (out / "table.json").is_file() and (out / "table.png").is_file() and "Traceback" not in piped.stderr
    told = subprocess.run([sys.executable, script, "chfl", "--report-only", "--merge", kept, "--out", str(tmp_path / "again")],
                          capture_output=True, text=True, timeout=120)
    assert told.returncode == 0, told.stderr[-2000:]
    assert "(seeds 1,2,3,4)" in told.stdout and "--seeds 0,1,2,3,4" in told.stdout
    assert "seed 0 alone" in told.stdout and "mean +- sd" not in told.stdout  # one seed is no spread
    # a report names the devices its cells ran on, not the --device flag (which a report does not use)
    on_cuda = subprocess.run([sys.executable, script, "chfl", "--report-only", "--device", "cuda", "--merge", kept,
                              "--out", str(tmp_path / "cuda")], capture_output=True, text=True, timeout=120)
    assert on_cuda.returncode == 0 and "cells ran on cpu;" in on_cuda.stdout and "device cuda" not in on_cuda.stdout
    (tmp_path / "a-file").write_text("")
    for out_arg in (tmp_path / "a-file" / "sub", Path("/proc/edgefl-not-here")):
        bad = subprocess.run([sys.executable, script, "chfl", "--report-only", "--merge", kept, "--out", str(out_arg)],
                             capture_output=True, text=True, timeout=120)
        assert bad.returncode == 2 and f"--out {out_arg} cannot be made or written" in bad.stderr, bad.stderr[-2000:]
    empty = tmp_path / "empty.json"
    empty.write_text("\n")
    bad = subprocess.run([sys.executable, script, "chfl", "--report-only", "--merge", str(empty), "--out", str(tmp_path / "e")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and f"{empty} is empty: not a table.json" in bad.stderr
    scale = subprocess.run([sys.executable, script, "chfl", "--scale", "paper", "--report-only", "--merge", kept,
                            "--out", str(tmp_path / "p")], capture_output=True, text=True, timeout=120)
    assert scale.returncode == 2 and "bench paper chfl --scale cpu --seeds 0,1,2,3,4 --report-only --merge" in scale.stderr


def test_a_table_run_piped_into_head_still_finishes_its_cells(tmp_path):
    # left open by the report's fix above: in `bench paper ... 2>&1 | head` the cells wrote their progress to the pipe after its
    # reader had gone (here grep -m1 leaves after the first round) and died of it, their summary unwritten;
    # they now write through the driver, which drops output once its reader is gone
    out = tmp_path / "chfl"
    script = str(ROOT / "bench" / "paper.py")
    piped = subprocess.run(f"{sys.executable} {script} chfl --out {out} --cells chfl-iid-s0 --set rounds=3 2>&1 "
                           "| grep -m1 -q 'round   1/3'", shell=True, capture_output=True, text=True, timeout=600,
                           executable="/bin/bash", cwd=ROOT)
    assert piped.returncode == 0 and "Traceback" not in piped.stderr, piped.stderr[-3000:]
    table = json.loads((out / "table.json").read_text())
    assert [c["cell"] for c in table["cells"]] == ["chfl-iid-s0"]
    # to a file, the cell's progress is there in order with the driver's own lines
    logged = tmp_path / "log.txt"
    with logged.open("w") as log:
        again = subprocess.run([sys.executable, script, "chfl", "--out", str(tmp_path / "two"), "--cells", "solo-iid-s0",
                                "--set", "rounds=2"], stdout=log, stderr=subprocess.PIPE, text=True, timeout=600, cwd=ROOT)
    assert again.returncode == 0, again.stderr[-3000:]
    text = logged.read_text()
    assert text.index("solo-iid-s0: starting") < text.index("run directory:") < text.index("CHFL (paper")
