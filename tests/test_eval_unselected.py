"""Methods judged by their devices (FedHe, Local-only) in synchronous rounds with partial
participation: an evaluation round asks the devices that did not train in it for their model's
accuracy, so a record is the mean over every device, not over those that happened to train in an
evaluation round (with one device a round, four of ten in the FedHe table, each as it was then)."""

from __future__ import annotations

import pytest

from edgefl.config import RunConfig
from edgefl.rundir import RunDir
from edgefl.sim import Simulation
from tests.conftest import digits_config
from tests.test_every_method import _records, _summary
from tests.test_resume import stopped_and_resumed


def _one_device_a_round(method: str, unselected: str = "ask") -> RunConfig:
    raw = digits_config(method, rounds=4)
    raw["fleet"]["sample_ratio"] = 0.25  # one of four devices a round
    raw["eval"] = {"every": 2, "unselected": unselected}
    raw["threads"] = 1
    raw["network"] = {"federation": f"eval-unselected-{method}"}  # a fleet's summary names it
    return RunConfig.model_validate(raw)


@pytest.mark.parametrize("method", ["fedhe", "local"])
def test_every_device_is_judged_at_an_evaluation_round(method):
    asked = Simulation(_one_device_a_round(method), show_progress=False)
    asked.run()
    devices = sorted(asked.network.loops)
    for record in asked.history:
        if record["accuracy"]:
            assert sorted(record["accuracy"]["per_client"]) == devices
            assert len(record["selected"]) == 1
    # what an idle device said is the accuracy of the model it holds
    device = devices[0]
    assert asked.history[-1]["accuracy"]["per_client"][device] == pytest.approx(asked.network.loops[device]._accuracy())

    kept = Simulation(_one_device_a_round(method, "last_reported"), show_progress=False)
    kept.run()
    judged = [sorted(r["accuracy"]["per_client"]) for r in kept.history if r["accuracy"]]
    assert all(len(j) <= 2 for j in judged)  # only the devices that trained in an evaluation round


def test_a_fleet_asks_its_idle_devices_as_the_simulation_does(tmp_path):
    from edgefl.fleet.launcher import run_fleet

    cfg = _one_device_a_round("fedhe")
    Simulation(cfg, RunDir.create(tmp_path / "sim", cfg.name, cfg.seed), show_progress=False).run()
    fleet = run_fleet(cfg, None, RunDir.create(tmp_path / "fleet", cfg.name, cfg.seed), device_timeout_s=240)
    assert set(fleet["device_exit_codes"].values()) == {0}, fleet["logs"]
    assert _records(tmp_path / "fleet") == _records(tmp_path / "sim")
    assert _summary(tmp_path / "fleet") == _summary(tmp_path / "sim")
    assert len(_records(tmp_path / "sim")[-1]["accuracy"]["per_client"]) == 4


def test_over_selected_devices_still_training_are_not_asked_and_their_late_uploads_are_listed():
    """Three selected, the round closes at two: the third is late. Every other device is asked."""
    raw = digits_config("fedhe", rounds=4)
    raw["fleet"].update(per_round=1, over_select=1.0)  # two selected, the first accepted closes the round
    raw["eval"] = {"every": 2}
    raw["threads"] = 1
    sim = Simulation(RunConfig.model_validate(raw), show_progress=False)
    sim.run()
    devices = sorted(sim.network.loops)
    for record in sim.history:
        assert len(record["selected"]) == 2 and record["accepted"] == 1
        if record["accuracy"]:
            assert sorted(record["accuracy"]["per_client"]) == devices
    # every over-selected upload is listed late: in the next round's record, or in its own when it
    # arrived while its round was judged (the last round's did)
    assert sum(len(r["late"]) for r in sim.history) == 4
    assert sim.history[-1]["receipts"][next(d for d in sim.history[-1]["selected"] if d not in sim.history[-1]["reported"])].startswith("late")
    assert not sim.session.policy.working  # every download was answered


def test_a_resumed_run_asks_as_the_uninterrupted_one_did(tmp_path):
    cfg = _one_device_a_round("fedhe").model_copy(deep=True)
    cfg.rounds = 6
    cfg.simulation.checkpoint_every = 2
    whole, stopped = stopped_and_resumed(cfg, tmp_path)
    assert _records(stopped) == _records(whole)
    assert all(len(r["accuracy"]["per_client"]) == 4 for r in _records(whole) if r["accuracy"])


