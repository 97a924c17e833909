"""Felo/Velo benchmarks (issue 3), paper 000's Tables 1-4 scaled to a 2-core CPU.

Common setting: Fashion-MNIST, ``--clients`` devices (20, as the paper's CIFAR-10 runs) spread
evenly over five ResNets (torchvision BasicBlocks, width 0.25, the authors' 7x7 stride-2 stem),
20 % sampled per round, ``--samples`` training images per device, one local epoch of batch 50
with Adam 1e-3 per round (authors' code), ``--rounds`` rounds, evaluated every 3 rounds on a
fixed 2,000-image test subset (mean accuracy of every device's model; FedAvg-groups and Felo/Velo
are judged by their architectures' global models). The paper trains 100+ rounds on CIFAR-10 at
full width.

Tables:

1. depths 10/14/18/22/26: Velo, Felo, FedHe, FedAvg-groups, Local; IID and Dirichlet 0.5.
2. homogeneous ResNet18: Felo, Velo, FedAvg.
3. "extreme" depths 10/18/26/34/50: Felo, Velo (compare with table 1).
4. Velo with CVAE retraining every k in {1, 5, 10} rounds: accuracy and server CVAE time per round.

Feature width: 128 for every model (the natural width of BasicBlock ResNets at width 0.25;
ResNet50's 512-wide bottleneck output gets the fixed-width projection).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from common import load, mean_std, plot_curves, read_results, run_config, save, users_file, users_path

DEPTHS = {"set1": ("resnet10", "resnet14", "resnet18", "resnet22", "resnet26"),
          "extreme": ("resnet10", "resnet18", "resnet26", "resnet34", "resnet50"),
          "homogeneous": ("resnet18",) * 5}
TABLES = {
    1: ("set1", ["velo", "felo", "fedhe", "fedavg", "local"], [None]),
    2: ("homogeneous", ["velo", "felo", "fedavg"], [None]),
    3: ("extreme", ["velo", "felo"], [None]),
    4: ("set1", ["velo"], [1, 5, 10]),
}
FEATURE_DIM = 128


def config(depths: str, method: str, partition: str, seed: int, k: int | None, args) -> dict:
    per = args.clients // 5
    opts = {"width": 0.25, "stem": "imagenet", "feature_dim": FEATURE_DIM}
    m: dict = {"name": method}
    if method in ("felo", "velo"):
        m.update({"feature_dim": FEATURE_DIM})
    if method == "velo":
        m.update({"retrain_every": k or 1, "cvae_epochs": args.cvae_epochs})
    return {
        "name": f"bench-{method}-{depths}-{partition}", "seed": seed, "rounds": args.rounds, "method": m,
        "data": {"dataset": "fashion-mnist", "partition": partition, "alpha": 0.5,
                 "samples_per_client": args.samples, "test_samples": 2000},
        "train": {"epochs": 1, "batch_size": 50, "optimizer": "adam", "lr": 1e-3},
        "fleet": {"groups": [{"model": d, "count": per, "options": opts} for d in DEPTHS[depths]], "sample_ratio": 0.2},
        "eval": {"every": 3},
    }


def run(args) -> None:
    ds = load()
    runs = []
    t0 = time.perf_counter()
    for table in args.tables:
        depths, methods, ks = TABLES[table]
        for partition in args.partitions:
            for seed in args.seeds:
                for k in ks:
                    for method in methods:
                        out = run_config(config(depths, method, partition, seed, k, args), ds)
                        s, hist = out["summary"], out["history"]
                        curve = [(h["round"], h["accuracy"]["overall"]) for h in hist if h.get("accuracy")]
                        cvae = [h["server"]["cvae"]["seconds"] for h in hist if isinstance(h.get("server"), dict) and "cvae" in h["server"]]
                        runs.append({"table": table, "method": method, "k": k, "partition": partition, "seed": seed,
                                     "final": curve[-1][1], "per_arch": s["final_accuracy"]["per_arch"], "curve": curve,
                                     "bytes_up": s["bytes_up_total"], "wall_s": s["wall_time_s"],
                                     "cvae_s_per_round": sum(cvae) / args.rounds if cvae else None, "cvae_trainings": len(cvae)})
                        extra = f"  cvae {runs[-1]['cvae_s_per_round']:.2f} s/round" if cvae else ""
                        print(f"table {table} {partition:9s} seed {seed} {method:6s}{'' if k is None else f' k={k:<2d}'} "
                              f"final {curve[-1][1]:.4f}  {s['wall_time_s']:.0f}s{extra}  (elapsed {time.perf_counter() - t0:.0f}s)", flush=True)
    path = save(f"felo_velo-{args.tag}", {"args": vars(args), "runs": runs})
    print(f"wrote {path}")


def merge(paths: list[str], plot_dir: Path | None) -> None:
    runs = [r for p in paths for r in read_results(Path(p), "runs")]
    for table in sorted({r["table"] for r in runs}):
        print(f"\nTable {table}")
        rows = [r for r in runs if r["table"] == table]
        for partition in dict.fromkeys(r["partition"] for r in rows):
            for key in dict.fromkeys((r["method"], r["k"]) for r in rows):
                mine = [r for r in rows if (r["method"], r["k"]) == key and r["partition"] == partition]
                if not mine:
                    continue
                m, sd = mean_std([r["final"] for r in mine])
                cv = [r["cvae_s_per_round"] for r in mine if r["cvae_s_per_round"] is not None]
                label = key[0] + ("" if key[1] is None else f" k={key[1]}")
                print(f"  {partition:9s} {label:10s} {100 * m:6.2f} +- {100 * sd:4.2f}  ({len(mine)} seeds)"
                      + (f"  CVAE {statistics.fmean(cv):.2f} s/round" if cv else ""))
    if plot_dir is None:
        return
    for partition in dict.fromkeys(r["partition"] for r in runs):
        rows = [r for r in runs if r["table"] == 1 and r["partition"] == partition]
        if not rows:
            continue
        curves = {}
        for method in dict.fromkeys(r["method"] for r in rows):
            mine = [r["curve"] for r in rows if r["method"] == method]
            xs = [x for x, _ in mine[0]]
            curves[f"{method} ({len(mine)} seeds)"] = (xs, [statistics.fmean(c[i][1] for c in mine) for i in range(len(xs))])
        out = plot_curves(curves, f"Felo/Velo and baselines, ResNet10-26, Fashion-MNIST, {partition}",
                          "test accuracy (mean over devices)", plot_dir / f"felo-velo-{partition}.png", highlight="velo")
        print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--partitions", nargs="+", default=["iid", "dirichlet"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--samples", type=int, default=600)
    ap.add_argument("--cvae-epochs", type=int, default=50)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tag", default="all")
    ap.add_argument("--merge", nargs="+", type=users_file, default=None)
    ap.add_argument("--plot-dir", type=users_path, default=None)
    args = ap.parse_args()
    if args.merge:
        merge(args.merge, args.plot_dir)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    run(args)


if __name__ == "__main__":
    main()
