"""Fleets described by device classes: assignment per class, the virtual clock, stragglers."""

from __future__ import annotations

import pytest

from edgefl.config import validate_config
from edgefl.errors import ConfigError
from edgefl.report import draw_plots
from edgefl.rundir import RunDir
from edgefl.sim import Simulation


def fleet(groups, deadline=30.0, candidates=None, method="fedhe", rounds=2) -> dict:
    return {
        "name": "test-fleet", "seed": 0, "rounds": rounds, "method": {"name": method},
        "data": {"dataset": "digits", "partition": "iid"},
        "train": {"batch_size": 32, "max_steps": 4},
        "clock": {"deadline_s": deadline, **({"candidates": candidates} if candidates else {})},
        "fleet": {"groups": groups},
    }


CANDIDATES = ["fedhe-cnn-0:width=0.5", "fedhe-cnn-0:width=0.125", "mlp"]


def run(raw, out=None):
    cfg = validate_config(raw)
    sim = Simulation(cfg, RunDir.create(out, cfg.name, cfg.seed) if out else None, show_progress=False)
    return sim, sim.run()


def test_auto_assignment_per_device_class_and_clock(tmp_path):
    sim, summary = run(fleet([{"profile": "pi5-8gb", "model": "auto", "count": 2},
                              {"profile": "pi-zero-2w", "model": "auto", "count": 2}], deadline=0.5, candidates=CANDIDATES),
                       tmp_path / "run")
    archs = {s.profile.id: s.arch for s in sim.slots}
    assert archs["pi5-8gb"] == "fedhe-cnn-0(width=0.5)"  # the largest candidate
    assert archs["pi-zero-2w"] in ("fedhe-cnn-0(width=0.125)", "mlp")  # the slow board: a smaller one
    rec = sim.history[-1]
    assert set(rec["virtual_time_by_profile"]) == {"pi5-8gb", "pi-zero-2w"}
    assert all(0 < t <= 0.5 for t in rec["virtual_time_s"].values())  # assigned within the deadline
    assert rec["stragglers"] == [] and rec["round_virtual_s"] == max(rec["virtual_time_s"].values())
    assert summary["virtual_time_total_s"] > 0
    assert "round_time.png" in {p.name for p in draw_plots(RunDir(tmp_path / "run"))}
    assert RunDir(tmp_path / "run").read_json("run.json")["device_profiles"]["pi5-8gb"]["class"] == "sbc"


def test_a_device_that_misses_the_deadline_is_dropped_and_reported():
    sim, summary = run(fleet([{"profile": "pi5-8gb", "model": "mlp", "count": 2},
                              {"profile": "pi-zero-2w", "model": "fedhe-cnn-0", "options": {"width": 0.5}, "count": 1}],
                             deadline=0.2))
    slow = next(s.client_id for s in sim.slots if s.profile.id == "pi-zero-2w")
    for rec in sim.history:
        assert rec["stragglers"] == [slow]
        assert rec["receipts"][slow].startswith("dropped: straggler")
        assert rec["virtual_time_s"][slow] > 0.2 and rec["round_virtual_s"] == 0.2
    assert slow not in sim.server.store  # the server never received its logits
    assert summary["stragglers_total"] == 2


def test_unknown_speed_means_no_clock_for_that_device():
    sim, _ = run(fleet([{"profile": "iphone-15", "model": "mlp", "count": 1}, {"profile": "pi4-4gb", "model": "mlp", "count": 1}]))
    times = sim.history[-1]["virtual_time_s"]
    assert times["client-0"] is None and times["client-1"] > 0 and sim.history[-1]["stragglers"] == []


def test_fleet_config_errors():
    with pytest.raises(ConfigError, match='model = "auto" needs a profile'):
        validate_config(fleet([{"model": "auto"}]))
    with pytest.raises(ConfigError, match="did you mean 'pi4-4gb'"):
        validate_config(fleet([{"model": "mlp", "profile": "pi4-4g"}]))
    with pytest.raises(ConfigError, match=r"fleet.groups\[0\]: esp32-s3 cannot take part"):
        run(fleet([{"profile": "esp32-s3", "model": "auto"}], candidates=["fedhe-cnn-0:width=0.5"]))
