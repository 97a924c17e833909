"""The broker URL's scheme picks the transport (edgefl.transport.registry): a transport registered
by this file alone runs a fleet through the launcher's own functions, the built-in in-process hub
(memory://) runs one that writes what the simulation of the same config writes, and a scheme
nobody registered is refused naming those there are."""

from __future__ import annotations

import subprocess
import sys
import threading
import uuid

import pytest

from edgefl.config import RunConfig
from edgefl.errors import EdgeflError
from edgefl.rundir import RunDir
from edgefl.transport.base import Delivery, DeviceTransport, ServerTransport
from edgefl.transport.memory import MemoryDeviceTransport, MemoryServerTransport, hub
from edgefl.transport.registry import (
    BrokerAddress,
    device_transport,
    register_transport,
    schemes,
    server_transport,
    transport_for,
    unregister_transport,
)
from edgefl.transport.topics import Topics, device_ids
from tests.conftest import digits_config, serve_with_device_threads
from tests.test_every_method import _records, _summary


def _config(rounds: int = 2) -> RunConfig:
    """FedAvg on scikit-learn digits, two small MLP devices: seconds."""
    raw = digits_config("fedavg", rounds=rounds)
    raw["fleet"] = {"groups": [{"model": "mlp", "count": 2, "options": {"hidden": [32, 16]}}]}
    raw["network"] = {"round_deadline_s": 60, "federation": f"registry-{uuid.uuid4().hex[:8]}"}
    raw["threads"] = 1
    return RunConfig.model_validate(raw)


# --- a toy transport, registered here: the memory hub with every byte counted ----------------------
class _Counts:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bytes = {"down": 0, "up_sent": 0, "up_received": 0}

    def add(self, key: str, n: int) -> None:
        with self.lock:  # the device loops are threads
            self.bytes[key] += n


def _hub_url(url: str) -> str:
    return "memory://" + url.removeprefix("loop://")


class _CountingServer(ServerTransport):
    def __init__(self, inner: ServerTransport, counts: _Counts) -> None:
        self.inner = inner
        self.counts = counts

    def send(self, device: str, data: bytes) -> None:
        self.counts.add("down", len(data))
        self.inner.send(device, data)

    def announce(self, data: bytes) -> None:
        self.counts.add("down", len(data))
        self.inner.announce(data)

    def receive(self, timeout_s: float) -> Delivery | None:
        item = self.inner.receive(timeout_s)
        if item is not None and item.channel == "message":
            self.counts.add("up_received", len(item.payload))
        return item

    def close(self) -> None:
        self.inner.close()


class _CountingDevice(DeviceTransport):
    def __init__(self, inner: DeviceTransport, counts: _Counts) -> None:
        self.inner = inner
        self.counts = counts

    def send(self, data: bytes) -> None:
        self.counts.add("up_sent", len(data))
        self.inner.send(data)

    def receive(self, timeout_s: float) -> Delivery | None:
        return self.inner.receive(timeout_s)

    def close(self) -> None:
        self.inner.close()


@pytest.fixture
def loop_scheme():
    """``loop://NAME``, registered for one test: what its connections counted."""
    counts = _Counts()
    register_transport("loop", lambda url, topics, **options: _CountingServer(server_transport(_hub_url(url), topics, **options), counts),
                       lambda url, topics, device, **options: _CountingDevice(device_transport(_hub_url(url), topics, device, **options), counts),
                       example="loop://NAME", in_process=True)
    try:
        yield counts
    finally:
        unregister_transport("loop")


def test_a_transport_registered_by_a_test_runs_a_fleet_through_serve_and_run_device(loop_scheme):
    cfg = _config()
    url = f"loop://toy-{uuid.uuid4().hex[:8]}"
    assert "loop" in schemes() and transport_for(url).scheme == "loop"
    summary, served = serve_with_device_threads(cfg, url, device_ids(cfg.fleet.num_clients), join_timeout_s=60)
    assert [h["outcome"] for h in summary["history"]] == ["complete"] * cfg.rounds
    assert sorted(served) == device_ids(cfg.fleet.num_clients) and all(len(r) == cfg.rounds for r in served.values())
    # every byte went through the toy: what the devices sent is what the server received, and at
    # least what the run counted as uploads and downloads (joins, acks and announcements come on top)
    counted = loop_scheme.bytes
    assert counted["up_sent"] == counted["up_received"] >= summary["bytes_up_total"] > 0
    assert counted["down"] >= summary["bytes_down_total"] > 0


