"""Fleet runs over a real mosquitto on a free loopback port: the envelope and chunking, the
server's validation (every bad upload answered with a nack, the loop survives), quorum and
deadlines with a dead device, and a fleet reproducing the simulation of the same config."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import threading
import time

import pytest
import torch

from edgefl.config import RunConfig
from edgefl.errors import PayloadError
from edgefl.messages import Message, encode
from edgefl.transport.chunks import Reassembler, split
from edgefl.transport.envelope import Envelope, pack, unpack
from edgefl.transport.link import BrokerAddress, Link
from edgefl.transport.topics import Topics
from tests.conftest import digits_config, flip_last
from tests.mosquitto import mosquitto

LIMIT = 64 << 20


def envelope(body: bytes = b"x" * 100, **kw) -> Envelope:
    return Envelope(kw.pop("type", "upload"), "fed", 1, kw.pop("sender", "client-0"), body, codec=kw.pop("codec", "none"), **kw)


# --- envelope ---------------------------------------------------------------------------------
def test_envelope_round_trips_and_checks_cheapest_first():
    env = envelope(b"payload", reply_to="abc", model_version=3)
    back = unpack(pack(env), LIMIT)
    assert (back.type, back.sender, back.body, back.reply_to, back.model_version) == ("upload", "client-0", b"payload", "abc", 3)
    data = pack(env)
    cases = {
        "exceeds": (data, 10),
        "bad magic": (b"PKL0" + data[4:], LIMIT),
        "version": (data[:4] + b"\x09" + data[5:], LIMIT),
        "truncated": (data[:6], LIMIT),
        "does not fit": (data[:-8][:20], LIMIT),
        "SHA-256": (flip_last(data), LIMIT),
        "bytes, the header says": (data + b"extra", LIMIT),
    }
    for expected, (blob, limit) in cases.items():
        with pytest.raises(PayloadError, match=expected):
            unpack(blob, limit)


def test_envelope_header_schema_is_enforced():
    good = envelope().header()
    for mutate, expected in [
        (lambda h: h.pop("sender"), "missing"),
        (lambda h: h.update(round="1"), "wrong type"),
        (lambda h: h.update(type="exec"), "unknown message type"),
        (lambda h: h.update(evil=1), "unknown header fields"),
        (lambda h: h.update(sender="x" * 65), "1-64"),
        (lambda h: h.update(round=True), "wrong type"),
    ]:
        h = json.loads(json.dumps(good))
        mutate(h)
        raw = json.dumps(h).encode()
        blob = b"EDFL\x01" + len(raw).to_bytes(4, "little") + raw + b"x" * 100
        with pytest.raises(PayloadError, match=expected):
            unpack(blob, LIMIT)


def test_pickle_bytes_are_never_unpickled():
    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('unpickled!')",))

    with pytest.raises(PayloadError):
        unpack(pickle.dumps(Boom()), LIMIT)


# --- chunks -----------------------------------------------------------------------------------
def test_chunks_survive_duplicates_and_any_order_and_report_what_is_missing():
    body = bytes(range(256)) * 9000  # ~2.3 MB
    env = envelope(body)
    pieces = split(env, chunk_bytes=256 << 10, threshold=512 << 10)
    assert len(pieces) == 9
    r = Reassembler(LIMIT)
    chunks = [unpack(p, LIMIT) for p in pieces]
    order = [8, 3, 3, 0, 5, 1, 7, 2, 2, 6]
    results = [r.add(chunks[i]) for i in order]
    assert all(x is None for x in results)
    assert r.missing("client-0", env.message_id) == [4]
    whole = r.add(chunks[4])
    assert unpack(whole, LIMIT).body == body
    assert r.add(chunks[0]) is None  # a late duplicate after completion starts nothing


def test_a_stale_partial_is_kept_until_the_resent_chunks_complete_it():
    """PROTOCOL.md section 5: the stale nack lists the missing chunks; resending exactly those
    completes the upload (the partial is kept), however long the device waited."""
    assert len(split(envelope(b"a" * 1000))) == 1
    env = envelope(b"b" * (3 << 20))
    pieces = [unpack(p, LIMIT) for p in split(env, chunk_bytes=1 << 20)]
    r = Reassembler(LIMIT, stale_s=5)
    r.add(pieces[0])
    r.add(pieces[2])
    reports = r.collect_stale(now=time.monotonic() + 10)
    assert reports == [("client-0", env.message_id, [1, 3], False)]
    assert r.add(pieces[1]) is None and r.add(pieces[3]) is not None


def test_a_partial_that_never_progresses_is_dropped_and_every_chunk_asked_for():
    env = envelope(b"b" * (3 << 20))
    pieces = [unpack(p, LIMIT) for p in split(env, chunk_bytes=1 << 20)]
    r = Reassembler(LIMIT, stale_s=5)
    r.add(pieces[0])
    now = time.monotonic()
    for strike in range(1, 4):
        assert r.collect_stale(now=now + 10 * strike)[0][2:] == ([1, 2, 3], False)
    assert r.collect_stale(now=now + 40) == [("client-0", env.message_id, [0, 1, 2, 3], True)]
    assert r.partial == {}
    assert all(r.add(p) is None for p in pieces[:3]) and r.add(pieces[3]) is not None


def test_chunk_lies_are_caught():
    pieces = [unpack(p, LIMIT) for p in split(envelope(b"c" * (3 << 20)), chunk_bytes=1 << 20)]
    r = Reassembler(1 << 20)
    with pytest.raises(PayloadError, match="exceeds"):
        r.add(pieces[0])  # the whole upload is larger than this side accepts
    r = Reassembler(LIMIT)
    r.add(pieces[0])
    forged = pieces[1]
    forged.extra["chunk"] = {**forged.extra["chunk"], "total_length": 5}
    with pytest.raises(PayloadError, match="disagrees"):
        r.add(forged)
    r = Reassembler(LIMIT)
    tampered = [unpack(p, LIMIT) for p in split(envelope(b"d" * (2 << 20)), chunk_bytes=1 << 20)]
    tampered[1].body = b"e" * len(tampered[1].body)
    for piece in tampered[:-1]:
        r.add(piece)
    with pytest.raises(PayloadError, match="SHA-256"):
        r.add(tampered[-1])


def test_topics_name_the_device_and_refuse_wildcards():
    t = Topics("fed-1")
    assert t.device_of(t.up("client-3")) == "client-3"
    assert t.device_of(t.presence("client-3")) == "client-3"
    assert t.device_of("edgefl/v1/other/dev/client-3/up") is None
    with pytest.raises(ValueError):
        Topics("a/#")


# --- against a real broker --------------------------------------------------------------------
def fleet_config(method="fedhe", rounds=2, **network) -> RunConfig:
    raw = digits_config(method, rounds=rounds)
    raw["fleet"] = {"groups": [
        {"model": "fedhe-cnn-0", "count": 2, "options": {"width": 0.125}},
        {"model": "mlp", "count": 2, "options": {"hidden": [32, 16]}},
    ]}
    raw["network"] = {"round_deadline_s": 60, **network}
    raw["threads"] = 1
    return RunConfig.model_validate(raw)


def test_a_fleet_reproduces_the_simulation_bit_for_bit(tmp_path, monkeypatch):
    import tempfile

    from edgefl.fleet.launcher import run_fleet
    from edgefl.sim import Simulation

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the fleet's temporary folder goes
    for method, keep in (("fedhe", False), ("fedavg", True)):
        cfg = fleet_config(method)
        sim = Simulation(cfg, show_progress=False).run()
        fleet = run_fleet(cfg, None, None, device_timeout_s=120, keep=keep)
        assert [h["outcome"] for h in fleet["history"]] == ["complete", "complete"]
        assert fleet["final_accuracy"]["per_client"] == sim["final_accuracy"]["per_client"], method
        assert fleet["final_accuracy"]["overall"] == sim["final_accuracy"]["overall"]
        assert set(fleet["device_exit_codes"].values()) == {0}
        # a clean run leaves no temporary folder behind; --keep keeps it, device logs included
        left = list(tmp_path.glob("edgefl-fleet-*"))
        assert (left == []) if not keep else (len(left) == 1 and fleet["logs"] == str(left[0] / "devices"))


def _server_thread(cfg, broker, results, join_timeout_s=3.0):
    from edgefl.fleet.launcher import serve

    # a short join wait: a device that joins later gets its download when it comes online
    started = results.setdefault("round_started", threading.Event())

    def target():
        try:
            results["summary"] = serve(cfg, broker, None, join_timeout_s=join_timeout_s,
                                       on_event=lambda kind, info: started.set() if kind == "round" else None)
        except BaseException as exc:  # surfaced by the test
            results["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t


def _device(cfg_path, broker, device, timeout=90):
    return subprocess.Popen([sys.executable, "-m", "edgefl", "client", "--broker", broker, "--config", str(cfg_path),
                             "--device-id", device, "--timeout", str(timeout)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_online(broker: str, federation: str, devices: list[str], timeout_s: float = 90) -> None:
    """Block until every device has said "online" (device processes import torch first: seconds)."""
    topics = Topics(federation)
    watcher = Link(BrokerAddress.parse(broker), f"watch-{federation}", [topics.all_presence]).start()
    seen: set[str] = set()
    end = time.monotonic() + timeout_s
    try:
        while not set(devices) <= seen and time.monotonic() < end:
            item = watcher.get(0.5)
            if item is not None and item.payload == b"online":
                seen.add(topics.device_of(item.topic))
    finally:
        watcher.stop(offline=False)
    assert set(devices) <= seen, f"devices never came online: {sorted(set(devices) - seen)}"


def test_quorum_closes_a_round_with_a_device_that_never_started_without_waiting_for_the_deadline(tmp_path):
    """A device never heard from is offline since the server began waiting for its devices: each
    round closes on quorum once its grace is over (it used to wait out the whole deadline)."""
    cfg = fleet_config("fedavg", rounds=2, round_deadline_s=30, quorum=0.75, federation="quorum-test")
    path = tmp_path / "run.toml"
    path.write_text(cfg.to_toml())
    with mosquitto(tmp_path) as broker:
        results: dict = {}
        procs = [_device(path, broker, f"client-{i}") for i in range(3)]  # client-3 never starts
        wait_online(broker, "quorum-test", ["client-0", "client-1", "client-2"])
        t = _server_thread(cfg, broker, results)
        t.join(timeout=120)
        for p in procs:
            p.wait(timeout=30)
    assert "error" not in results, results.get("error")
    history = results["summary"]["history"]
    assert [h["outcome"] for h in history] == ["offline", "offline"]
    assert all(h["missing"] == ["client-3"] and h["round_time_s"] < 20 for h in history), history
    assert all(h["receipts"]["client-3"].startswith("missing: offline") for h in history)
    assert results["summary"]["final_accuracy"] is not None


def test_a_round_below_quorum_fails_instead_of_waiting(tmp_path):
    cfg = fleet_config("fedavg", rounds=1, round_deadline_s=3, quorum=2, grace_s=2, federation="fail-test")
    with mosquitto(tmp_path) as broker:
        results: dict = {}
        t0 = time.monotonic()
        t = _server_thread(cfg, broker, results)  # no device at all
        t.join(timeout=60)
    assert "error" not in results, results.get("error")
    (h,) = results["summary"]["history"]
    assert h["outcome"] == "failed" and h["extended"] and h["reported"] == []
    assert h["failure"] == "no quorum by the deadline (0 of 2 needed reported, 4 selected)"  # a failed round says why
    assert time.monotonic() - t0 < 40
    assert results["summary"]["failed_rounds"] == [1]


def test_hostile_uploads_are_nacked_and_the_server_survives(tmp_path):
    """A rogue client (a raw MQTT connection) sends every kind of bad upload on client-1's topic and
    under other names; each is answered with a nack and the round still completes."""
    from edgefl.fleet.launcher import federation

    cfg = fleet_config("fedavg", rounds=1, round_deadline_s=40, federation="hostile-test")
    path = tmp_path / "run.toml"
    path.write_text(cfg.to_toml())
    topics = Topics(federation(cfg))
    with mosquitto(tmp_path) as broker:
        results: dict = {}
        procs = [_device(path, broker, f"client-{i}") for i in (0, 2, 3)]
        wait_online(broker, topics.federation, ["client-0", "client-2", "client-3"])
        t = _server_thread(cfg, broker, results)
        rogue = Link(BrokerAddress.parse(broker), "rogue", [topics.down("client-1")]).start()
        from edgefl.models import build_model

        real = build_model("fedhe-cnn-0", num_classes=10, input_shape=(1, 8, 8), width=0.125).state_dict()
        wrong_shape = {**real, next(iter(real)): torch.zeros(3)}
        nan = {k: v.clone() for k, v in real.items()}
        next(t for t in nan.values() if t.is_floating_point()).fill_(float("nan"))

        def upload(tensors, sender="client-1", round_no=1, body=None, num_samples=10, version=None, manifest=None):
            msg = Message("weights", round_no, sender, tensors or {}, {"num_samples": num_samples})
            blob = encode(msg) if body is None else body
            return pack(Envelope("upload", topics.federation, round_no, sender, blob, msg.message_id, codec="safetensors",
                                 model_version=round_no if version is None else version,
                                 extra={"tensors": manifest} if manifest is not None else {}))

        from edgefl.transport.envelope import tensor_manifest

        wrong_dtype = {k: (v.double() if v.is_floating_point() else v) for k, v in real.items()}
        lying = tensor_manifest(real)
        lying[next(iter(lying))][1] = [99]

        huge = {k: (v * 0 + 1e9 if v.is_floating_point() else v) for k, v in real.items()}

        bomb_header = json.dumps({"w": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 1 << 42]}}).encode()
        bomb = len(bomb_header).to_bytes(8, "little") + bomb_header + b"\0" * 16
        assert results["round_started"].wait(60)  # the round is open
        attempts = [
            b"JUNK" + upload(real)[4:],  # bad magic
            upload(real)[:30],  # truncated
            flip_last(upload(real)),  # body hash
            pickle.dumps({"w": 1}),  # pickle bytes
            upload(wrong_shape),
            upload(nan),
            upload(None, body=bomb),  # a header promising a terabyte
            upload(real, sender="client-2"),  # another device's name on this topic
            upload(huge),  # finite but absurd
            upload(real, num_samples=-5),
            upload(real, version=7),  # built on a model version the server never had
            upload(wrong_dtype),  # float64 where the model has float32
            upload(real, manifest=lying),  # the header's manifest disagrees with the body
        ]
        for blob in attempts:
            rogue.publish(topics.up("client-1"), blob)
        rogue.publish(topics.up("client-1"), upload(real, round_no=0))  # no such round
        rogue.publish(topics.up("client-1"), upload(real, round_no=1, num_samples=11))  # client-1's own: accepted
        time.sleep(5)
        nacks, acks = [], []
        while (item := rogue.get(0.2)) is not None:
            env = unpack(item.payload, LIMIT)
            if env.type == "nack":
                nacks.append(env.extra["reason"])
            elif env.type == "ack":
                acks.append(env.extra.get("status"))
        rogue.stop(offline=False)
        # the real client-1 comes up too, after the run ended: it waits for a next run until its timeout
        procs.append(_device(path, broker, "client-1", timeout=8))
        t.join(timeout=120)
        for p in procs:
            p.wait(timeout=30)
    assert "error" not in results, results.get("error")
    assert len(nacks) == len(attempts) + 1, nacks  # every bad upload was answered with a reason
    assert acks == ["accepted"]
    history = results["summary"]["history"][0]
    assert history["outcome"] == "complete" and history["reported"] == ["client-0", "client-1", "client-2", "client-3"]
    reasons = " | ".join(nacks)
    for fragment in ("bad magic", "truncated", "SHA-256", "NaN", "outside", "is not the topic's device", "expected",
                     "beyond", "num_samples", "model version", "rounds start at 1", "float64", "manifest"):
        assert fragment in reasons, fragment


# --- broker-config ---------------------------------------------------------------------------------
def _start_generated(made, tmp_path):
    from edgefl.fleet.broker import _wait_listening, mosquitto_binary

    binary = mosquitto_binary()
    if binary is None:
        pytest.skip("mosquitto is not installed")
    conf = tmp_path / "run.conf"
    conf.write_text(made.config.read_text() + "user root\n")  # the test runs as whoever runs it
    proc = subprocess.Popen([binary, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    port = int(next(line.split()[1] for line in made.config.read_text().splitlines() if line.startswith("listener")))
    _wait_listening(proc, port, 10, "mosquitto", conf)
    return proc, port


def test_broker_config_authenticates_devices_and_confines_them_to_their_topics(tmp_path):
    from edgefl.errors import EdgeflError
    from edgefl.fleet.broker import free_port
    from edgefl.fleet.broker_config import SERVER_USER, write_broker_config

    made = write_broker_config(tmp_path / "broker", 2, "fed", port=free_port(), tls=False, bind="127.0.0.1")  # loopback: a test
    creds = dict(line.split(",") for line in made.credentials.read_text().splitlines()[1:])
    assert set(creds) == {SERVER_USER, "client-0", "client-1"}
    assert (made.credentials.stat().st_mode & 0o777) == 0o600
    with pytest.raises(EdgeflError, match="already holds"):
        write_broker_config(tmp_path / "broker", 2, "fed")  # never overwrites credentials
    proc, port = _start_generated(made, tmp_path)
    url = f"mqtt://127.0.0.1:{port}"
    topics = Topics("fed")
    try:
        with pytest.raises(EdgeflError):
            Link(BrokerAddress.parse(url), "anon", [], None).start(timeout_s=3)
        with pytest.raises(EdgeflError):
            Link(BrokerAddress.parse(url), "client-0", [], None, username="client-0", password="wrong").start(timeout_s=3)
        server = Link(BrokerAddress.parse(url), SERVER_USER, [topics.all_up], None, username=SERVER_USER,
                      password=creds[SERVER_USER]).start()
        dev = Link(BrokerAddress.parse(url), "client-0", [topics.down("client-1")], None, username="client-0",
                   password=creds["client-0"]).start()
        dev.publish(topics.up("client-1"), b"pretending to be client-1")  # refused by the ACL
        dev.publish(topics.up("client-0"), b"my own topic")
        server.publish(topics.down("client-1"), b"for client-1 only")
        got = []
        # until the allowed message arrives (a loaded machine delayed it past a fixed 3 s), then a
        # little longer: the forged one, published first on the same connection, would come before it
        end = time.monotonic() + 20
        while time.monotonic() < end:
            item = server.get(0.2)
            if item is not None:
                got.append((item.topic, item.payload))
                if item.payload == b"my own topic":
                    end = min(end, time.monotonic() + 1.0)
        assert got == [(topics.up("client-0"), b"my own topic")]
        assert dev.get(0.5) is None  # client-0 cannot read client-1's downloads
        dev.stop(offline=False)
        server.stop(offline=False)
    finally:
        proc.terminate()
        proc.wait(timeout=5)


def test_broker_config_tls_listener_accepts_devices_that_trust_its_ca(tmp_path):
    import shutil as _shutil

    from edgefl.fleet.broker import free_port
    from edgefl.fleet.broker_config import write_broker_config

    if _shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    made = write_broker_config(tmp_path / "broker", 1, "fed", port=free_port(), tls=True, hostname="localhost", bind="127.0.0.1")
    creds = dict(line.split(",") for line in made.credentials.read_text().splitlines()[1:])
    proc, port = _start_generated(made, tmp_path)
    try:
        link = Link(BrokerAddress.parse(f"mqtts://localhost:{port}"), "client-0", [], None, username="client-0",
                    password=creds["client-0"], ca_file=str(made.certs / "ca.crt")).start()
        link.stop(offline=False)
    finally:
        proc.terminate()
        proc.wait(timeout=5)


def test_a_fleet_runs_on_the_embedded_broker_too(tmp_path):
    pytest.importorskip("amqtt")
    from edgefl.fleet.launcher import run_fleet
    from edgefl.sim import Simulation

    cfg = fleet_config("fedavg", rounds=1)
    sim = Simulation(cfg, show_progress=False).run()
    fleet = run_fleet(cfg, None, None, device_timeout_s=120, broker_kind="embedded")
    assert fleet["history"][0]["outcome"] == "complete"
    assert fleet["final_accuracy"]["overall"] == sim["final_accuracy"]["overall"]


# --- server state (every method's save and restore: tests/test_every_method.py) ---------------------
def test_a_killed_server_resumes_where_it_stopped(tmp_path):
    import signal

    from edgefl.sim import Simulation

    cfg = fleet_config("fedavg", rounds=3, federation="resume-test")
    path = tmp_path / "run.toml"
    path.write_text(cfg.to_toml())
    out = tmp_path / "run"
    with mosquitto(tmp_path) as broker:
        procs = [_device(path, broker, f"client-{i}", timeout=180) for i in range(4)]
        wait_online(broker, "resume-test", [f"client-{i}" for i in range(4)])
        server_cmd = [sys.executable, "-m", "edgefl", "server", "--broker", broker, "--config", str(path), "--out", str(out)]
        first = subprocess.Popen(server_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        metrics = out / "metrics.jsonl"
        end = time.monotonic() + 120
        while time.monotonic() < end and not (metrics.exists() and (out / "server-state.safetensors").exists()):
            time.sleep(0.1)
        first.send_signal(signal.SIGKILL)  # mid-run: round 1 saved, round 2 under way
        first.wait(timeout=10)
        done_before = len(metrics.read_text().splitlines())
        assert 1 <= done_before < 3
        second = subprocess.run([*server_cmd, "--resume"], capture_output=True, text=True, timeout=180)
        assert second.returncode == 0, second.stderr[-2000:]
        assert "resuming at round" in second.stderr
        for p in procs:
            p.wait(timeout=60)
    rounds = [json.loads(line)["round"] for line in metrics.read_text().splitlines()]
    assert rounds == [1, 2, 3]
    fleet_final = json.loads(metrics.read_text().splitlines()[-1])["accuracy"]
    sim_final = Simulation(cfg, show_progress=False).run()["final_accuracy"]
    assert fleet_final["overall"] == sim_final["overall"]


# --- faults ----------------------------------------------------------------------------------------
def _run_with_fault(tmp_path, cfg, fault, devices=4, expect_devices_exit=True):
    """Run ``cfg`` with its server in a thread, device processes, and a persistent mosquitto that
    ``fault(event, info, broker_box)`` may stop and restart from the server's event stream."""
    from edgefl.fleet.broker import start_mosquitto
    from edgefl.fleet.launcher import serve

    path = tmp_path / "run.toml"
    path.write_text(cfg.to_toml())
    box = {"broker": start_mosquitto(tmp_path / "broker", persistence=True)}
    url = box["broker"].url
    procs = [_device(path, url, f"client-{i}", timeout=150) for i in range(devices)]
    box["procs"] = procs
    results: dict = {}
    try:
        wait_online(url, cfg.network.federation, [f"client-{i}" for i in range(devices)])

        def on_event(kind, info):
            fault(kind, info, box)

        results["summary"] = serve(cfg, url, None, on_event=on_event, join_timeout_s=5)
        if expect_devices_exit:
            for p in procs:
                p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        box["broker"].stop()
    return results["summary"]


