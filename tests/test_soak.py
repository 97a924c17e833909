"""A fleet run under continuous hostile traffic on a real mosquitto ends with the numbers of the same
run without it, and its metrics keep a bounded summary of what was refused."""

from __future__ import annotations

import json
import random
import threading
import time

from edgefl.transport.envelope import PREFIX, Envelope, pack, unpack
from edgefl.transport.link import BrokerAddress, Link
from edgefl.transport.topics import Topics
from tests.mosquitto import mosquitto
from tests.test_fleet import _device, fleet_config, wait_online


def hostile_stream(topics: Topics, rng: random.Random, captured: list[bytes]):
    """(topic, payload, retain) forever: garbage, oversized, replays, spoofed senders, strangers,
    chunk bombs, deep JSON, retained poison."""
    fed = topics.federation
    devices = [f"client-{i}" for i in range(4)]
    while True:
        device = rng.choice(devices)
        kind = rng.randrange(9)
        if kind == 0:
            yield topics.up(device), rng.randbytes(rng.randrange(1, 400)), False
        elif kind == 1:
            yield topics.up(device), b"EDFL\x01" + rng.randbytes(300_000), False  # oversized junk
        elif kind == 2 and captured:
            original = rng.choice(captured)  # an exact replay of a device's real upload
            yield topics.up(unpack(original, 1 << 24).sender), original, False
        elif kind == 3:
            other = rng.choice([d for d in devices if d != device])
            yield topics.up(device), pack(Envelope("upload", fed, 1, other, b"x", codec="none")), False  # spoofed
        elif kind == 4:
            yield topics.up(f"stranger-{rng.randrange(50)}"), rng.randbytes(50), False
        elif kind == 5:
            chunk = {"upload_id": "u" * 8, "seq": 0, "count": 20000, "total_length": 10**8, "total_sha256": "0" * 64}
            yield topics.up(device), pack(Envelope("chunk", fed, 1, device, b"y", codec="none", extra={"chunk": chunk})), False
        elif kind == 6:
            header = ("[" * 5000 + "]" * 5000).encode()
            yield topics.up(device), PREFIX.pack(b"EDFL", 1, len(header)) + header, False
        elif kind == 7:
            yield topics.up(device), b"poison" + rng.randbytes(20), True  # retained: replayed to every subscriber
        else:
            yield topics.up(device), pack(Envelope("upload", fed, rng.randrange(0, 5), device, b"{}", codec="safetensors")), False


def flood_until(stop: threading.Event, attacker: Link, stream, sent: dict, captured: list[bytes], keep: str, most: int,
                pause_s: float) -> None:
    """Publish ``stream`` until ``stop``, counting in ``sent["count"]`` and keeping up to ``most``
    real messages of type ``keep`` that the attacker overhears, for the stream to replay."""
    for topic, payload, retain in stream:
        if stop.is_set():
            return
        attacker.publish(topic, payload, retain=retain)
        sent["count"] += 1
        while (item := attacker.get(0)) is not None:
            if item.payload[:4] == b"EDFL" and len(captured) < most:
                try:
                    if unpack(item.payload, 1 << 30).type == keep:
                        captured.append(item.payload)
                except Exception:
                    pass
        time.sleep(pause_s)


def test_a_run_under_continuous_hostile_traffic_ends_with_the_fault_free_numbers(tmp_path):
    from edgefl.fleet.launcher import serve
    from edgefl.sim import Simulation

    cfg = fleet_config("fedavg", rounds=3, round_deadline_s=60, federation="soak")
    path = tmp_path / "run.toml"
    path.write_text(cfg.to_toml())
    topics = Topics("soak")
    ids = [f"client-{i}" for i in range(4)]
    sent = {"count": 0}
    with mosquitto(tmp_path) as broker:
        procs = [_device(path, broker, d, timeout=150) for d in ids]
        wait_online(broker, "soak", ids)
        attacker = Link(BrokerAddress.parse(broker), "attacker", [topics.all_up]).start()
        captured: list[bytes] = []
        stop = threading.Event()

        def attack():
            flood_until(stop, attacker, hostile_stream(topics, random.Random(7), captured), sent, captured, "upload", 50, 0.001)

        # retained poison is on the device topics before the server subscribes
        for d in ids:
            attacker.publish(topics.up(d), b"retained poison", retain=True)
        flood = threading.Thread(target=attack, daemon=True)
        flood.start()
        from edgefl.rundir import RunDir

        run = RunDir.create(tmp_path / "run", cfg.name, cfg.seed)
        try:
            summary = serve(cfg, broker, run, join_timeout_s=10)
        finally:
            stop.set()
            flood.join(timeout=10)
            attacker.stop(offline=False)
        codes = [p.wait(timeout=60) for p in procs]
    assert codes == [0] * 4
    assert sent["count"] > 100, sent
    history = summary["history"]
    assert [h["outcome"] for h in history] == ["complete"] * 3
    sim = Simulation(cfg, show_progress=False)
    fault_free = sim.run()
    assert summary["final_accuracy"] == fault_free["final_accuracy"]
    assert [h["accuracy"] for h in history] == [h["accuracy"] for h in sim.history]
    refused = summary["rejections"]
    assert refused["count"] > 100 and len(refused["by_reason"]) <= 11 and len(refused["by_sender"]) <= 11  # the top ten and "(other)"
    metrics = (run.path / "metrics.jsonl").read_text()
    assert len(metrics) < 30_000, f"metrics grew to {len(metrics)} bytes"
    assert all(len(json.dumps(h["rejected"])) < 3000 for h in history)
