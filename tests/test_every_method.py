"""Walks the method registry: every registered method runs in simulation and as a fleet over a
real mosquitto, and the two write the same metrics.jsonl and summary.json (timings, the runner's
name and the broker aside); every method's server state saves and restores."""

from __future__ import annotations

import json

import pytest
import torch

from edgefl.config import RunConfig
from edgefl.methods import METHODS
from edgefl.rundir import RunDir
from edgefl.server.session import TIMING_FIELDS
from tests.conftest import method_config

#: what a run's files may differ in between runners: when and where it ran, not its numbers (the
#: deadline is the transport's: clock.deadline_s in virtual seconds, network.round_deadline_s on MQTT)
RUN_FACTS = {"runner", "started", "wall_time_s", "run_dir", "broker", "deadline_s", "simulation"}  # how each runner ran


def _ship_choice(plan: dict) -> dict:
    """What a run ships, without where the weights lie and the run's random id (a simulation holds every device's model and
    writes it; in a fleet the chosen model stays on its device)."""
    return {**{k: v for k, v in plan.items() if k != "run_id"},
            "models": {a: {k: v for k, v in m.items() if k not in ("file", "where")} for a, m in plan["models"].items()},
            "phones": {p: {k: v for k, v in c.items() if k != "file"} for p, c in plan["phones"].items()}}


def _config(method: str, rounds: int = 1) -> RunConfig:
    raw = method_config(method, rounds=rounds)
    raw["threads"] = 1
    raw["network"] = {"federation": f"walk-{method}", "round_deadline_s": 120}
    return RunConfig.model_validate(raw)


def _untimed(node):
    """A record without its timings (the round's, and a server half's own: FedMHO's ``time_s``,
    Velo's CVAE ``seconds``)."""
    if isinstance(node, dict):
        return {k: _untimed(v) for k, v in node.items() if k not in (*TIMING_FIELDS, "time_s", "seconds")}
    return node


def _records(path) -> list[dict]:
    return [_untimed(json.loads(line)) for line in (path / "metrics.jsonl").read_text().splitlines()]


def _summary(path) -> dict:
    out = {k: v for k, v in json.loads((path / "summary.json").read_text()).items() if k not in RUN_FACTS}
    if "ship" in out:
        out["ship"] = _ship_choice(out["ship"])
    return out


@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_method_runs_the_same_in_simulation_and_as_a_fleet(method, tmp_path):
    from edgefl.fleet.launcher import run_fleet
    from edgefl.sim import Simulation

    cfg = _config(method)
    Simulation(cfg, RunDir.create(tmp_path / "sim", cfg.name, cfg.seed), show_progress=False).run()
    fleet = run_fleet(cfg, None, RunDir.create(tmp_path / "fleet", cfg.name, cfg.seed), device_timeout_s=240)
    assert set(fleet["device_exit_codes"].values()) == {0}, fleet["logs"]
    sim_records, fleet_records = _records(tmp_path / "sim"), _records(tmp_path / "fleet")
    assert [r["outcome"] for r in sim_records] == ["complete"] * cfg.rounds
    assert fleet_records == sim_records
    assert _summary(tmp_path / "fleet") == _summary(tmp_path / "sim")
    assert _summary(tmp_path / "sim")["final_accuracy"] is not None


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_server_half_saves_and_restores(method, tmp_path):
    from edgefl.server.session import build_server
    from edgefl.server.state import load_state, save_state
    from edgefl.sim import Simulation

    sim = Simulation(_config(method), show_progress=False)
    sim.run_round(1)
    path = save_state(sim.server, tmp_path / "state.safetensors", {"round": 1})
    fresh = build_server(sim.cfg, sim.ds, sim.slots)
    assert load_state(fresh, path) == {"round": 1}
    for cid in sim.clients:
        a, b = sim.server.downlink(2, cid), fresh.downlink(2, cid)
        assert (a is None) == (b is None)
        if a is not None:
            assert a.tensors.keys() == b.tensors.keys() and all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)
    assert fresh.global_models().keys() == sim.server.global_models().keys()
    # no pickle anywhere in the file: it is a safetensors file with a JSON skeleton
    assert path.read_bytes()[8:9] == b"{"


def test_devices_with_their_own_test_split_judge_the_global_model_the_same_in_both_runners(tmp_path):
    """FedAvg with data.client_test_fraction: the server's pooled test set is empty, so each device
    is sent the global model and judges it on its own split (a fleet once scored 0.0 here)."""
    from edgefl.fleet.launcher import run_fleet
    from edgefl.sim import Simulation

    raw = method_config("fedavg", rounds=1)
    raw["data"]["client_test_fraction"] = 0.25
    raw["threads"] = 1
    raw["network"] = {"federation": "own-split", "round_deadline_s": 120}
    cfg = RunConfig.model_validate(raw)
    sim = Simulation(cfg, show_progress=False).run()
    fleet = run_fleet(cfg, None, None, device_timeout_s=240)
    assert sim["final_accuracy"]["overall"] > 0.2
    assert fleet["final_accuracy"] == sim["final_accuracy"]
    assert set(sim["final_accuracy"]["per_client"]) == {"client-0", "client-1", "client-2", "client-3"}