def test_a_memory_fleet_writes_what_the_simulation_of_its_config_writes(tmp_path):
    from edgefl.fleet.launcher import run_fleet
    from edgefl.sim import Simulation

    cfg = _config()
    Simulation(cfg, RunDir.create(tmp_path / "sim", cfg.name, cfg.seed), show_progress=False).run()
    fleet = run_fleet(cfg, None, RunDir.create(tmp_path / "fleet", cfg.name, cfg.seed), broker=f"memory://sim-twin-{uuid.uuid4().hex[:8]}",
                      device_timeout_s=120)
    assert fleet["device_exit_codes"] == dict.fromkeys(device_ids(cfg.fleet.num_clients), 0), fleet["logs"]
    sim_records, fleet_records = _records(tmp_path / "sim"), _records(tmp_path / "fleet")
    assert [r["outcome"] for r in sim_records] == ["complete"] * cfg.rounds
    assert fleet_records == sim_records
    assert _summary(tmp_path / "fleet") == _summary(tmp_path / "sim")
    assert _summary(tmp_path / "sim")["final_accuracy"]["overall"] > 0


# --- the hub alone: what a broker with persistent sessions and retained messages would do ------------
def test_the_memory_hub_keeps_presence_the_announcement_and_messages_for_the_absent():
    name, topics = f"unit-{uuid.uuid4().hex[:8]}", Topics("fed")
    url = f"memory://{name}"
    early = device_transport(url, topics, "client-0", max_packet_bytes=1000, keepalive_s=30, username="ignored")
    server = server_transport(url, topics, max_packet_bytes=1000)
    assert isinstance(server, MemoryServerTransport) and isinstance(early, MemoryDeviceTransport)
    first = server.receive(1)
    assert (first.channel, first.peer, first.online) == ("presence", "client-0", True)  # told on connecting
    server.announce(b"round 1")
    server.send("client-1", b"for the absent")  # kept until client-1 connects
    late = device_transport(url, topics, "client-1")
    got = [late.receive(1), late.receive(1)]
    assert [(d.channel, d.payload) for d in got] == [("message", b"for the absent"), ("announcement", b"round 1")]
    assert (early.receive(1).channel, early.receive(0)) == ("announcement", None)
    early.send(b"upload")
    seen = [server.receive(1), server.receive(1)]
    assert [(d.channel, d.peer) for d in seen] == [("presence", "client-1"), ("message", "client-0")]
    assert seen[1].payload == b"upload" and seen[1].where == topics.up("client-0")
    with pytest.raises(EdgeflError, match="limit is 1000"):
        server.send("client-0", b"x" * 1001)
    with pytest.raises(EdgeflError, match="already has a server"):
        server_transport(url, topics)
    with pytest.raises(EdgeflError, match="already connected"):
        device_transport(url, topics, "client-0")
    early.close()
    gone = server.receive(1)
    assert (gone.channel, gone.peer, gone.online) == ("presence", "client-0", False)
    with pytest.raises(EdgeflError, match="closed"):
        early.send(b"after close")
    server.close()
    again = server_transport(url, topics)  # the presence it missed is replayed, as MQTT's retained presence
    assert {(d.peer, d.online) for d in (again.receive(1), again.receive(1))} == {("client-0", False), ("client-1", True)}
    assert hub(name) is hub(name)


# --- refusals ------------------------------------------------------------------------------------
def test_an_unknown_scheme_is_refused_naming_the_registered_ones():
    for url, close in (("mqqt://broker:1883", "mqtt"), ("memroy://fleet", "memory")):
        with pytest.raises(EdgeflError, match=f"did you mean '{close}'") as info:
            transport_for(url)
        assert "mqtt://HOST:PORT" in str(info.value) and "memory://NAME" in str(info.value)
    with pytest.raises(EdgeflError, match="expected mqtt://HOST:PORT"):
        BrokerAddress.parse("broker.example.org:1883")  # no scheme at all
    with pytest.raises(EdgeflError, match="unknown transport scheme 'gopher'"):
        server_transport("gopher://x", Topics("fed"))
    with pytest.raises(ValueError, match="already registered"):
        register_transport("mqtt", server_transport, device_transport)
    # a URL of a registered scheme parses, with its defaults; MQTT's connection refuses a hub's
    assert BrokerAddress.parse("mqtts://broker") == BrokerAddress("broker", 8883, True, "mqtts")
    assert str(BrokerAddress.parse("memory://lab")) == "memory://lab"
    from edgefl.transport.link import Link

    with pytest.raises(EdgeflError, match="not an MQTT broker"):
        Link(BrokerAddress.parse("memory://lab"), "x", [])


def test_the_cli_refuses_a_typo_and_an_in_process_hub_before_building_anything(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(_config().to_toml())
    run = [sys.executable, "-m", "edgefl"]
    typo = subprocess.run([*run, "server", "--broker", "mqqt://127.0.0.1:1883", "--config", str(path), "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=120)
    assert typo.returncode == 2 and "did you mean 'mqtt'" in typo.stderr and not (tmp_path / "run").exists()
    alone = subprocess.run([*run, "client", "--broker", "memory://lab", "--config", str(path), "--device-id", "client-0"],
                           capture_output=True, text=True, timeout=120)
    assert alone.returncode == 2 and "reaches only this process" in alone.stderr and "edgefl fleet --broker memory://lab" in alone.stderr
