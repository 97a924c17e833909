"""A deployment as docs/deploy.md describes it: `edgefl broker-config` writes a broker folder, a
real mosquitto runs exactly that configuration (TLS, passwords, ACL), and the server and every
device run as their own `edgefl server` / `edgefl client` processes over mqtts:// with their own
credentials, to the end of the run."""

from __future__ import annotations

import csv
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from edgefl.config import RunConfig
from edgefl.fleet.broker import _wait_listening, free_port, mosquitto_binary
from edgefl.fleet.broker_config import SERVER_USER
from edgefl.transport.topics import Topics
from tests.conftest import method_config

FEDERATION = "deploy-test"
DEVICES = ["client-0", "client-1"]
SECRETS = ["passwords", "credentials.csv", "acl", "certs/ca.key", "certs/server.key"]
EDGEFL = [sys.executable, "-m", "edgefl"]


@dataclass
class Deployment:
    folder: Path
    port: int
    credentials: dict[str, str]

    @property
    def ca(self) -> Path:
        return self.folder / "certs" / "ca.crt"


def _broker_config(out: Path, port: int) -> subprocess.CompletedProcess:
    return subprocess.run([*EDGEFL, "broker-config", "--devices", str(len(DEVICES)), "--federation", FEDERATION,
                           "--port", str(port), "--hostname", "localhost", "--bind", "127.0.0.1", "--out", str(out)],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    binary = mosquitto_binary()
    if binary is None or shutil.which("openssl") is None:
        pytest.skip("needs mosquitto and openssl (apt-get install mosquitto openssl)")
    folder = tmp_path_factory.mktemp("deploy") / "broker"
    port = free_port()
    made = _broker_config(folder, port)
    assert made.returncode == 0, made.stderr
    with open(folder / "credentials.csv", newline="") as f:
        credentials = {row["username"]: row["password"] for row in csv.DictReader(f)}
    conf = folder / "mosquitto.conf"
    if os.geteuid() == 0:
        # as root mosquitto drops to the `mosquitto` user, which cannot read root's 0600 files (in a
        # deployment they are chown'ed to it): the same configuration, told to stay root
        conf = folder.parent / "as-root.conf"
        conf.write_text((folder / "mosquitto.conf").read_text() + "user root\n")
    log = folder.parent / "mosquitto.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([binary, "-c", str(conf)], stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_listening(proc, port, 10, "mosquitto", log)
        yield Deployment(folder, port, credentials)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_secret_files_are_private_from_creation(deployment, tmp_path):
    for name in SECRETS:
        assert (deployment.folder / name).stat().st_mode & 0o777 == 0o600, name
    for name in ("certs/ca.crt", "certs/server.crt"):  # public: devices and the broker read them
        assert (deployment.folder / name).stat().st_mode & 0o077 == 0o044, name
    assert set(deployment.credentials) == {SERVER_USER, *DEVICES}
    assert not list(deployment.folder.rglob(".edgefl-*")), "a private work folder was left behind"

    # under a careless umask, over world-readable files of the same names: still 0600, and each a new
    # file (renamed into place), so a reader holding the old one open never sees a secret
    out = tmp_path / "broker"
    (out / "certs").mkdir(parents=True)
    stale = {}
    for name in ("credentials.csv", "certs/ca.key", "certs/server.key"):
        (out / name).write_text("old")
        (out / name).chmod(0o644)
        stale[name] = (out / name).stat().st_ino
    old_umask = os.umask(0)
    try:
        made = _broker_config(out, free_port())
    finally:
        os.umask(old_umask)
    assert made.returncode == 0, made.stderr
    for name in SECRETS:
        assert (out / name).stat().st_mode & 0o777 == 0o600, name
    for name, inode in stale.items():
        assert (out / name).stat().st_ino != inode, name
    assert _broker_config(out, free_port()).returncode != 0  # an existing configuration is never overwritten


class Peer:
    """A bare paho client with a clean session (it leaves nothing in the broker for the fleet)."""

    def __init__(self, deployment: Deployment, user: str, subscriptions: list[str]) -> None:
        import paho.mqtt.client as mqtt

        self.got: queue.Queue[tuple[str, bytes]] = queue.Queue()
        ready = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"acl-{user}", protocol=mqtt.MQTTv5)
        self.client.username_pw_set(user, deployment.credentials[user])
        self.client.tls_set(ca_certs=str(deployment.ca))
        self.client.on_message = lambda c, u, msg: self.got.put((msg.topic, bytes(msg.payload)))
        self.client.on_connect = lambda c, u, f, rc, p=None: (c.subscribe([(t, 1) for t in subscriptions]) if subscriptions
                                                               else ready.set())
        self.client.on_subscribe = lambda *args: ready.set()
        self.client.connect("127.0.0.1", deployment.port, clean_start=True)
        self.client.loop_start()
        assert ready.wait(10), f"{user} never connected"

    def publish(self, topic: str, payload: bytes) -> None:
        self.client.publish(topic, payload, qos=1).wait_for_publish(5)

    def received_until(self, sentinel: bytes, timeout_s: float = 5) -> list[tuple[str, bytes]]:
        got = []
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            try:
                item = self.got.get(timeout=0.1)
            except queue.Empty:
                continue
            if item[1] == sentinel:
                time.sleep(0.2)  # anything queued behind it
                while not self.got.empty():
                    got.append(self.got.get())
                return got
            got.append(item)
        raise AssertionError(f"{sentinel!r} never arrived (got {got})")

    def stop(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def test_a_device_reads_the_rounds_and_only_its_own_topics(deployment):
    t = Topics(FEDERATION)
    server = Peer(deployment, SERVER_USER, [t.all_up, t.all_presence, t.rounds])
    dev = Peer(deployment, "client-0", [t.rounds, t.down("client-0"), t.down("client-1")])
    try:
        # none retained: the fleet test may run on this broker afterwards
        server.publish(t.rounds, b"round for everybody")  # the bug: `topic read` reached anonymous clients only
        server.publish(t.down("client-1"), b"for client-1 only")
        server.publish(t.down("client-0"), b"sentinel")
        assert sorted(dev.received_until(b"sentinel")) == [(t.rounds, b"round for everybody")]

        dev.publish(t.up("client-1"), b"pretending to be client-1")
        dev.publish(t.presence("client-1"), b"offline")
        dev.publish(t.rounds, b"a forged round")
        dev.publish(t.up("client-0"), b"sentinel")
        # the server hears its own round announcement, and nothing the device had no right to write
        assert server.received_until(b"sentinel") == [(t.rounds, b"round for everybody")]
    finally:
        dev.stop()
        server.stop()


def test_a_last_will_on_another_devices_presence_never_reaches_the_server(deployment):
    """docs/PROTOCOL.md (presence): presence is trusted because, under the generated ACL, only the
    device itself (and the server) may write presence/<device>; a will set by another device's
    connection is refused at CONNECT or dropped when the broker publishes it."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.reasoncodes import ReasonCode

    t = Topics(FEDERATION)
    server = Peer(deployment, SERVER_USER, [t.all_up, t.all_presence])
    forger = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="acl-will-client-0", protocol=mqtt.MQTTv5)
    forger.username_pw_set("client-0", deployment.credentials["client-0"])
    forger.tls_set(ca_certs=str(deployment.ca))
    forger.will_set(t.presence("client-1"), b"offline", qos=1, retain=False)
    answered = threading.Event()
    forger.on_connect = lambda *args: answered.set()
    dev = None
    try:
        forger.connect("127.0.0.1", deployment.port, clean_start=True)
        forger.loop_start()
        answered.wait(10)
        if forger.is_connected():  # disconnect "with will message" (MQTT 5 reason 0x04): the broker publishes the will
            forger.disconnect(reasoncode=ReasonCode(PacketTypes.DISCONNECT, identifier=4))
        time.sleep(0.5)
        dev = Peer(deployment, "client-0", [])
        dev.publish(t.up("client-0"), b"sentinel")
        assert server.received_until(b"sentinel") == []
    finally:
        forger.loop_stop()
        if dev is not None:
            dev.stop()
        server.stop()


def test_a_fleet_runs_to_the_end_through_the_generated_broker(deployment, tmp_path):
    raw = method_config("fedavg", rounds=2)
    raw["fleet"] = {"groups": [{"model": "mlp", "count": len(DEVICES), "options": {"hidden": [32, 16]}}]}
    raw["network"] = {"federation": FEDERATION, "round_deadline_s": 30}
    raw["threads"] = 1
    config = tmp_path / "run.toml"
    config.write_text(RunConfig.model_validate(raw).to_toml())
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")}  # no device state from another run

    def start(args: list[str], user: str, name: str) -> subprocess.Popen:
        log = open(tmp_path / f"{name}.log", "w")
        return subprocess.Popen([*EDGEFL, *args, "--config", str(config), "--ca-file", str(deployment.ca)],
                                env={**env, "EDGEFL_MQTT_PASSWORD": deployment.credentials[user]},
                                stdout=log, stderr=subprocess.STDOUT, text=True)

    # the certificate names localhost and 127.0.0.1: the server connects by name, the devices by address
    run = tmp_path / "run"
    server = start(["server", "--broker", f"mqtts://localhost:{deployment.port}", "--username", SERVER_USER,
                    "--out", str(run)], SERVER_USER, "server")
    devices = {d: start(["client", "--broker", f"mqtts://127.0.0.1:{deployment.port}", "--device-id", d,
                         "--timeout", "90"], d, d) for d in DEVICES}
    try:
        codes = {d: p.wait(timeout=90) for d, p in devices.items()}
        server_code = server.wait(timeout=30)
    finally:
        for p in [server, *devices.values()]:
            if p.poll() is None:
                p.kill()
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in ["server", *DEVICES]}
    assert server_code == 0, logs["server"][-3000:]
    assert codes == dict.fromkeys(DEVICES, 0), {d: logs[d][-2000:] for d in DEVICES}
    assert "final accuracy" in logs["server"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rounds"] == 2 and not summary["failed_rounds"], summary
    rounds = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["round"], r["outcome"], sorted(r["reported"])) for r in rounds] == [(1, "complete", DEVICES), (2, "complete", DEVICES)]