@pytest.mark.parametrize("kill", [False, True], ids=["SIGTERM", "SIGKILL"])
def test_a_broker_restarted_mid_round_does_not_break_the_run(tmp_path, kill):
    from edgefl.fleet.broker import start_mosquitto
    from edgefl.sim import Simulation

    cfg = fleet_config("fedavg", rounds=2, round_deadline_s=90, ack_timeout_s=2, federation=f"restart-{int(kill)}")

    def fault(kind, info, box):
        if kind == "upload" and not box.get("restarted"):
            box["restarted"] = True
            old = box["broker"]

            def restart():
                old.stop(kill=kill)  # SIGKILL loses what was queued; SIGTERM saves it
                time.sleep(1.0)
                box["broker"] = start_mosquitto(old.config_path.parent, port=old.port, persistence=True)

            threading.Thread(target=restart, daemon=True).start()

    restarted = []
    summary = _run_with_fault(tmp_path, cfg, lambda kind, info, box: (fault(kind, info, box), restarted.append(box.get("restarted"))))
    assert any(restarted), "the broker was never restarted"
    assert [h["outcome"] for h in summary["history"]] == ["complete", "complete"]
    assert summary["final_accuracy"]["overall"] == Simulation(cfg, show_progress=False).run()["final_accuracy"]["overall"]


