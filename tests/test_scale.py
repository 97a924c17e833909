"""Cross-device scale: over-selection, a round that closes at its target count, and the load
generator's protocol-level devices over a real mosquitto (bench/scale.py measures thousands)."""

from __future__ import annotations

import threading
import uuid

import pytest

from edgefl.config import validate_config
from edgefl.errors import ConfigError
from edgefl.fleet.launcher import serve
from edgefl.fleet.swarm import LoadSettings, run_load
from edgefl.rundir import RunDir
from edgefl.sim import Simulation
from edgefl.transport.topics import device_ids
from tests.conftest import digits_config
from tests.mosquitto import mosquitto


def crowd(method: str, devices: int, per_round: int, over_select: float, rounds: int = 2) -> dict:
    raw = digits_config(method, rounds=rounds)
    half = devices // 2
    raw["fleet"] = {"groups": [{"model": "fedhe-cnn-0", "count": half, "options": {"width": 0.125}},
                               {"model": "mlp", "count": devices - half, "options": {"hidden": [16]}}],
                    "per_round": per_round, "over_select": over_select}
    raw["data"] = {"dataset": "digits", "partition": "iid"}
    raw["train"]["max_steps"] = 2
    raw["eval"] = {"every": rounds, "unselected": "last_reported"}  # the load is the training protocol's
    return raw


def test_a_round_closes_at_its_target_and_the_over_selected_rest_is_late():
    cfg = validate_config(crowd("fedavg", 12, per_round=4, over_select=0.5, rounds=3))
    sim = Simulation(cfg, None, show_progress=False)
    sim.run()
    for record in sim.history:
        assert len(record["selected"]) == 6 and record["target"] == 4
        assert record["outcome"] == "complete" and record["accepted"] == 4
        counted = [d for d, receipt in record["receipts"].items() if receipt == "accepted"]
        assert len(counted) == 4
        others = [receipt for d, receipt in record["receipts"].items() if d not in counted]
        assert all(r.startswith("late") or r == "missing: the round reached its target first" for r in others)
    # what came after a round closed was answered late in the next one, never counted there
    later = [d for record in sim.history[1:] for d in record["late"]]
    assert later and all(sim.history[i]["accepted"] == 4 for i in range(3))


@pytest.mark.parametrize(("fleet", "match"), [
    ({"per_round": 3, "sample_ratio": 0.5}, "either sample_ratio"),
    ({"over_select": 0.3}, "set per_round too"),
    ({"per_round": 50}, "only 4 devices"),
])
def test_selection_settings_are_checked(fleet: dict, match: str):
    raw = digits_config("fedavg")
    raw["fleet"].update(fleet)
    with pytest.raises(ConfigError, match=match):
        validate_config(raw)


def test_protocol_level_devices_load_a_real_server_with_over_selection_and_dropouts(tmp_path):
    """40 protocol-level devices in one process, each its own MQTT session and device loop, 20 %
    of the selected dropping out mid-round: every round closes at its target; what the devices
    were told was counted is what the server counted; nothing that reached the server before a
    round closed went unanswered."""
    raw = crowd("fedhe", 40, per_round=10, over_select=0.5)
    raw["network"] = {"federation": f"scale-{uuid.uuid4().hex[:8]}", "round_deadline_s": 60.0, "ack_timeout_s": 5.0}
    cfg = validate_config(raw)
    stats: dict = {}
    with mosquitto(tmp_path) as url:
        devices = threading.Thread(target=lambda: stats.update(run_load(
            cfg, url, device_ids(40), LoadSettings(compute_s=0.3, dropout=0.2, rejoin_s=1.0, seed=3), timeout_s=150)))
        devices.start()
        summary = serve(cfg, url, RunDir.create(tmp_path / "run", cfg.name, cfg.seed))
        devices.join(160)
    assert stats["finished"] == 40
    assert sum(row.get("dropped", 0) for row in stats["rounds"].values()) >= 1
    for record in summary["history"]:
        row = stats["rounds"][record["round"]]
        assert record["outcome"] == "complete" and len(record["selected"]) == 15 and record["accepted"] == 10
        counted = sorted(d for d, receipt in record["receipts"].items() if receipt == "accepted")
        assert sorted(row["accepted_devices"]) == counted
        assert row["unanswered"] == 0
        assert row["published"] == row["accepted"] + row["late"]


