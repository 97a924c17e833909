"""Devices that crash: a device killed mid-round resumes from its own saved state and the run ends
with the fault-free numbers; a round whose devices all died closes at once and the run exits
non-zero. Real mosquitto, real device processes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import pytest

from edgefl.transport.link import BrokerAddress, Link
from edgefl.transport.topics import Topics
from edgefl.transport.envelope import unpack
from tests.mosquitto import mosquitto
from tests.test_fleet import _server_thread, fleet_config, wait_online


def _device(cfg_path, broker, device, state_dir, log_path, timeout=150):
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "edgefl", "client", "--broker", broker, "--config", str(cfg_path),
                                 "--device-id", device, "--timeout", str(timeout), "--state-dir", str(state_dir)],
                                stdout=log, stderr=subprocess.STDOUT)


def _kill_in_round_2_and_restart(cfg, broker, procs: dict, restart, run_dir=None, join_timeout_s: float = 5,
                                 events: list | None = None) -> tuple[dict, dict]:
    """Serve ``cfg`` while client-0 is killed as round 2 starts (its download is out: mid-round)
    and started again with ``restart()``; (what serve returned or raised, the devices' exit codes).
    ``events``: collects the server's events (kind, info)."""
    from edgefl.fleet.launcher import serve

    killed = threading.Event()

    def on_event(kind, info):
        if events is not None:
            events.append((kind, info))
        if kind == "round" and info["round"] == 2 and not killed.is_set():
            procs["client-0"].send_signal(signal.SIGKILL)
            killed.set()

    results: dict = {}

    def target():
        try:
            results["summary"] = serve(cfg, broker, run_dir, join_timeout_s=join_timeout_s, on_event=on_event)
        except BaseException as exc:
            results["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    assert killed.wait(180), "round 2 never started"
    procs["client-0"].wait(timeout=10)
    procs["client-0"] = restart()
    t.join(timeout=300)
    return results, {d: p.wait(timeout=60) for d, p in procs.items()}


def test_a_device_killed_mid_round_resumes_from_its_saved_state_and_the_run_ends_as_without_the_fault(tmp_path):
    from edgefl.sim import Simulation

    # FedHe: every device keeps a personal model and the server's logits between rounds, so a
    # device restarted from its initial weights would end with other numbers
    cfg = fleet_config("fedhe", rounds=3, round_deadline_s=90, ack_timeout_s=2, federation="device-crash")
    path = tmp_path / "run.toml"
    path.write_text(cfg.to_toml())
    ids = [f"client-{i}" for i in range(4)]
    state = {d: tmp_path / "state" / d for d in ids}
    logs = {d: tmp_path / f"{d}.log" for d in ids}
    with mosquitto(tmp_path) as broker:
        procs = {d: _device(path, broker, d, state[d], logs[d]) for d in ids}
        wait_online(broker, "device-crash", ids)

        def restart():
            saved = json.loads((state["client-0"] / "state.json").read_text())  # what the killed device left
            assert saved["round"] in (1, 2) and saved["device"] == "client-0"
            return _device(path, broker, "client-0", state["client-0"], logs["client-0"])

        results, codes = _kill_in_round_2_and_restart(cfg, broker, procs, restart)
    assert "error" not in results, results.get("error")
    assert set(codes.values()) == {0}, codes
    assert "continuing from the state it saved after round" in logs["client-0"].read_text()
    assert "client-1: round 3: upload accepted" in logs["client-1"].read_text()  # the device's line a round
    summary = results["summary"]
    assert [h["outcome"] for h in summary["history"]] == ["complete"] * 3
    fault_free = Simulation(cfg, show_progress=False).run()  # a fleet equals its simulation bit for bit (test_fleet)
    assert summary["final_accuracy"]["per_client"] == fault_free["final_accuracy"]["per_client"]
    assert summary["final_accuracy"]["overall"] == fault_free["final_accuracy"]["overall"]


def test_a_device_restarted_without_its_state_is_named_in_the_servers_log_with_the_reason(tmp_path):
    """A damaged state file: the device starts from scratch mid-run (kept aside, PROTOCOL.md 9), and
    its first upload says so, so the server's log explains the accuracy it loses."""
    cfg = fleet_config("fedhe", rounds=3, round_deadline_s=90, ack_timeout_s=2, federation="device-lost")
    path = tmp_path / "run.toml"
    path.write_text(cfg.to_toml())
    ids = [f"client-{i}" for i in range(4)]
    state = {d: tmp_path / "state" / d for d in ids}
    events: list = []
    with mosquitto(tmp_path) as broker:
        procs = {d: _device(path, broker, d, state[d], tmp_path / f"{d}.log") for d in ids}
        wait_online(broker, "device-lost", ids)

        def restart():
            carry = state["client-0"] / "carry.safetensors"  # cut short, as a power cut mid-write leaves it
            carry.write_bytes(carry.read_bytes()[:100])
            return _device(path, broker, "client-0", state["client-0"], tmp_path / "client-0.log")

        results, codes = _kill_in_round_2_and_restart(cfg, broker, procs, restart, events=events)
    assert "error" not in results, results.get("error")
    assert set(codes.values()) == {0}, codes
    warned = [info["reason"] for kind, info in events if kind == "warning" and info.get("device") == "client-0"]
    assert len(warned) == 1, events
    assert "restarted from scratch in round" in warned[0] and "after taking part from round 1" in warned[0]
    assert "carry.safetensors" in warned[0]  # why, as the device said it
    assert not [info for kind, info in events if kind == "warning" and info.get("device") != "client-0"]


def test_a_device_ignores_saved_state_from_another_run_of_the_same_config(tmp_path):
    """Two runs of one config (same federation, same device ids): the second starts afresh."""
    cfg = fleet_config("fedhe", rounds=1, round_deadline_s=60, federation="rerun")
    path = tmp_path / "run.toml"
    path.write_text(cfg.to_toml())
    ids = [f"client-{i}" for i in range(4)]
    finals = []
    with mosquitto(tmp_path) as broker:
        for attempt in range(2):
            logs = {d: tmp_path / f"{d}-{attempt}.log" for d in ids}
            procs = [_device(path, broker, d, tmp_path / "state" / d, logs[d]) for d in ids]
            wait_online(broker, "rerun", ids)
            results: dict = {}
            _server_thread(cfg, broker, results).join(timeout=120)
            assert "error" not in results, results.get("error")
            finals.append(results["summary"]["final_accuracy"])
            assert [p.wait(timeout=60) for p in procs] == [0] * 4
        assert "from another run" in logs["client-0"].read_text()
        # the first run's state is kept aside, not deleted, and the log says where
        (kept,) = (tmp_path / "state" / "client-0" / "old").iterdir()
        assert (kept / "state.json").is_file() and str(kept) in logs["client-0"].read_text()
    assert finals[0] == finals[1]


def test_a_round_whose_devices_all_died_closes_at_once_and_the_server_exits_non_zero(tmp_path):
    # long local training, so the devices die mid-round; a deadline far beyond what the test waits
    cfg = fleet_config("fedavg", rounds=2, round_deadline_s=300, keepalive_s=1, offline_grace_s=1, federation="all-dead")
    raw = cfg.to_dict()
    raw["train"]["epochs"] = 300
    path = tmp_path / "run.toml"
    from edgefl.config import RunConfig

    path.write_text(RunConfig.model_validate(raw).to_toml())
    ids = [f"client-{i}" for i in range(4)]
    out = tmp_path / "run"
    with mosquitto(tmp_path) as broker:
        procs = [_device(path, broker, d, tmp_path / "state" / d, tmp_path / f"{d}.log") for d in ids]
        wait_online(broker, "all-dead", ids)
        topics = Topics("all-dead")
        watcher = Link(BrokerAddress.parse(broker), "watch-all-dead", [topics.rounds]).start()
        t0 = time.monotonic()
        server = subprocess.Popen([sys.executable, "-m", "edgefl", "server", "--broker", broker, "--config", str(path),
                                   "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            while time.monotonic() - t0 < 120:  # the first round's announcement: the devices are training
                item = watcher.get(0.5)
                if item is not None and item.topic == topics.rounds and len(item.payload) > 9 \
                        and unpack(item.payload, 1 << 20).round == 1:
                    break
            for p in procs:
                p.send_signal(signal.SIGKILL)  # every device crashes at once
            _, stderr = server.communicate(timeout=120)
        finally:
            watcher.stop(offline=False)
            if server.poll() is None:
                server.kill()
    elapsed = time.monotonic() - t0
    assert server.returncode == 3, stderr[-2000:]
    assert "2 of 2 rounds failed" in stderr
    assert elapsed < 90, f"the rounds waited for their {cfg.network.round_deadline_s} s deadline ({elapsed:.0f} s)"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed_rounds"] == [1, 2]
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(h["outcome"] == "failed" and h["reported"] == [] for h in history)
    assert all("went offline" in h["failure"] for h in history), [h.get("failure") for h in history]


def test_a_device_with_its_own_data_killed_mid_round_gets_that_round_again_when_it_rejoins(tmp_path):
    """A device started with --data joins (hello, task, ready) before it listens for rounds: the
    download resent when it came back online reached its joining, so the server sends it again once
    the device is ready, and the round it was killed in completes with it (not by the deadline)."""
    import numpy as np
    from sklearn.datasets import load_digits

    from edgefl.config import RunConfig
    from edgefl.rundir import RunDir
    from tests.conftest import digits_config

    federation = "held-crash"
    raw = digits_config("fedavg", rounds=3)
    raw["data"] = {"dataset": "digits", "partition": "devices"}
    raw["fleet"] = {"groups": [{"model": "mlp", "count": 3, "options": {"hidden": [32, 16]}}]}
    # a restart under a loaded CI machine takes seconds: the grace must outlast it for the round to wait
    raw["network"] = {"federation": federation, "round_deadline_s": 60, "offline_grace_s": 50, "ack_timeout_s": 2}
    raw["threads"] = 1
    cfg = RunConfig.model_validate(raw)
    digits = load_digits()
    ids = [f"client-{i}" for i in range(3)]
    data = {}
    for i, device in enumerate(ids):
        data[device] = tmp_path / f"{device}.npz"
        np.savez(data[device], x=digits.images[i * 300:(i + 1) * 300].astype(np.uint8), y=digits.target[i * 300:(i + 1) * 300])
    state = {d: tmp_path / "state" / d for d in ids}
    logs = {d: tmp_path / f"{d}.log" for d in ids}

    def device(d: str) -> subprocess.Popen:
        with open(logs[d], "ab") as log:
            return subprocess.Popen([sys.executable, "-m", "edgefl", "client", "--broker", broker, "--federation", federation,
                                     "--device-id", d, "--data", str(data[d]), "--timeout", "200", "--state-dir", str(state[d])],
                                    stdout=log, stderr=subprocess.STDOUT)

    with mosquitto(tmp_path) as broker:
        procs = {d: device(d) for d in ids}
        wait_online(broker, federation, ids, timeout_s=180)
        results, codes = _kill_in_round_2_and_restart(cfg, broker, procs, lambda: device("client-0"),
                                                      RunDir.create(tmp_path / "run", cfg.name, cfg.seed), join_timeout_s=120)
    assert "error" not in results, results.get("error")
    assert set(codes.values()) == {0}, (codes, logs["client-0"].read_text()[-2000:])
    assert "continuing from the state it saved after round 1" in logs["client-0"].read_text()
    history = results["summary"]["history"]
    assert [h["outcome"] for h in history] == ["complete"] * 3, [(h["outcome"], h["missing"]) for h in history]
    assert "client-0" in history[1]["reported"]


def _the_second_stops_the_first(tmp_path, federation: str, connect, match: str, hint: str) -> None:
    """Two links with one client id (``connect(broker, topics)``): the older stops with the reason
    (an EdgeflError matching ``match``, its hint naming ``hint``); the newer keeps its connection."""
    from edgefl.errors import EdgeflError

    topics = Topics(federation)
    with mosquitto(tmp_path) as broker:
        first = connect(broker, topics)
        second = connect(broker, topics)
        try:
            with pytest.raises(EdgeflError, match=match) as exc:
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    first.receive(0.2)
            assert hint in exc.value.hint
            assert second.link.connected.wait(10)  # the first's one reconnect closed it once; it came back
            connects = second.link.connect_count
            time.sleep(4)  # longer than the reconnect back-off: nothing closes the second any more
            assert second.link.connected.is_set() and second.link.connect_count == connects <= 2
            assert not first.link.connected.is_set() and not second.link.taken_over.is_set()
        finally:
            first.close()
            second.close()


def test_a_second_process_with_a_devices_id_stops_the_first_instead_of_flapping(tmp_path):
    """The broker closes the older connection of a client id another client takes; reconnecting would
    close the newer in turn, forever. The older device (it sees the newer's presence) stops with the
    reason, the newer keeps its connection."""
    from edgefl.transport.mqtt import MqttDeviceTransport

    _the_second_stops_the_first(
        tmp_path, "twins",
        lambda broker, topics: MqttDeviceTransport.connect(broker, topics, "client-0", max_packet_bytes=1 << 20, keepalive_s=30),
        "two devices run with one --device-id", "own --device-id")


def test_the_server_says_when_two_processes_run_as_one_device_but_not_when_a_device_restarts(tmp_path):
    """A restarted device comes back as a newer process; a second process with the same --device-id
    makes the older one come online again after the newer (before it sees the newer and stops). The
    server says the second once, naming the device, and stays quiet about the first."""
    from edgefl.config import NetworkSettings
    from edgefl.methods import METHODS
    from edgefl.server.endpoint import ServerEndpoint
    from edgefl.transport.base import Delivery
    from edgefl.transport.mqtt import MqttDeviceTransport, MqttServerTransport

    topics = Topics("twins-seen")
    events: list[tuple[str, dict]] = []
    with mosquitto(tmp_path) as broker:
        server = MqttServerTransport.connect(broker, topics, max_packet_bytes=1 << 20, keepalive_s=30)
        endpoint = ServerEndpoint(NetworkSettings(), METHODS["fedavg"], server, ["client-0", "client-1"], "twins-seen",
                                  num_classes=10, max_epochs=1, partial_max_age_s=60, on_event=lambda k, i: events.append((k, i)))

        def connect(device: str) -> MqttDeviceTransport:
            return MqttDeviceTransport.connect(broker, topics, device, max_packet_bytes=1 << 20, keepalive_s=30)

        def pump(seconds: float, *devices: MqttDeviceTransport) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                endpoint.pump(0.1)
                for d in devices:
                    try:
                        d.receive(0.05)
                    except Exception:  # the older twin stops (its own test says how)
                        pass

        try:
            first = connect("client-1")
            pump(1.0, first)
            first.close()  # a restart: the process goes, a newer one comes
            time.sleep(0.05)
            again = connect("client-1")
            pump(1.5, again)
            assert [k for k, _ in events if k == "twins"] == []
            assert endpoint.instances["client-1"] == again.link.instance
            older, newer = connect("client-0"), connect("client-0")
            pump(8.0, older, newer, again)
            twins = [i for k, i in events if k == "twins"]
            assert len(twins) == 1 and twins[0]["device"] == "client-0", events
            assert (twins[0]["older"], twins[0]["newer"]) == (older.link.instance, newer.link.instance)
            assert endpoint.instances["client-0"] == newer.link.instance
            for hostile in ("nan-00", "inf-ab", "0-zz", "1e3-ab", "x" * 500, ""):  # a presence is trusted no more than an upload
                endpoint.handle(Delivery("presence", "client-0", online=True, where="p", instance=hostile))
            assert endpoint.instances["client-0"] == newer.link.instance and len([k for k, _ in events if k == "twins"]) == 1
            for d in (older, newer, again):
                d.close()
        finally:
            server.close()
    # the server's console says it even in a fleet too large for a line per device
    import io

    from rich.console import Console

    from edgefl.cli import _fleet_printer

    buffer = io.StringIO()
    _fleet_printer(Console(file=buffer, width=2000, color_system=None), 3, None, 10_000)("twins", twins[0])
    assert "warning: two processes run as device client-0" in buffer.getvalue() and "own --device-id" in buffer.getvalue()


def test_a_second_server_of_a_federation_stops_the_first_instead_of_flapping(tmp_path):
    """Two servers of one federation share the client id ``edgefl-<federation>-server``: before,
    each reconnect closed the other's connection, forever, and both sent their rounds to the same
    devices. The older server (it sees the newer's presence) stops with the reason; the newer goes on."""
    from edgefl.transport.mqtt import MqttServerTransport

    _the_second_stops_the_first(
        tmp_path, "twin-servers",
        lambda broker, topics: MqttServerTransport.connect(broker, topics, max_packet_bytes=1 << 20, keepalive_s=30),
        "two servers cannot share one federation", "--resume")


def _drain(transport, seconds: float) -> list[bytes]:
    got, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        item = transport.receive(0.2)
        if item is not None and item.channel == "message":
            got.append(item.payload)
    return got


@pytest.mark.parametrize("protocol", ["5"])  # 3.1.1 fixes clean_session for a client's life: no fresh start there
def test_a_devices_new_process_drops_what_the_broker_queued_for_the_old_one_and_keeps_its_session_over_reconnects(
        tmp_path, protocol):
    """A device restarted for a new run of its federation got the old run's queued downloads first:
    it trained them, its uploads were refused, and the old run's end made it quit the new run. A
    device's process starts with a clean session (the server re-sends the current download when the
    device comes online); a reconnect within the process keeps the session and what waited in it."""
    import socket

    from edgefl.transport.mqtt import MqttDeviceTransport

    topics = Topics(f"queued-{protocol.replace('.', '')}")
    with mosquitto(tmp_path) as broker:
        address = BrokerAddress.parse(broker)
        server = Link(address, f"edgefl-{topics.federation}-server", [], protocol=protocol).start()

        def process() -> MqttDeviceTransport:
            return MqttDeviceTransport.connect(broker, topics, "client-0", max_packet_bytes=1 << 20, keepalive_s=30,
                                               protocol=protocol)

        old = process()
        old.link.stop(offline=False)  # the old process is gone; the broker keeps its session for it
        server.publish(topics.down("client-0"), b"queued for the old process")
        time.sleep(0.5)
        new = process()
        try:
            assert _drain(new, 2.0) == []
            new.link.client.socket().shutdown(socket.SHUT_RDWR)  # the network drops; paho reconnects by itself
            deadline = time.monotonic() + 5
            while new.link.connected.is_set() and time.monotonic() < deadline:
                time.sleep(0.05)
            server.publish(topics.down("client-0"), b"sent while it was away")
            assert new.link.connected.wait(15) and new.link.connect_count == 2
            assert _drain(new, 3.0) == [b"sent while it was away"]
        finally:
            new.close()
            server.stop()


def test_a_device_stopped_with_ctrl_c_says_what_it_leaves(tmp_path):
    """`edgefl client` exited 130 without a word on Ctrl-C (the server says what it saved)."""
    cfg = fleet_config("fedavg", rounds=2, federation="ctrl-c")
    path = tmp_path / "run.toml"
    path.write_text(cfg.to_toml())
    with mosquitto(tmp_path) as broker:
        with open(tmp_path / "client.log", "ab") as log:
            device = subprocess.Popen([sys.executable, "-m", "edgefl", "client", "--broker", broker, "--config", str(path),
                                       "--device-id", "client-0", "--state-dir", str(tmp_path / "state")],
                                      stdout=log, stderr=subprocess.STDOUT,
                                      # a test runner's worker may run with SIGINT ignored, and its children inherit that
                                      preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            wait_online(broker, "ctrl-c", ["client-0"])
            device.send_signal(signal.SIGINT)
            assert device.wait(60) == 130
        finally:
            device.kill()
    said = (tmp_path / "client.log").read_text()
    assert f"client-0: stopped; its state is in {tmp_path / 'state'}" in said, said[-2000:]
