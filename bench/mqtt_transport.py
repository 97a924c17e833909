"""MQTT fleet benchmark (loopback, one run, side by side):

1. framing: bytes on the wire against raw tensor bytes, for a FedHe logit upload and for ResNet18
   weights (envelope + safetensors header + chunk envelopes + MQTT publish headers);
2. 50 MB of weights one way through mosquitto: in 1 MiB chunks (the protocol's default), in
   4 MiB chunks and as one message, each timed from the first publish to the reassembled, hash-checked
   body at the receiver (median of ``--repeats``);
3. wall time of a fleet round against the same round in the in-process simulation (FedAvg on
   digits, 4 devices);
4. how many device processes one server serves at one round per minute: fleets of ``--fleet-sizes``
   devices (MLP on digits, deadline 60 s), each a real ``edgefl client`` process; the largest size
   whose rounds all close complete within the deadline.

    python bench/mqtt_transport.py --fleet-sizes 8 16 32
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import save

from edgefl.config import RunConfig
from edgefl.fleet.broker import start_mosquitto
from edgefl.messages import Message, encode
from edgefl.models import build_model
from edgefl.transport.chunks import Reassembler, split
from edgefl.transport.envelope import Envelope, unpack
from edgefl.transport.link import BrokerAddress, Link

MQTT_PUBLISH_OVERHEAD = 2 + 4 + 2  # fixed header (up to 4-byte length) + packet id, plus the topic below


def wire_bytes(env: Envelope, topic: str, chunk_bytes: int = 1 << 20) -> tuple[int, int]:
    pieces = split(env, chunk_bytes)
    return sum(len(p) + MQTT_PUBLISH_OVERHEAD + 2 + len(topic) for p in pieces), len(pieces)


def framing() -> list[dict]:
    rows = []
    topic = "edgefl/v1/bench/dev/client-00/up"
    logits = {"logits": torch.randn(10, 10), "classes": torch.arange(10), "counts": torch.full((10,), 60)}
    weights = build_model("resnet18", num_classes=10, input_shape=(3, 32, 32)).state_dict()
    for name, tensors, kind in (("FedHe logit upload (10 classes)", logits, "class_logits"), ("ResNet18 weights", weights, "weights")):
        raw = sum(t.numel() * t.element_size() for t in tensors.values())
        msg = Message(kind, 1, "client-00", tensors, {"num_samples": 600, "arch": "x", "train_loss": 0.5})
        env = Envelope("upload", "bench", 1, "client-00", encode(msg), msg.message_id, codec="safetensors")
        wire, n = wire_bytes(env, topic)
        rows.append({"payload": name, "raw_bytes": raw, "wire_bytes": wire, "publishes": n, "overhead": wire / raw - 1})
        print(f"{name:34s} raw {raw:>12,d} B  wire {wire:>12,d} B  ({n} publishes)  overhead {wire / raw - 1:+.3%}", flush=True)
    return rows


def transfer(url: str, size: int, chunk_bytes: int, repeats: int) -> float:
    body = torch.randint(0, 255, (size,), dtype=torch.uint8).numpy().tobytes()
    rx = Link(BrokerAddress.parse(url), f"rx-{chunk_bytes}", ["bench/up"], None).start()
    tx = Link(BrokerAddress.parse(url), f"tx-{chunk_bytes}", [], None).start()
    times = []
    try:
        for _ in range(repeats):
            env = Envelope("upload", "bench", 1, "tx", body, codec="none")
            pieces = split(env, chunk_bytes, threshold=chunk_bytes)
            reasm = Reassembler(1 << 30)
            t0 = time.perf_counter()
            for p in pieces:
                tx.publish("bench/up", p)
            got = None
            while got is None:
                item = rx.get(30)
                if item is None:
                    raise RuntimeError("transfer stalled")
                e = unpack(item.payload, 1 << 30)
                got = reasm.add(e) if e.type == "chunk" else item.payload
            final = unpack(got, 1 << 30)
            assert hashlib.sha256(final.body).digest() == hashlib.sha256(body).digest()
            times.append(time.perf_counter() - t0)
    finally:
        tx.stop(offline=False)
        rx.stop(offline=False)
    return statistics.median(times)


def digits_fleet(devices: int, rounds: int, model: dict, deadline: float = 60.0) -> RunConfig:
    return RunConfig.model_validate({
        "name": f"bench-fleet-{devices}", "seed": 0, "rounds": rounds, "threads": 1,
        "method": {"name": "fedavg"},
        "data": {"dataset": "digits", "partition": "iid"},
        "train": {"epochs": 1, "batch_size": 32, "optimizer": "adam", "lr": 0.003},
        "fleet": {"groups": [{**model, "count": devices}]},
        "network": {"round_deadline_s": deadline, "quorum": 1.0},
    })


def round_times(args) -> dict:
    from edgefl.fleet.launcher import run_fleet
    from edgefl.sim import Simulation

    cfg = digits_fleet(4, 3, {"model": "fedhe-cnn-0", "options": {"width": 0.125}})
    sim = Simulation(cfg, show_progress=False)
    sim.run()
    sim_rounds = [h["round_time_s"] for h in sim.history]
    fleet = run_fleet(cfg, None, None, device_timeout_s=300)
    fleet_rounds = [h["round_time_s"] for h in fleet["history"]]
    out = {"simulation_round_s": sim_rounds, "fleet_round_s": fleet_rounds,
           "median_ratio": statistics.median(fleet_rounds) / statistics.median(sim_rounds)}
    print(f"round wall time, 4 devices: simulation {statistics.median(sim_rounds):.2f} s, fleet {statistics.median(fleet_rounds):.2f} s "
          f"(x{out['median_ratio']:.1f}; the fleet's devices train in parallel processes, the simulation one after another)", flush=True)
    return out


def capacity(args) -> list[dict]:
    from edgefl.fleet.launcher import run_fleet

    rows = []
    for n in args.fleet_sizes:
        cfg = digits_fleet(n, 2, {"model": "mlp", "options": {"hidden": [32]}})
        t0 = time.perf_counter()
        res = run_fleet(cfg, None, None, device_timeout_s=300)
        outcomes = [h["outcome"] for h in res["history"]]
        times = [h["round_time_s"] for h in res["history"]]
        ok = all(o == "complete" for o in outcomes) and max(times) <= 60
        rows.append({"devices": n, "outcomes": outcomes, "round_s": times, "within_deadline": ok,
                     "total_s": round(time.perf_counter() - t0, 1)})
        print(f"{n:4d} device processes: rounds {outcomes}, round time {max(times):.1f} s max, "
              f"{'within' if ok else 'MISSED'} the 60 s deadline", flush=True)
        if not ok:
            break
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=float, default=50)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--fleet-sizes", type=int, nargs="*", default=[8, 16, 32])
    args = p.parse_args()
    result: dict = {"framing": framing()}
    broker = start_mosquitto(Path(tempfile.mkdtemp(prefix="edgefl-bench-")), max_packet_bytes=268_435_455)
    try:
        size = int(args.size_mb * 1e6)
        result["transfer"] = {}
        for label, chunk in (("1 MiB chunks", 1 << 20), ("4 MiB chunks", 4 << 20), ("one message", size + (1 << 20))):
            t = transfer(broker.url, size, chunk, args.repeats)
            result["transfer"][label] = t
            print(f"{args.size_mb:g} MB one way, {label:13s}: {t * 1000:7.0f} ms (median of {args.repeats}, "
                  f"{size / t / 1e6:.0f} MB/s)", flush=True)
    finally:
        broker.stop()
    result["rounds"] = round_times(args)
    result["capacity"] = capacity(args)
    print(f"wrote {save('mqtt_transport', result)}", file=sys.stderr)


if __name__ == "__main__":
    main()
