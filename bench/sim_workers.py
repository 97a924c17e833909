"""Heterogeneous clients in parallel worker processes (simulation.workers) against one process:
one round's wall time, both ways in one run, side by side, and whether the numbers agree.

    ./dev.sh bench sim_workers                  # 10 FedHe CNNs (one of each), Fashion-MNIST
    ./dev.sh bench sim_workers --clients 20 --steps 20

One process uses all the machine's torch threads; N workers use threads/N each (set here: by default every
worker would train with the run's thread count, all of them, so that its numbers are those of one process).
The round is played once to warm up (worker start-up and data loading out of the timing), then timed.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from common import save
from edgefl.config import validate_config
from edgefl.server.session import TIMING_FIELDS
from edgefl.sim import Simulation


def config(clients: int, steps: int, workers: int, threads: int | None = None) -> dict:
    per = max(1, clients // 10)
    return {
        "name": "bench-workers", "seed": 0, "rounds": 2, "method": {"name": "fedhe"}, **({"threads": threads} if threads else {}),
        "data": {"dataset": "fashion-mnist", "partition": "iid", "test_samples": 500},
        "train": {"batch_size": 50, "max_steps": steps},
        "fleet": {"groups": [{"model": f"fedhe-cnn-{i}", "count": per, "options": {"width": 0.5}} for i in range(10)]},
        "eval": {"every": 100}, "simulation": {"workers": workers},
    }


def timed(raw: dict) -> tuple[float, list[dict]]:
    sim = Simulation(validate_config(raw), show_progress=False)
    try:
        sim.run_round(1)
        t0 = time.perf_counter()
        sim.run_round(2)
        return time.perf_counter() - t0, [{k: v for k, v in r.items() if k not in TIMING_FIELDS} for r in sim.history]
    finally:
        sim.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--steps", type=int, default=10, help="mini-batches of 50 each client trains per round")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    args = ap.parse_args()
    threads = torch.get_num_threads()
    split = max(1, threads // args.workers)
    one, numbers_one = timed(config(args.clients, args.steps, 1))
    narrow, numbers_narrow = timed(config(args.clients, args.steps, 1, split))
    # workers get the run's threads (the default: all of this process's): split them for speed
    many, numbers_many = timed(config(args.clients, args.steps, args.workers, split))
    print(f"{args.clients} FedHe CNN clients, {args.steps} steps of 50 each, one round:")
    print(f"  one process, {threads} threads:       {one:7.2f} s")
    print(f"  one process, {split} thread(s):        {narrow:7.2f} s")
    print(f"  {args.workers} workers, {split} thread(s) each: {many:7.2f} s  (x{one / many:.2f} against {threads} threads, "
          f"x{narrow / many:.2f} against {split}; numbers identical to one process at {split} thread(s): {numbers_narrow == numbers_many}, "
          f"at {threads}: {numbers_one == numbers_many})")
    save("sim_workers", {"clients": args.clients, "steps": args.steps, "workers": args.workers, "threads": threads,
                         "one_process_s": round(one, 2), "one_process_split_threads_s": round(narrow, 2), "workers_s": round(many, 2),
                         "identical_at_equal_threads": numbers_narrow == numbers_many, "identical_at_all_threads": numbers_one == numbers_many})


if __name__ == "__main__":
    main()
