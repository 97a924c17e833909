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
