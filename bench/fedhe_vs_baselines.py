"""Benchmark 2: FedHe vs Local-only vs FedAvg-groups on Fashion-MNIST with the ten FedHe CNNs.

10 clients (one per CNN), IID and Dirichlet(0.5), three seeds. Paper 002 reports FedHe above
private-only training on MNIST and CIFAR-10; this checks the same ordering here.

The paper notes that FedHe converges "a little bit slower than Private" and overtakes it later,
so the comparison must run well past the point where local models fit their data. Scaling for a
2-core CPU: channels x0.25, ``--samples`` training images per client (600 by default, a tenth
of each client's Dirichlet/IID share), ``--rounds`` rounds of one local epoch each
(``--steps`` batches of 50), evaluation after the last round on a fixed 2,000-image test
subset. ``--paper`` restores full width, each client's whole share, 50 rounds and the whole
test set. With ten architectures on ten clients every FedAvg group has one member, so
FedAvg-groups can only match Local-only; it is run because it is the baseline users reach for.
"""

from __future__ import annotations

import argparse
import time

import torch
from common import load, mean_std, run_config, save


def config(method: str, partition: str, seed: int, args) -> dict:
    groups = [{"model": f"fedhe-cnn-{i}", **({} if args.paper else {"options": {"width": 0.25}})} for i in range(10)]
    train = {"epochs": 1, "batch_size": 50, "optimizer": "adam", "lr": 1e-3}
    if not args.paper:
        train["max_steps"] = args.steps
    data = {"dataset": "fashion-mnist", "partition": partition, "alpha": 0.5}
    if not args.paper:
        data["test_samples"] = 2000
        data["samples_per_client"] = args.samples
    return {
        "name": f"bench-{method}-{partition}", "seed": seed, "rounds": 50 if args.paper else args.rounds,
        "method": {"name": method}, "data": data, "train": train,
        "fleet": {"groups": groups}, "eval": {"every": 10 if not args.paper else 5},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--samples", type=int, default=600)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (1 lets two benchmarks share 2 cores)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--partitions", nargs="+", default=["iid", "dirichlet"])
    ap.add_argument("--methods", nargs="+", default=["fedhe", "local", "fedavg"])
    ap.add_argument("--fedavg-seeds", type=int, nargs="+", default=None,
                    help="seeds for FedAvg-groups (default: --seeds); with one device per architecture it equals Local-only")
    ap.add_argument("--paper", action="store_true", help="paper-scale settings (hours on 2 cores)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ds = load()
    results = []
    t0 = time.perf_counter()
    for partition in args.partitions:
        for seed in args.seeds:
            for method in args.methods:
                if method == "fedavg" and args.fedavg_seeds is not None and seed not in args.fedavg_seeds:
                    continue
                out = run_config(config(method, partition, seed, args), ds)
                s = out["summary"]
                acc = s["final_accuracy"]
                results.append({"method": method, "partition": partition, "seed": seed, "final": acc["overall"],
                                "per_arch": acc["per_arch"], "bytes_up": s["bytes_up_total"], "wall_s": s["wall_time_s"]})
                print(f"{partition:9s} seed {seed} {method:7s} acc {acc['overall']:.4f}  up {s['bytes_up_total']:>12,d} B"
                      f"  {s['wall_time_s']:.0f}s  (elapsed {time.perf_counter() - t0:.0f}s)", flush=True)
    print("\nmean +- std over seeds (mean accuracy of the 10 client models)")
    print(f"{'partition':10s} " + " ".join(f"{m:>16s}" for m in args.methods))
    table = {}
    for partition in args.partitions:
        row = {}
        for method in args.methods:
            vals = [r["final"] for r in results if r["method"] == method and r["partition"] == partition]
            m, sd = mean_std(vals)
            row[method] = {"mean": m, "std": sd, "seeds": len(vals)}
        table[partition] = row
        print(f"{partition:10s} " + " ".join(f"{row[m]['mean']:.4f} +- {row[m]['std']:.4f}" for m in args.methods))
    path = save("fedhe_vs_baselines-" + "-".join(args.partitions), {"args": vars(args), "runs": results, "table": table})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
