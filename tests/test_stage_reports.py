"""What a run with stages shows outside the dashboard: the fleet console's lines (a stage under
way, a stage that failed the round, a closed round secured, with its drop-outs and failure), the
simulation's round lines, `edgefl report`'s rounds table and its drop-outs plot, and the exit
message of a run whose rounds a stage failed, from a real secured simulation in which devices
drop out and stages fail rounds (tests/test_dashboard.py secured_run_with_dropouts). Ids and
reasons come from devices: printed escaped."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from edgefl.report import draw_plots, rounds_table, stage_notes
from edgefl.rundir import RunDir
from tests.test_dashboard import finished_run, secured_run_with_dropouts


def _console() -> tuple[Console, io.StringIO]:
    buffer = io.StringIO()
    return Console(file=buffer, width=2000, color_system=None), buffer


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """The run, its events, and what the simulation printed while it ran."""
    console, buffer = _console()
    run, seen = secured_run_with_dropouts(tmp_path_factory.mktemp("secured") / "run", console=console)
    return run, seen, buffer.getvalue()


def _records(run: RunDir) -> dict[int, dict]:
    return {m["round"]: m for m in run.metrics()}


def test_the_simulation_s_round_lines_say_secured_who_dropped_out_and_why_a_round_failed(secured):
    _, _, printed = secured
    lines = {int(line.split()[1].split("/")[0]): line for line in printed.splitlines() if line.startswith("round ")}
    assert lines[1].endswith("  secured")
    assert "  [deadline]  secured  dropped in secagg-unmask: client-7  shared keys, no masked upload: client-1" in lines[2]
    # a failed round released no sum: not "secured", whatever its key exchange did (an outside trial read it so)
    assert "[failed]  dropped in secagg-unmask: client-1, client-2, client-3 and 6 more  why: secagg: the self mask" in lines[3]
    assert "[failed]  dropped in secagg-keys: client-1, client-2, client-3 and 5 more  why: secagg: group" in lines[4]
    assert "one device with keys" in lines[4]


def test_the_fleet_console_prints_stages_and_the_closed_round_s_drop_outs_and_failure(secured):
    from edgefl.cli import _fleet_printer

    _, seen, _ = secured
    console, buffer = _console()
    printer = _fleet_printer(console, 4, None, 10)
    for kind, info, _ in seen:
        printer(kind, info)
    text = buffer.getvalue()
    assert "  round 1 stage secagg-keys: 10 devices asked" in text and "  round 2 stage secagg-unmask: 9 devices asked" in text
    assert "  round 3 failed in stage secagg-unmask" in text and "  round 4 failed in stage secagg-keys" in text
    closed = [line for line in text.splitlines() if line.startswith("round ") and " reported" in line]
    assert [line.split(":")[0] for line in closed] == ["round 1 complete", "round 2 deadline", "round 3 failed", "round 4 failed"]
    assert closed[0].endswith(", secured")
    assert ", secured, dropped in secagg-unmask: client-7, shared keys, no masked upload: client-1" in closed[1]
    assert "dropped in secagg-unmask: client-1, client-2" in closed[2] and ", why: secagg: the self mask of client-0 needs 2 shares" in closed[2]
    assert closed[3].startswith("round 4 failed: 0/10 reported") and ", why: secagg: group mlp(hidden=[32, 16]) has one device with keys" in closed[3]


@pytest.mark.parametrize("hostile", ["[/]", "[bold]x", "client-1\nround 9 complete: FAKE", "\x1b[2J"])
def test_hostile_ids_and_reasons_in_stage_lines_are_escaped(secured, hostile):
    from edgefl.cli import _fleet_printer
    from edgefl.sim.engine import round_line

    run, _, _ = secured
    record = json.loads(json.dumps(_records(run)[3]))
    record["stages"]["secagg-unmask"]["dropped"] = [hostile]
    record["failure"] = f"secagg: {hostile} broke it"
    next(iter(record["filters"]["secagg"]["groups"].values()))["dropped_after_sharing"] = [hostile]
    console, buffer = _console()
    printer = _fleet_printer(console, 4, None, 10)
    printer("stage_failed", {"round": 3, "stage": "secagg-unmask", "reason": record["failure"]})
    printer("closed", record)
    line = round_line(record, 4)
    for text in (buffer.getvalue(), line):
        assert "\x1b" not in text and not [row for row in text.splitlines() if row.startswith("round 9")]
    assert len(buffer.getvalue().splitlines()) == 2 and "\n" not in line  # no fake line of its own
    if hostile in ("[/]", "[bold]x"):
        assert hostile in buffer.getvalue() and hostile in line  # shown as it is, not taken as markup
    assert stage_notes(record, show=1)[0] == f"dropped in secagg-unmask: {hostile}"  # raw notes (callers escape); a failed round is not "secured"


def test_the_report_s_rounds_table_and_plot(secured, tmp_path):
    run, _, _ = secured
    console, buffer = _console()
    console.print(rounds_table(run))
    text = buffer.getvalue()
    assert "rounds - 2 of 4 secured" in text  # rounds 3 and 4 failed: no sum released
    rows = {int(line.split("│")[1]): line for line in text.splitlines() if line.startswith("│") and line.split("│")[1].strip().isdigit()}
    assert [rows[r].split("│")[4].strip() for r in (1, 2, 3, 4)] == ["yes", "yes", "no", "no"]
    assert "complete" in rows[1] and rows[1].split("│")[5].strip() == ""
    assert "secagg-unmask: 1 (client-7)" in rows[2] and "deadline" in rows[2]
    assert "shared keys, no masked upload: 1 (client-1)" in text
    assert "secagg-unmask: 9 (client-1, client-2, client-3 and 6 more)" in rows[3] and "the self mask of client-0 needs 2 shares" in rows[3]
    assert "secagg-keys: 8 (client-1, client-2, client-3 and 5 more)" in rows[4] and "0/10" in rows[4]
    written = [p.name for p in draw_plots(run)]
    assert "stages.png" in written and (run.path / "plots" / "stages.png").stat().st_size > 10_000

    plain = finished_run(tmp_path)  # a run without stages: no table, no plot (and a re-draw removes an old one)
    (plain.path / "plots").mkdir(exist_ok=True)
    (plain.path / "plots" / "stages.png").write_bytes(b"old")
    assert rounds_table(plain) is None
    assert "stages.png" not in [p.name for p in draw_plots(plain)] and not (plain.path / "plots" / "stages.png").exists()


def test_a_long_run_s_table_lists_the_rounds_with_drop_outs_and_a_reason_with_markup_is_text(secured, tmp_path):
    import shutil

    from edgefl.report import ROUNDS_TABLE_MAX

    run, _, _ = secured
    folder = tmp_path / "long"
    shutil.copytree(run.path, folder)
    records = _records(run)
    quiet = json.dumps({**records[1], "round": 0})
    lines = [json.dumps({**json.loads(quiet), "round": r}) for r in range(1, ROUNDS_TABLE_MAX + 1)]
    failed = {**records[3], "round": ROUNDS_TABLE_MAX + 1, "failure": "secagg: [bold]client-x[/] said no \x1b[2J"}
    (folder / "metrics.jsonl").write_text("\n".join(lines + [json.dumps(failed)]) + "\n")
    console, buffer = _console()
    console.print(rounds_table(RunDir(folder)))
    text = buffer.getvalue()
    assert f"rounds - {ROUNDS_TABLE_MAX} of {ROUNDS_TABLE_MAX + 1} secured; the 1 with drop-outs or failures" in text
    assert "[bold]client-x[/] said no \\x1b[2J" in text and "\x1b" not in text


def test_a_run_whose_rounds_a_stage_failed_exits_naming_why(secured, monkeypatch):
    import typer

    from edgefl import cli

    run, _, _ = secured
    console, buffer = _console()
    monkeypatch.setattr(cli, "err", console)
    with pytest.raises(typer.Exit) as caught:
        cli._fail_on_failed_rounds({"failed_rounds": [3, 4], "rounds": 4}, run.path)
    assert caught.value.exit_code == cli.EXIT_ROUNDS_FAILED
    text = buffer.getvalue()
    assert "2 of 4 rounds failed" in text and "round 3: secagg: the self mask of client-0" in text
    assert "round 4: secagg: group mlp(hidden=[32, 16]) has one device with keys" in text and "no quorum" not in text


def test_edgefl_report_prints_the_rounds_table_and_draws_the_drop_outs(secured):
    from tests.test_cli import edgefl

    run, _, _ = secured
    res = edgefl("report", str(run.path))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "rounds - 2 of 4 secured" in res.stdout and "secagg-unmask: 1 (client-7)" in res.stdout
    assert f"wrote {run.path / 'plots' / 'stages.png'}" in res.stdout


@pytest.mark.parametrize(("judged_on", "label"), [
    ("server test set", "test accuracy"),
    ("shared test set (each device's own model, judged on the device)", "test accuracy"),
    ("devices' own validation data", "validation accuracy (devices' own data)"),
    ("server test set and devices' own validation data", "validation accuracy (devices' own data) / test accuracy"),
    ("devices' own test split", "test accuracy (devices' own test splits)"),
    ("$\\frac{a}{b}$ from a file", "accuracy"),
    (None, "accuracy"),
])
def test_an_accuracy_plot_names_what_the_accuracy_was_measured_on(judged_on, label):
    from edgefl.report import accuracy_axis_label

    records = [{"accuracy": {"overall": 0.5, **({"judged_on": judged_on} if judged_on else {})}}, {"accuracy": None}]
    assert accuracy_axis_label(records) == label