@pytest.mark.slow  # bench/scale.py measures 1,000 to 10,000 devices
def test_a_thousand_devices_with_churn_keep_every_count(tmp_path):
    """1,000 protocol-level devices, 100 per round from 130 selected, drop-outs and random
    reconnects: rounds close at the target, nothing is lost or counted twice, and the announcement
    carries the count, not 130 ids."""
    from edgefl.transport.envelope import unpack
    from edgefl.transport.link import BrokerAddress, Link
    from edgefl.transport.topics import Topics

    raw = crowd("fedhe", 1000, per_round=100, over_select=0.3, rounds=3)
    raw["network"] = {"federation": f"scale-{uuid.uuid4().hex[:8]}", "round_deadline_s": 120.0, "ack_timeout_s": 10.0}
    cfg = validate_config(raw)
    stats: dict = {}
    with mosquitto(tmp_path) as url:
        topics = Topics(cfg.network.federation)
        listener = Link(BrokerAddress.parse(url), "announcement-listener", [topics.rounds], None, max_packet_bytes=1 << 20).start()
        devices = threading.Thread(target=lambda: stats.update(run_load(
            cfg, url, device_ids(1000), LoadSettings(compute_s=1.0, dropout=0.08, churn_per_min=0.5, rejoin_s=5.0, seed=5),
            timeout_s=400)))
        devices.start()
        summary = serve(cfg, url, RunDir.create(tmp_path / "run", cfg.name, cfg.seed))
        devices.join(420)
        announced = []
        while (item := listener.get(0.5)) is not None:
            announced.append(unpack(item.payload, 1 << 20).extra["info"])
        listener.stop()
    rounds = [info for info in announced if info.get("selected_count")]
    assert rounds and all("selected" not in info and info["selected_count"] == 130 and info["target"] == 100 for info in rounds)
    assert stats["finished"] == 1000 and stats["disconnects"] > 0
    for record in summary["history"]:
        row = stats["rounds"][record["round"]]
        assert record["outcome"] == "complete" and record["accepted"] == 100
        counted = sorted(d for d, receipt in record["receipts"].items() if receipt == "accepted")
        assert sorted(row["accepted_devices"]) == counted
        closed = record["closed_unix"]
        assert not [t for t in row.get("unanswered_published_unix", []) if t < closed]


def test_the_load_generator_says_when_no_broker_answers():
    from edgefl.errors import EdgeflError
    from tests.mosquitto import free_port

    cfg = validate_config(crowd("fedhe", 4, per_round=2, over_select=0.0))
    with pytest.raises(EdgeflError, match="cannot reach the broker"):
        run_load(cfg, f"mqtt://127.0.0.1:{free_port()}", device_ids(4), LoadSettings(), timeout_s=60)


def test_a_device_selected_again_while_still_computing_reports_each_round_under_its_own_round(tmp_path):
    """Slow devices are still computing when their round closes at its target and may be selected
    again: each upload keeps its own round and compute time, and the devices' per-round counts
    agree with the server's answers."""
    raw = crowd("fedhe", 12, per_round=4, over_select=1.0, rounds=3)
    raw["network"] = {"federation": f"scale-{uuid.uuid4().hex[:8]}", "round_deadline_s": 60.0, "ack_timeout_s": 5.0}
    cfg = validate_config(raw)
    stats: dict = {}
    with mosquitto(tmp_path) as url:
        devices = threading.Thread(target=lambda: stats.update(run_load(
            cfg, url, device_ids(12), LoadSettings(compute_s=0.6, compute_spread=1.0, seed=11), timeout_s=120)))
        devices.start()
        summary = serve(cfg, url, RunDir.create(tmp_path / "run", cfg.name, cfg.seed))
        devices.join(130)
    late_later = 0
    for record in summary["history"]:
        row = stats["rounds"].get(record["round"], {"accepted_devices": [], "published": 0, "accepted": 0, "late": 0, "duplicate": 0})
        assert sorted(row["accepted_devices"]) == sorted(d for d, r in record["receipts"].items() if r == "accepted")
        answered = row["accepted"] + row["late"] + row["duplicate"] + row.get("refused", 0)
        assert row["published"] == answered + row.get("unanswered", 0)
        late_later += row["late"]
    assert late_later >= 1  # the over-selected slow ones were heard, and told they were late
