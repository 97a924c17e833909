"""Devices under continuous forged server traffic on a real mosquitto (the soak of test_soak.py,
aimed at devices): with signing on, the run ends with the fault-free numbers; without it, every
device process survives (no traceback, no crash) and the run completes or fails with reasons."""

from __future__ import annotations

import math
import random
import subprocess
import sys
import threading

import torch

from edgefl.messages import Message, decode, encode
from edgefl.rundir import RunDir
from edgefl.transport.envelope import Envelope, pack, unpack
from edgefl.transport.link import BrokerAddress, Link
from edgefl.transport.signing import write_keypair
from edgefl.transport.topics import Topics
from tests.mosquitto import mosquitto
from tests.test_fleet import fleet_config, wait_online
from tests.test_soak import flood_until

IDS = [f"client-{i}" for i in range(4)]


def forged_server_stream(topics: Topics, rng: random.Random, captured: list[bytes]):
    """(topic, payload, retain) forever, as an attacker with publish rights writes them: garbage,
    plausible next-round downloads (NaN, wrong shapes, right shapes), forged acks and nacks, a forged
    end of the run, chunk bombs that never complete, replays of the server's real downloads."""
    fed = topics.federation
    while True:
        device = rng.choice(IDS)
        down = topics.down(device)
        r = rng.randrange(1, 5)
        kind = rng.randrange(9)
        if kind == 0:
            yield down, rng.randbytes(rng.randrange(1, 300)), False
        elif kind == 1:
            bad = Message("weights", r, "server", {"w": torch.full((3,), math.nan)})
            yield down, pack(Envelope("download", fed, r, "server", encode(bad), model_version=r, codec="safetensors",
                                      extra={"info": {"run": "forged"}})), False
        elif kind == 2 and captured:
            original = unpack(rng.choice(captured), 1 << 30)  # the server's real download, its weights poisoned
            real = decode(original.body).tensors if original.codec == "safetensors" else {}
            tensors = {k: v.clone().fill_(1e30) if v.is_floating_point() else v for k, v in real.items()}
            body = encode(Message("weights", original.round + 1, "server", tensors))
            yield down, pack(Envelope("download", fed, original.round + 1, "server", body, model_version=original.round + 1,
                                      codec="safetensors", extra=dict(original.extra))), False
        elif kind == 3:
            yield down, pack(Envelope(rng.choice(["ack", "nack"]), fed, r, "server", reply_to="0" * 32, model_version=r,
                                      extra={"status": "accepted"} if rng.random() < 0.5 else {"reason": "forged", "missing": [0, 1]})), False
        elif kind == 4:
            yield topics.rounds, pack(Envelope("round", fed, r, "server", model_version=r,
                                               extra={"info": {"done": True, "run": "forged", "rounds": 3}})), False
        elif kind == 5:
            chunk = {"upload_id": f"u{rng.randrange(100)}", "seq": 0, "count": 50, "total_length": 50 * 4096, "total_sha256": "0" * 64}
            yield down, pack(Envelope("chunk", fed, r, "server", b"z" * 4096, codec="none", extra={"chunk": chunk})), False
        elif kind == 6 and captured:
            yield down, rng.choice(captured), False  # an exact replay
        elif kind == 7:
            yield down, pack(Envelope("evaluate", fed, r, "server", encode(Message("weights", r + 1, "server", {"x": torch.ones(2)})),
                                      model_version=r, codec="safetensors")), False
        else:
            yield down, pack(Envelope("download", fed, r, "server", b"", model_version=r, codec="none")), False


def _soak(tmp_path, federation: str, signed: bool, deadline_s: float):
    from edgefl.fleet.launcher import serve

    cfg = fleet_config("fedavg", rounds=3, round_deadline_s=deadline_s, federation=federation)
    path = tmp_path / "run.toml"
    path.write_text(cfg.to_toml())
    topics = Topics(federation)
    key, pub = write_keypair(tmp_path) if signed else (None, None)
    sent = {"count": 0}
    with mosquitto(tmp_path) as broker:
        logs = {d: open(tmp_path / f"{d}.log", "w+") for d in IDS}  # a file: a pipe nobody reads would block a chatty device
        procs = {d: subprocess.Popen([sys.executable, "-m", "edgefl", "client", "--broker", broker, "--config", str(path), "--device-id", d,
                                      "--timeout", "200", *(["--server-key", str(pub)] if signed else [])],
                                     stdout=subprocess.DEVNULL, stderr=logs[d], text=True) for d in IDS}
        wait_online(broker, federation, IDS)
        attacker = Link(BrokerAddress.parse(broker), f"attacker-{federation}", [f"{topics.base}/dev/+/down"]).start()
        captured: list[bytes] = []
        stop = threading.Event()

        def attack():  # the server's real downloads are kept, to replay and poison
            flood_until(stop, attacker, forged_server_stream(topics, random.Random(11), captured), sent, captured, "download", 30, 0.002)

        flood = threading.Thread(target=attack, daemon=True)
        flood.start()
        run = RunDir.create(tmp_path / "out", cfg.name, cfg.seed)
        try:
            summary = serve(cfg, broker, run, join_timeout_s=10, signing_key=key)
        finally:
            stop.set()
            flood.join(timeout=10)
            attacker.stop(offline=False)
        outcome = {}
        for d, p in procs.items():
            try:
                code = p.wait(timeout=90)
            except subprocess.TimeoutExpired:
                p.kill()
                code = "hung"
            logs[d].seek(0)
            outcome[d] = (code, logs[d].read())
            logs[d].close()
    return cfg, summary, outcome, sent["count"]


def test_with_signing_forged_server_traffic_changes_nothing(tmp_path):
    from edgefl.sim import Simulation

    cfg, summary, outcome, sent = _soak(tmp_path, "dsoak-signed", signed=True, deadline_s=60)
    assert sent > 100
    for device, (code, stderr) in outcome.items():
        assert code == 0 and "Traceback" not in stderr, f"{device}: {stderr[-2000:]}"
        assert "refusing a message" in stderr  # the forgeries reached it and were refused
    assert [h["outcome"] for h in summary["history"]] == ["complete"] * 3
    fault_free = Simulation(cfg, show_progress=False).run()
    assert summary["final_accuracy"] == fault_free["final_accuracy"]


def test_without_signing_every_device_survives_and_the_run_ends_with_reasons(tmp_path):
    cfg, summary, outcome, sent = _soak(tmp_path, "dsoak-open", signed=False, deadline_s=15)
    assert sent > 100
    for device, (code, stderr) in outcome.items():
        assert code in (0, 3) and "Traceback" not in stderr, f"{device}: exit {code}: {stderr[-2000:]}"
    history = summary["history"]
    assert len(history) == 3  # every round was played to an outcome
    for h in history:
        # offline: every device still out had gone offline (one that took a forged end of the run and left)
        assert h["outcome"] in ("complete", "deadline", "offline", "failed")
        if h["outcome"] != "complete":
            assert all(r for r in h["receipts"].values())  # each device's receipt says why
