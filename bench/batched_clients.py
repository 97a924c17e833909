"""Same-architecture clients trained together (simulation.batch_clients) against one at a time:
the wall time of one round's local training, both ways in one process, side by side.

    ./dev.sh bench batched_clients            # the two rounds issue 17 names, on this machine's device
    ./dev.sh bench batched_clients --steps 4  # more local steps per client

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
from edgefl.config import validate_config
from edgefl.sim import Simulation

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


def timed_round(raw: dict, dataset) -> tuple[float, int]:
    sim = Simulation(validate_config(raw), dataset=dataset, show_progress=False)
    sim.run_round(1)  # warm-up: first-call costs (allocations, vmap tracing) out of the timing
    t0 = time.perf_counter()
    record = sim.run_round(2)
    return time.perf_counter() - t0, len(record["selected"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2, help="mini-batches each client trains per round")
    ap.add_argument("--only", choices=sorted(ROUNDS), help="one of the rounds")
    args = ap.parse_args()
    ds = load()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for name, (method, groups) in ROUNDS.items():
        if args.only and name != args.only:
            continue
        alone, clients = timed_round(config(method, groups, "off", args.steps), ds)
        together, _ = timed_round(config(method, groups, "on", args.steps), ds)
        rows.append({"round": name, "clients": clients, "steps": args.steps, "device": device,
                     "one_at_a_time_s": round(alone, 2), "batched_s": round(together, 2), "speedup": round(alone / together, 2)})
        print(f"{name:22} {clients:4d} clients on {device}: one at a time {alone:7.2f} s, batched {together:7.2f} s, "
              f"speed-up x{alone / together:.2f}", flush=True)
    save("batched_clients", {"rows": rows, "threads": torch.get_num_threads()})


if __name__ == "__main__":
    main()