def test_a_frozen_device_goes_offline_by_its_last_will_and_the_round_closes_on_quorum(tmp_path):
    import signal

    cfg = fleet_config("fedavg", rounds=1, round_deadline_s=20, quorum=0.75, keepalive_s=2, federation="frozen")
    seen = []

    def fault(kind, info, box):
        seen.append((kind, info.get("device"), info.get("online")))
        if kind == "round":
            box["procs"][3].send_signal(signal.SIGSTOP)  # frozen: no keep-alive, no upload

    summary = _run_with_fault(tmp_path, cfg, fault, expect_devices_exit=False)
    (h,) = summary["history"]
    assert h["outcome"] == "offline" and h["missing"] == ["client-3"]  # closed when its last will had stood offline_grace_s, before the deadline
    assert ("presence", "client-3", False) in seen  # the broker published its last will


def test_a_device_offline_when_its_round_starts_gets_the_queued_download(tmp_path):
    from edgefl.sim import Simulation

    cfg = fleet_config("fedavg", rounds=2, round_deadline_s=60, federation="offline")
    path = tmp_path / "run.toml"

    def fault(kind, info, box):
        if kind == "closed" and info["round"] == 1:
            victim = box["procs"][2]
            victim.kill()  # gone before round 2 is announced...
            victim.wait()
            box["restart_at"] = time.monotonic() + 3

            def back():
                time.sleep(3)  # ...and back after its download was queued in its session
                box["procs"][2] = _device(path, box["broker"].url, "client-2", timeout=120)

            threading.Thread(target=back, daemon=True).start()

    summary = _run_with_fault(tmp_path, cfg, fault)
    assert [h["outcome"] for h in summary["history"]] == ["complete", "complete"]
    assert summary["final_accuracy"]["overall"] == Simulation(cfg, show_progress=False).run()["final_accuracy"]["overall"]


