"""Same-architecture clients trained together (simulation.batch_clients) against one at a time:
the wall time of one round's local training, both ways in one process, side by side.

    ./dev.sh bench batched_clients            # the two rounds issue 17 names, on this machine's device
    ./dev.sh bench batched_clients --steps 4  # more local steps per client

Three spans are timed in the same round, both ways: local training alone (each client's
``train_local``, or the one batched ``train_together``), the devices' side (download decoded,
training, upload encoded) and the whole round (the server's checks, aggregation, evaluation too).
Issue 38's goal (a local epoch of 100 ResNet18 clients at least 10x faster batched on a GPU) is
the first: ``--steps 12`` is one epoch of a client's 600 images.

Rounds: (a) 20 FedIN clients, 4 each of ResNet10/14/18/22/26 at width 0.25; (b) 100 FedAvg clients
on one ResNet18 at width 0.25. Each client trains --steps mini-batches of 50 Fashion-MNIST images
(the same work both ways); the round is played once to warm up, then timed. The device is the
config's ``device = "auto"`` (CUDA when present).
"""

from __future__ import annotations

import argparse
import time

import torch

from common import load, save
from edgefl.algorithms import base as base_module
from edgefl.config import validate_config
from edgefl.sim import Simulation
from edgefl.sim import batching as batching_module
from edgefl.sim.network import InMemoryNetwork

ROUNDS = {
    "fedin-20-resnets": ("fedin", [{"model": f"resnet{d}", "count": 4, "options": {"width": 0.25}} for d in (10, 14, 18, 22, 26)]),
    "fedavg-100-resnet18": ("fedavg", [{"model": "resnet18", "count": 100, "options": {"width": 0.25}}]),
}


def config(method: str, groups: list[dict], batch: str, steps: int) -> dict:
    return {
        "name": f"bench-batched-{method}", "seed": 0, "rounds": 2, "method": {"name": method},
        "data": {"dataset": "fashion-mnist", "partition": "iid", "test_samples": 500},
        "train": {"batch_size": 50, "max_steps": steps, "optimizer": "sgd", "lr": 0.01},
        "fleet": {"groups": groups}, "eval": {"every": 100}, "simulation": {"batch_clients": batch},
    }


class Spans:
    """Wall time spent inside chosen functions during the timed round (CUDA synchronised at each
    exit, so queued kernels are counted where they were launched). A span entered inside another
    is not counted twice."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._depth = 0
        self.on = False

    def wrap(self, owner: object, attr: str, label: str) -> None:
        inner = getattr(owner, attr)

        def timed(*args, **kwargs):
            if not self.on or self._depth:
                return inner(*args, **kwargs)
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - t0
                self._depth -= 1

        setattr(owner, attr, timed)


SPANS = Spans()
# the devices' side of a round (download decoded, local training, upload encoded), both ways
SPANS_DEVICES = Spans()
# local training alone: one client's train_local, or one batched train_together
SPANS.wrap(base_module, "train_local", "training")
SPANS.wrap(batching_module, "train_together", "training")
SPANS_DEVICES.wrap(InMemoryNetwork, "_run_devices", "devices")


def timed_round(raw: dict, dataset) -> dict[str, float | int]:
    sim = Simulation(validate_config(raw), dataset=dataset, show_progress=False)
    sim.run_round(1)  # warm-up: first-call costs (allocations, vmap tracing) out of the timing
    SPANS.seconds, SPANS_DEVICES.seconds = {}, {}
    SPANS.on = SPANS_DEVICES.on = True
    t0 = time.perf_counter()
    record = sim.run_round(2)
    wall = time.perf_counter() - t0
    SPANS.on = SPANS_DEVICES.on = False
    return {"round_s": wall, "devices_s": SPANS_DEVICES.seconds.get("devices", 0.0),
            "training_s": SPANS.seconds.get("training", 0.0), "clients": len(record["selected"])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2, help="mini-batches each client trains per round")
    ap.add_argument("--only", choices=sorted(ROUNDS), help="one of the rounds")
    args = ap.parse_args()
    ds = load()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for name, (method, groups) in ROUNDS.items():
        if args.only and name != args.only:
            continue
        alone = timed_round(config(method, groups, "off", args.steps), ds)
        together = timed_round(config(method, groups, "on", args.steps), ds)
        row: dict = {"round": name, "clients": alone["clients"], "steps": args.steps, "device": device}
        for part in ("round", "devices", "training"):
            a, b = alone[f"{part}_s"], together[f"{part}_s"]
            row.update({f"{part}_one_at_a_time_s": round(a, 3), f"{part}_batched_s": round(b, 3),
                        f"{part}_speedup": round(a / b, 2) if b else None})
        rows.append(row)
        print(f"{name:22} {row['clients']:4d} clients on {device}, {args.steps} batches each:", flush=True)
        for part, what in (("training", "local training alone"), ("devices", "devices' side (decode, train, encode)"),
                           ("round", "whole round")):
            print(f"    {what:40} one at a time {row[f'{part}_one_at_a_time_s']:8.2f} s, batched "
                  f"{row[f'{part}_batched_s']:8.2f} s, speed-up x{row[f'{part}_speedup']}", flush=True)
    save("batched_clients", {"rows": rows, "threads": torch.get_num_threads()})


if __name__ == "__main__":
    main()
