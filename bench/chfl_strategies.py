"""Benchmark (issue 9): CHFL against SOLO, AVG and AVGKD (paper 004, Table 1).

Two completely heterogeneous settings, each device with its own feature space, its own
architecture and its own held-out test split (the paper divides train and test within each
client), IID and Dirichlet(0.5) labels:

* ``bcd``: scikit-learn's breast-cancer set (the paper's BCD). 8 devices, each with a random 30 %
  of the 30 features, its own randomly shaped MLP (1-3 layers of 16-128 units), embedding E = 64;
  60 epochs (one per round), five seeds.
* ``fmnist``: Fashion-MNIST, 5 devices whose inputs differ (pixel permutation, 20x20 resize,
  24x24 crop, 3-channel copy, plain) with different backbones (FedHe CNNs, ResNet10, LeNet, MLP),
  E = 64, 1,250 images per device (a fifth held out), ``--fmnist-rounds`` epochs, ``--fmnist-seeds``.

The paper reports the best average validation accuracy over epochs; both best and final are
printed. Its claim to test: CHFL never falls below SOLO, while AVG and AVGKD can.
"""

from __future__ import annotations

import argparse
import time

import torch
from common import mean_std, run_config, save

from edgefl.data import load_dataset

STRATEGIES = {"SOLO": ("local", {}), "AVG": ("chfl", {"mode": "avg"}), "AVGKD": ("chfl", {"mode": "avgkd"}), "CHFL": ("chfl", {"mode": "kd"})}


def bcd_config(method: str, opts: dict, partition: str, seed: int) -> dict:
    m = {"name": method, **opts, **({"embedding_dim": 64} if method == "chfl" else {})}
    return {
        "name": "bench-chfl-bcd", "seed": seed, "rounds": 60, "method": m,
        "data": {"dataset": "breast-cancer", "partition": partition, "alpha": 0.5, "min_samples": 30, "client_test_fraction": 0.3},
        "train": {"epochs": 1, "batch_size": 16, "optimizer": "adam", "lr": 1e-3},
        "fleet": {"groups": [{"model": "mlp", "count": 8, "options": {"hidden": "random", "feature_dim": 64},
                              "view": {"kind": "features", "fraction": 0.3}}]},
        "eval": {"every": 1},
    }


def fmnist_config(method: str, opts: dict, partition: str, seed: int, rounds: int) -> dict:
    m = {"name": method, **opts, **({"embedding_dim": 64} if method == "chfl" else {})}
    e = {"feature_dim": 64}
    return {
        "name": "bench-chfl-fmnist", "seed": seed, "rounds": rounds, "method": m,
        "data": {"dataset": "fashion-mnist", "partition": partition, "alpha": 0.5, "samples_per_client": 1250,
                 "client_test_fraction": 0.2},
        "train": {"epochs": 1, "batch_size": 50, "optimizer": "adam", "lr": 1e-3},
        "fleet": {"groups": [
            {"model": "fedhe-cnn-5", "options": {"width": 0.25, **e}, "view": {"kind": "permute"}},
            {"model": "resnet10", "options": {"width": 0.125, **e}, "view": {"kind": "resize", "size": 20}},
            {"model": "lenet5", "options": e, "view": {"kind": "crop", "size": 24}},
            {"model": "fedhe-cnn-0", "options": {"width": 0.25, **e}, "view": {"kind": "rgb"}},
            {"model": "mlp", "options": {"hidden": [256, 128], **e}},
        ]},
        "eval": {"every": 1},
    }


def sweep(name: str, make, seeds: list[int], partitions: list[str], dataset) -> dict:
    runs = []
    t0 = time.perf_counter()
    for partition in partitions:
        for seed in seeds:
            for label, (method, opts) in STRATEGIES.items():
                out = run_config(make(method, opts, partition, seed), dataset)
                curve = [h["accuracy"]["overall"] for h in out["history"] if h["accuracy"]]
                runs.append({"strategy": label, "partition": partition, "seed": seed, "final": curve[-1], "best": max(curve)})
                print(f"{name} {partition:9s} seed {seed} {label:6s} best {max(curve):.4f} final {curve[-1]:.4f}"
                      f"  (elapsed {time.perf_counter() - t0:.0f}s)", flush=True)
    table = {}
    print(f"\n{name}: best average accuracy over epochs, mean +- std over {len(seeds)} seeds")
    print(f"{'partition':10s}" + "".join(f"{s:>18s}" for s in STRATEGIES))
    for partition in partitions:
        row = {}
        for label in STRATEGIES:
            vals = [r["best"] for r in runs if r["strategy"] == label and r["partition"] == partition]
            finals = [r["final"] for r in runs if r["strategy"] == label and r["partition"] == partition]
            m, sd = mean_std(vals)
            fm, fsd = mean_std(finals)
            row[label] = {"best_mean": m, "best_std": sd, "final_mean": fm, "final_std": fsd}
        table[partition] = row
        print(f"{partition:10s}" + "".join(f"{row[s]['best_mean'] * 100:8.2f} +- {row[s]['best_std'] * 100:5.2f}" for s in STRATEGIES))
        below = [s for s in STRATEGIES if s != "SOLO" and row[s]["best_mean"] < row["SOLO"]["best_mean"]]
        print(f"{'':10s}below SOLO: {', '.join(below) or 'none'}")
    return {"runs": runs, "table": table}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", nargs="+", default=["bcd", "fmnist"], choices=["bcd", "fmnist"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--fmnist-seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--fmnist-rounds", type=int, default=12)
    ap.add_argument("--partitions", nargs="+", default=["iid", "dirichlet"])
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    result = {}
    if "bcd" in args.settings:
        result["bcd"] = sweep("bcd", bcd_config, args.seeds, args.partitions, load_dataset("breast-cancer"))
    if "fmnist" in args.settings:
        ds = load_dataset("fashion-mnist")
        make = lambda m, o, p, s: fmnist_config(m, o, p, s, args.fmnist_rounds)  # noqa: E731
        result["fmnist"] = sweep("fmnist", make, args.fmnist_seeds, args.partitions, ds)
    path = save("chfl_strategies-" + "-".join(args.settings), {"args": vars(args), **result})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