def test_a_hundred_connections_come_back_after_a_broker_restart(tmp_path):
    from edgefl.fleet.broker import start_mosquitto

    broker = start_mosquitto(tmp_path / "broker", persistence=True)
    topics = Topics("herd")
    links = [Link(BrokerAddress.parse(broker.url), f"herd-{i:03d}", [topics.down(f"d{i}")], topics.presence(f"d{i}")).start()
             for i in range(100)]
    try:
        first = [link.connect_count for link in links]
        broker.stop(kill=True)
        time.sleep(0.5)
        broker = start_mosquitto(tmp_path / "broker", port=broker.port, persistence=True)
        end = time.monotonic() + 60
        while time.monotonic() < end and not all(link.connect_count > c for link, c in zip(links, first)):
            time.sleep(0.2)
        back = sum(link.connect_count > c for link, c in zip(links, first))
        assert back == 100, f"{back} of 100 reconnected"
    finally:
        for link in links:
            link.stop(offline=False)
        broker.stop()


def test_a_device_refuses_a_payload_larger_than_the_broker_takes(tmp_path):
    from edgefl.errors import EdgeflError

    with mosquitto(tmp_path) as broker:
        link = Link(BrokerAddress.parse(broker), "small", [], None, max_packet_bytes=1 << 20).start()
        try:
            with pytest.raises(EdgeflError, match="refusing to publish"):
                link.publish("edgefl/v1/x/dev/small/up", b"\0" * (2 << 20))
        finally:
            link.stop(offline=False)


