"""Memory of a large simulated fleet: 1,000 FedHe-CNN clients (the paper's ten CNNs, 100 devices
each, full width) on Fashion-MNIST, in one process.

    ./dev.sh bench sim_memory                   # 1000 clients, 100 selected per round, 2 rounds
    ./dev.sh bench sim_memory --per-round 1000  # every client every round

Prints the resident memory (psutil) after building the fleet and after each round, and the peak
(the kernel's high-water mark, VmHWM); the run must stay within this machine's 24 GB.
"""

from __future__ import annotations

import argparse
import time

import psutil
import torch

from common import save
from edgefl.config import validate_config
from edgefl.sim import Simulation


def peak_bytes() -> int:
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return psutil.Process().memory_info().rss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--per-round", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    gib = 1 << 30
    proc = psutil.Process()
    raw = {
        "name": "bench-memory", "seed": 0, "rounds": args.rounds, "method": {"name": "fedhe"},
        "data": {"dataset": "fashion-mnist", "partition": "iid", "test_samples": 1000},
        "train": {"batch_size": 50, "epochs": 1},
        "fleet": {"groups": [{"model": f"fedhe-cnn-{i}", "count": args.clients // 10} for i in range(10)], "per_round": args.per_round},
        "eval": {"every": args.rounds}, "network": {"quorum": 1},
    }
    t0 = time.perf_counter()
    base = proc.memory_info().rss
    sim = Simulation(validate_config(raw), show_progress=False)
    built = proc.memory_info().rss
    params = sum(p.numel() for c in sim.clients.values() for p in c.model.parameters())
    print(f"{args.clients} clients built in {time.perf_counter() - t0:.0f} s: RSS {built / gib:.2f} GiB "
          f"(before {base / gib:.2f}); {params / 1e6:.0f} M parameters in all ({params * 4 / gib:.2f} GiB as float32)", flush=True)
    rows = []
    for r in range(1, args.rounds + 1):
        t = time.perf_counter()
        record = sim.run_round(r)
        rss = proc.memory_info().rss
        rows.append({"round": r, "rss_gib": round(rss / gib, 2), "seconds": round(time.perf_counter() - t, 1),
                     "accuracy": (record.get("accuracy") or {}).get("overall")})
        print(f"round {r}: {time.perf_counter() - t:.0f} s, RSS {rss / gib:.2f} GiB, accuracy {(record.get('accuracy') or {}).get('overall')}", flush=True)
    peak = peak_bytes()
    print(f"peak RSS {peak / gib:.2f} GiB of {psutil.virtual_memory().total / gib:.0f} GiB; torch threads {torch.get_num_threads()}")
    save("sim_memory", {"clients": args.clients, "per_round": args.per_round, "built_rss_gib": round(built / gib, 2),
                        "parameters": params, "rounds": rows, "peak_rss_gib": round(peak / gib, 2)})


if __name__ == "__main__":
    main()
