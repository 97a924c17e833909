"""Benchmark 3: FedAvg with a LeNet-style CNN on Fashion-MNIST, 10 clients, batch 64.

The public Flower baseline (niid-bench, FedAvg) reaches 89.23 % (IID) and 88.09 % (Dirichlet
0.5) after 50 rounds of 10 local epochs. Scaling for a 2-core CPU: ``--rounds`` rounds of
``--epochs`` local epochs (defaults 25 x 2 = 50 client-epochs per client instead of 500);
``--paper`` runs the full 50 x 10. Prints the learning curve so the gap can be read off.
"""

from __future__ import annotations

import argparse
import time

import torch
from common import load, run_config, save


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--partitions", nargs="+", default=["iid", "dirichlet"])
    ap.add_argument("--paper", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (1 lets two benchmarks share 2 cores)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds, epochs = (50, 10) if args.paper else (args.rounds, args.epochs)
    ds = load()
    out = {}
    for partition in args.partitions:
        t0 = time.perf_counter()
        raw = {
            "name": f"bench-fedavg-lenet-{partition}", "seed": args.seed, "rounds": rounds,
            "method": {"name": "fedavg"},
            "data": {"dataset": "fashion-mnist", "partition": partition, "alpha": 0.5},
            "train": {"epochs": epochs, "batch_size": 64, "optimizer": "sgd", "lr": 0.01, "momentum": 0.9, "weight_decay": 1e-5},
            "fleet": {"groups": [{"model": "lenet5", "count": 10}]},
            "eval": {"every": 1},
        }
        res = run_config(raw, ds)
        curve = [(h["round"], h["accuracy"]["overall"]) for h in res["history"] if h["accuracy"]]
        out[partition] = {"curve": curve, "final": curve[-1][1], "best": max(a for _, a in curve), "wall_s": time.perf_counter() - t0}
        print(f"{partition}: final {curve[-1][1]:.4f} best {out[partition]['best']:.4f}  ({out[partition]['wall_s']:.0f}s)", flush=True)
        print("  curve: " + " ".join(f"{r}:{a:.3f}" for r, a in curve), flush=True)
    path = save("fedavg_lenet-" + "-".join(args.partitions), {"args": vars(args), "rounds": rounds, "local_epochs": epochs, "results": out,
                                 "flower_baseline": {"iid": 0.8923, "dirichlet": 0.8809}})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