def test_edgefl_fleet_command_runs_an_example_and_writes_its_run_directory(tmp_path):
    from pathlib import Path

    example = Path(__file__).parent.parent / "examples" / "fedhe_digits_quick.toml"
    out = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "edgefl", "fleet", str(example), "--set", "rounds=1", "--set", "threads=1",
                          "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "round 1 complete" in res.stderr and "final accuracy" in res.stdout
    assert json.loads((out / "summary.json").read_text())["runner"] == "fleet"
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1
    # FedHe keeps a model per device: each device wrote its own when the run ended, and the local
    # fleet copied them into the run directory as a simulation saves them, bit for bit the same
    from safetensors.torch import load_file

    from edgefl.config import load_config
    from edgefl.exporters import sources_from_path
    from edgefl.rundir import RunDir
    from edgefl.sim import Simulation

    plan = json.loads((out / "ship.json").read_text())
    assert plan["kind"] != "global" and all(entry["file"] and "where" not in entry for entry in plan["models"].values())
    assert all(pick["file"] == plan["models"][pick["arch"]]["file"] for pick in plan["phones"].values() if pick["arch"])
    assert json.loads((out / "summary.json").read_text())["ship"] == plan
    assert {s.name for s in sources_from_path(out)} == {Path(e["file"]).stem for e in plan["models"].values()}
    cfg = load_config(example, ["rounds=1", "threads=1"])
    Simulation(cfg, show_progress=False, run_dir=RunDir.create(tmp_path / "sim", cfg.name, cfg.seed)).run()
    fleet_files = sorted(f.name for f in (out / "models").glob("*.safetensors"))
    assert fleet_files == sorted(f.name for f in (tmp_path / "sim" / "models").glob("*.safetensors"))
    for name in fleet_files:
        fleet, sim = load_file(str(out / "models" / name)), load_file(str(tmp_path / "sim" / "models" / name))
        assert fleet.keys() == sim.keys() and all(fleet[k].equal(sim[k]) for k in fleet), name