def test_a_straggler_still_training_is_not_asked():
    """On the virtual clock a Pi Zero misses the deadline and trains on into the next round: the
    evaluation ask leaves it out (a real device would answer only after its training, holding the
    ask to its deadline), and asks the idle devices."""
    raw = digits_config("fedhe", rounds=6)
    raw["fleet"] = {"sample_ratio": 0.5, "groups": [
        {"model": "mlp", "count": 2, "profile": "pi4-4gb", "options": {"hidden": [16]}},
        {"model": "mlp", "count": 2, "profile": "pi-zero-2w", "options": {"hidden": [16]}}]}
    raw["clock"] = {"deadline_s": 0.005}
    raw["network"] = {"quorum": 0.5}
    raw["threads"] = 1
    sim = Simulation(RunConfig.model_validate(raw), show_progress=False)
    policy = sim.session.policy
    asks: list[tuple[list[str], set[str]]] = []
    real = policy.ask_devices

    def watched(r, targets, with_model=True):
        asks.append((list(targets), set(policy.working)))
        return real(r, targets, with_model)

    policy.ask_devices = watched
    sim.run()
    assert any("straggler" in receipt for r in sim.history for receipt in r["receipts"].values())
    assert asks and all(not set(targets) & working for targets, working in asks)
    assert any(working for _, working in asks)  # some ask came while a straggler was still training


def test_the_accuracy_table_counts_the_devices_the_record_judged(tmp_path):
    from rich.console import Console

    from edgefl.report import accuracy_table

    cfg = _one_device_a_round("fedhe", "last_reported")
    run = RunDir.create(tmp_path / "run", cfg.name, cfg.seed)
    Simulation(cfg, run, show_progress=False).run()
    judged = len(run.metrics()[-1]["accuracy"]["per_client"])
    assert judged < 4
    console = Console(width=200, record=True)
    console.print(accuracy_table(run))
    overall = next(line for line in console.export_text().splitlines() if "overall" in line)
    assert [cell.strip() for cell in overall.split("│")][2] == str(judged)  # the clients column


def test_a_record_names_the_devices_whose_accuracy_is_from_an_earlier_round(tmp_path):
    """A device's latest report stands for it (a dead device's too): the record says whose is old,
    and the accuracy table says so under it. Devices asked at the evaluation round are current."""
    from rich.console import Console

    from edgefl.report import accuracy_table

    asked = Simulation(_one_device_a_round("fedhe"), show_progress=False)
    asked.run()
    assert all("reported_earlier" not in r["accuracy"] for r in asked.history if r["accuracy"])

    cfg = _one_device_a_round("fedhe", "last_reported")
    run = RunDir.create(tmp_path / "run", cfg.name, cfg.seed)
    Simulation(cfg, run, show_progress=False).run()
    final = [r for r in run.metrics() if r["accuracy"]][-1]
    earlier = final["accuracy"]["reported_earlier"]
    assert earlier and set(earlier) == set(final["accuracy"]["per_client"]) - set(final["reported"])
    assert all(1 <= r < final["round"] for r in earlier.values())
    console = Console(width=400, record=True)
    console.print(accuracy_table(run))
    assert f"{len(earlier)} of {len(final['accuracy']['per_client'])} devices' accuracies are from earlier rounds" in console.export_text()


def test_an_asynchronous_record_lists_only_devices_silent_through_its_window(tmp_path):
    """Each device of an asynchronous run reports at its own server update, so "a report older
    than the update judged" held for nearly every device and the list said nothing. A record lists
    the devices that reported nothing in its window of updates; those that did are current."""
    from rich.console import Console

    from edgefl.report import accuracy_table
    from tests.test_async import async_config

    cfg = async_config("fedhe", rounds=12, concurrency=3)
    run = RunDir.create(tmp_path / "run", cfg.name, cfg.seed)
    sim = Simulation(cfg, run, show_progress=False)
    sim.run()
    records = [r for r in sim.history if r["accuracy"]]
    assert records
    for record in records:
        listed = set(record["accuracy"].get("reported_earlier", {}))
        assert not listed & set(record["reports_per_client"]), record  # reported in the window: current
        assert all(at <= record["round"] - record["updates"] for at in record["accuracy"].get("reported_earlier", {}).values())
    console = Console(width=400, record=True)
    console.print(accuracy_table(run))
    if records[-1]["accuracy"].get("reported_earlier"):
        assert "the first of the last record's window" in console.export_text()