def test_a_one_shot_fedmho_fleet_matches_its_simulation(tmp_path):
    from edgefl.fleet.launcher import run_fleet
    from edgefl.sim import Simulation
    from tests.test_fedmho import fedmho_config

    raw = fedmho_config("fedmho-sd")
    raw["threads"] = 1
    cfg = RunConfig.model_validate(raw)
    sim = Simulation(cfg, show_progress=False).run()
    fleet = run_fleet(cfg, None, None, device_timeout_s=120)
    (h,) = fleet["history"]
    assert h["outcome"] == "complete" and h["server"]["fused"]
    assert fleet["final_accuracy"]["overall"] == sim["final_accuracy"]["overall"]


def test_a_device_dying_mid_upload_leaves_a_partial_that_is_collected_and_the_round_closes(tmp_path):
    """client-3 sends the first of its upload's chunks and dies (a raw connection that stops): the
    server drops the stale partial upload, nacks it with the missing chunks, and closes on quorum."""
    from edgefl.fleet.launcher import federation

    cfg = fleet_config("fedavg", rounds=1, round_deadline_s=12, quorum=0.75, stale_upload_s=2, federation="midupload")
    path = tmp_path / "run.toml"
    path.write_text(cfg.to_toml())
    topics = Topics(federation(cfg))
    seen = []
    with mosquitto(tmp_path) as broker:
        procs = [_device(path, broker, f"client-{i}") for i in range(3)]
        wait_online(broker, topics.federation, ["client-0", "client-1", "client-2"])
        dying = Link(BrokerAddress.parse(broker), "dying-3", [topics.down("client-3")], topics.presence("client-3")).start()
        results: dict = {}
        t = threading.Thread(target=lambda: results.update(summary=__import__("edgefl.fleet.launcher", fromlist=["serve"]).serve(
            cfg, broker, None, join_timeout_s=3, on_event=lambda k, i: seen.append((k, i)))), daemon=True)
        t.start()
        time.sleep(3)
        msg = Message("weights", 1, "client-3", {"w": torch.zeros(600_000)}, {"num_samples": 10})
        pieces = split(Envelope("upload", topics.federation, 1, "client-3", encode(msg), msg.message_id,
                                model_version=1, codec="safetensors"), chunk_bytes=1 << 20)
        assert len(pieces) == 3
        dying.publish(topics.up("client-3"), pieces[0])
        time.sleep(6)  # longer than stale_upload_s: the partial is collected
        nacks = []
        while (item := dying.get(0.2)) is not None:
            env = unpack(item.payload, LIMIT)
            if env.type == "nack":
                nacks.append(env)
        dying.stop(offline=False)
        t.join(timeout=60)
        for p in procs:
            p.wait(timeout=30)
    (h,) = results["summary"]["history"]
    assert h["outcome"] == "deadline" and h["missing"] == ["client-3"]
    stale = [n for n in nacks if n.reply_to == msg.message_id]
    assert stale and stale[0].extra["missing"] == [1, 2]


# --- command-line failure paths (no broker needed: each fails before connecting) -------------------
def _edgefl(*args, timeout=120):
    # wide lines: rich wraps at 80 columns without a terminal, and where a message containing a
    # temporary path wraps depends on that path's length
    return subprocess.run([sys.executable, "-m", "edgefl", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "400"})


def test_cli_broker_config_writes_a_configuration_and_never_overwrites_one(tmp_path):
    out = tmp_path / "broker"
    res = _edgefl("broker-config", "--devices", "3", "--out", str(out), "--no-tls", "--federation", "lab")
    assert res.returncode == 0, res.stderr
    assert {"mosquitto.conf", "passwords", "acl", "credentials.csv"} <= {p.name for p in out.iterdir()}
    assert "listener 8883\n" in (out / "mosquitto.conf").read_text() and "every interface" in res.stdout  # the documented default
    local = _edgefl("broker-config", "--devices", "1", "--out", str(tmp_path / "local"), "--no-tls", "--bind", "127.0.0.1")
    assert local.returncode == 0 and "listener 8883 127.0.0.1\n" in (tmp_path / "local" / "mosquitto.conf").read_text()
    odd = _edgefl("broker-config", "--devices", "1", "--out", str(tmp_path / "odd"), "--no-tls", "--bind", "0.0.0.0\nallow_anonymous true")
    assert odd.returncode == 2 and "not an IP address or a host name" in odd.stderr and not (tmp_path / "odd").exists()
    assert "edgefl/v1/lab/dev/%u/up" in (out / "acl").read_text()
    again = _edgefl("broker-config", "--devices", "3", "--out", str(out), "--no-tls")
    assert again.returncode == 2 and "already holds a broker configuration" in again.stderr
    bad = _edgefl("broker-config", "--devices", "0", "--out", str(tmp_path / "other"), "--no-tls")
    assert bad.returncode == 2 and "at least 1" in bad.stderr
    wild = _edgefl("broker-config", "--devices", "1", "--out", str(tmp_path / "w"), "--federation", "a/#")
    assert wild.returncode == 2 and "federation 'a/#'" in wild.stderr and "Traceback" not in wild.stderr


def test_cli_client_refuses_a_device_id_outside_the_fleet(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(fleet_config("fedavg").to_toml())
    res = _edgefl("client", "--broker", "mqtt://127.0.0.1:9", "--config", str(path), "--device-id", "client-99")
    assert res.returncode == 2 and "client-99" in res.stderr and "client-0 .. client-3" in res.stderr


def test_cli_server_resume_needs_the_interrupted_run(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(fleet_config("fedavg").to_toml())
    no_out = _edgefl("server", "--broker", "mqtt://127.0.0.1:9", "--config", str(path), "--resume")
    assert no_out.returncode == 2 and "--resume needs --out" in no_out.stderr
    (tmp_path / "empty").mkdir()
    nothing = _edgefl("server", "--broker", "mqtt://127.0.0.1:9", "--config", str(path), "--resume", "--out", str(tmp_path / "empty"))
    assert nothing.returncode == 2 and "nothing to resume" in nothing.stderr  # refused before any connection


def test_cli_client_says_when_the_broker_is_unreachable(tmp_path):
    from edgefl.fleet.broker import free_port

    path = tmp_path / "run.toml"
    path.write_text(fleet_config("fedavg").to_toml())
    res = _edgefl("client", "--broker", f"mqtt://127.0.0.1:{free_port()}", "--config", str(path), "--device-id", "client-0")
    assert res.returncode == 2 and "cannot reach the broker" in res.stderr
    bad_url = _edgefl("client", "--broker", "http://x", "--config", str(path), "--device-id", "client-0")
    assert bad_url.returncode == 2 and "expected mqtt://HOST:PORT" in bad_url.stderr


def test_a_server_that_cannot_reach_its_broker_leaves_nothing_that_blocks_its_rerun(tmp_path):
    from edgefl.fleet.broker import free_port
    from edgefl.rundir import RunDir

    path = tmp_path / "run.toml"
    path.write_text(fleet_config("fedavg").to_toml())
    out = tmp_path / "run"
    command = ("server", "--broker", f"mqtt://127.0.0.1:{free_port()}", "--config", str(path), "--out", str(out))
    for _ in range(2):  # the same command twice: the same error, never "already exists"
        res = _edgefl(*command)
        assert res.returncode == 2 and "cannot reach the broker" in res.stderr, res.stderr
        assert "removed the run directory" in res.stderr and not out.exists()
    # --overwrite replaces a run directory that recorded no round (one stopped before round 1)...
    RunDir.create(out, "x", 0).write_json("run.json", {})
    res = _edgefl(*command, "--overwrite")
    assert "cannot reach the broker" in res.stderr and not out.exists()
    # ...but never one with rounds, nor a folder that is not a run directory
    RunDir.create(out, "x", 0).append_metrics({"round": 1})
    res = _edgefl(*command, "--overwrite")
    assert res.returncode == 2 and "1 round(s) in metrics.jsonl: it is never replaced" in res.stderr
    assert (out / "metrics.jsonl").is_file()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    res = _edgefl(*command[:-1], str(tmp_path / "mine"), "--overwrite")
    assert res.returncode == 2 and "notes.txt, which no run writes" in res.stderr and (tmp_path / "mine" / "notes.txt").is_file()


class _MisbehavingBroker:
    """A TCP listener speaking just enough MQTT (3.1.1 and 5) to accept a connection, then either
    never acknowledging a subscription or refusing it (a SUBACK failure code): what a broker
    enforcing read ACLs that way (EMQX, HiveMQ) or a stuck one does, and mosquitto never does."""

    def __init__(self, suback: bytes | None, then: bytes | None = None) -> None:
        import socket

        self.suback = suback  # the SUBACK's reason code, None: no SUBACK at all
        # given: the first connection is closed after its first SUBACK, and later ones answer `then`
        # (a broker whose ACL changed while a device ran, seen at the device's reconnect)
        self.then = then
        self.connections = 0
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._client, args=(conn,), daemon=True).start()

    def _client(self, conn) -> None:
        def read(n: int) -> bytes:
            data = b""
            while len(data) < n:
                chunk = conn.recv(n - len(data))
                if not chunk:
                    raise OSError("closed")
                data += chunk
            return data

        v5 = False
        self.connections += 1
        suback, drop = (self.suback, self.then is not None) if self.connections == 1 else (self.then or self.suback, False)
        with conn:
            try:
                while True:
                    kind = read(1)[0] >> 4
                    length, shift = 0, 0
                    while True:
                        byte = read(1)[0]
                        length |= (byte & 0x7F) << shift
                        shift += 7
                        if not byte & 0x80:
                            break
                    body = read(length)
                    if kind == 1:  # CONNECT: protocol level after the "MQTT" name
                        v5 = body[6] == 5
                        conn.sendall(b"\x20\x03\x00\x00\x00" if v5 else b"\x20\x02\x00\x00")
                    elif kind == 8 and suback is not None:  # SUBSCRIBE: its packet id first
                        reply = body[:2] + (b"\x00" if v5 else b"") + suback
                        conn.sendall(bytes([0x90, len(reply)]) + reply)
                        if drop:
                            time.sleep(0.3)
                            return
                    elif kind == 12:  # PINGREQ
                        conn.sendall(b"\xd0\x00")
                    elif kind == 14:  # DISCONNECT
                        return
            except OSError:
                return

    def close(self) -> None:
        self.server.close()


def test_a_link_whose_subscription_is_never_acknowledged_or_refused_says_so():
    """start() waits for SUBACK: a broker that accepts the connection and never sends one is said
    so within the timeout, naming the topics still waiting, and one that refuses subscriptions is an
    ACL to fix, not to wait for: every refused topic is named, and a device does not retry it."""
    from edgefl.errors import BrokerUnreachable, EdgeflError, SubscriptionsUnconfirmed
    from edgefl.fleet.launcher import connect_retrying

    for protocol, refusal in (("5", b"\x87"), ("3.1.1", b"\x80")):
        silent = _MisbehavingBroker(suback=None)
        try:
            link = Link(BrokerAddress.parse(f"mqtt://127.0.0.1:{silent.port}"), "dev-0", ["fed/down/dev-0", "fed/x"], None,
                        protocol=protocol)
            with pytest.raises(SubscriptionsUnconfirmed, match="accepted dev-0 but did not acknowledge its subscription.s. to "
                                                               "fed/down/dev-0, fed/x within 2 s") as unconfirmed:
                link.start(timeout_s=2)
            assert "check its log and its ACL" in unconfirmed.value.hint
            # a device giving up on it keeps that hint (not "check that the fleet's broker runs": it runs)
            with pytest.raises(SubscriptionsUnconfirmed) as given_up:
                again = Link(BrokerAddress.parse(f"mqtt://127.0.0.1:{silent.port}"), "dev-1", ["fed/y"], None, protocol=protocol)
                connect_retrying(lambda: again.start(timeout_s=1), wait_s=0, say=lambda line: None)  # noqa: B023 (called at once)
            assert "check its log and its ACL" in given_up.value.hint
        finally:
            silent.close()
        refusing = _MisbehavingBroker(suback=refusal)
        try:
            link = Link(BrokerAddress.parse(f"mqtt://127.0.0.1:{refusing.port}"), "dev-0", ["fed/down/dev-0", "fed/x"], None,
                        protocol=protocol)
            with pytest.raises(EdgeflError, match=r"refused dev-0's subscription\(s\) to fed/down/dev-0 \(.+\); fed/x \(") as refused:
                link.start(timeout_s=5)
            assert not isinstance(refused.value, BrokerUnreachable)  # a device waiting for its broker must not retry it
            assert "ACL" in refused.value.hint
        finally:
            refusing.close()


def test_a_subscription_refused_on_a_reconnect_mid_run_is_logged(caplog):
    """start() raises a refusal; after it returned (a reconnect mid-run) there is nobody to raise
    to, so the refusal is logged as an error naming the topic and the ACL, and the link stays up."""
    import logging

    for protocol, refusal in (("5", b"\x87"), ("3.1.1", b"\x80")):
        broker = _MisbehavingBroker(suback=b"\x01", then=refusal)
        link = Link(BrokerAddress.parse(f"mqtt://127.0.0.1:{broker.port}"), f"dev-{protocol}", ["fed/down/dev-0"], None,
                    protocol=protocol)
        try:
            with caplog.at_level(logging.ERROR, logger="edgefl.transport"):
                link.start(timeout_s=5)  # granted on the first connection
                assert link.subscriptions_refused == []
                deadline = time.monotonic() + 15  # the broker drops it; paho reconnects within its 1-3 s floor
                while time.monotonic() < deadline and not link.subscriptions_refused:
                    time.sleep(0.1)
            assert broker.connections >= 2 and link.subscriptions_refused and "fed/down/dev-0" in link.subscriptions_refused[0]
            said = [r.getMessage() for r in caplog.records if "on reconnecting" in r.getMessage()]
            assert said and f"refused dev-{protocol}'s subscription to fed/down/dev-0" in said[0] and "ACL" in said[0], said
        finally:
            link.stop(offline=False)
            broker.close()
        caplog.clear()


def test_a_link_drops_what_a_resumed_sessions_old_subscriptions_bring(tmp_path):
    """MQTT 3.1.1 always resumes a client id's session, with the subscriptions an earlier MQTT 5
    process of it made (a device's own presence topic): a device then refused its own "online" as a
    truncated envelope, in its log, every time. What this link did not subscribe to is dropped."""
    with mosquitto(tmp_path) as broker:
        address = BrokerAddress.parse(broker)
        first = Link(address, "edgefl-f-client-0", ["f/down/client-0"], "f/presence/client-0", yield_session=True,
                     session_expiry_s=600).start()
        first.stop()
        second = Link(address, "edgefl-f-client-0", ["f/down/client-0"], "f/presence/client-0", protocol="3.1.1").start()
        talker = Link(address, "talker", [], None).start()
        try:
            talker.publish("f/presence/client-0", b"online", retain=True)
            talker.publish("f/down/client-0", b"for it")
            item = second.get(10.0)
            assert item is not None and (item.topic, item.payload) == ("f/down/client-0", b"for it")
            assert second.get(1.0) is None  # (its own presence, from the resumed subscription, is not handed up)
        finally:
            talker.stop(offline=False)
            second.stop(offline=False)


def test_a_started_link_has_its_subscriptions_acknowledged(tmp_path):
    """start() returns after the broker's SUBACK, not at CONNACK: a message published the moment
    after reaches it (one published between the two was lost on a loaded machine)."""
    with mosquitto(tmp_path) as broker:
        address = BrokerAddress.parse(broker)
        for protocol in ("5", "3.1.1"):
            listener = Link(address, f"listener-{protocol}", ["t/#", "u/x"], None, protocol=protocol).start()
            talker = Link(address, f"talker-{protocol}", [], None, protocol=protocol).start()
            try:
                assert listener.subscribed.is_set() and talker.subscribed.is_set()  # (no subscription: nothing to wait for)
                talker.publish("t/a", b"at once")
                item = listener.get(10.0)
                assert item is not None and (item.topic, item.payload) == ("t/a", b"at once")
            finally:
                talker.stop(offline=False)
                listener.stop(offline=False)
