"""FedIN benchmark: paper 001's Table 1 (FedIN vs FedAvg vs FedProx, plus FedHe), Table 5
(same-architecture aggregation) and Table 7 (ablation), scaled to a 2-core CPU.

Fleet: ResNet10/14/18/22/26 (torchvision BasicBlocks, width 0.25, the authors' 7x7 stride-2
stem + max-pool), ``--clients`` devices spread evenly over the five depths, ``--sample-ratio``
of them per round, ``--samples`` Fashion-MNIST training images per device (IID or
Dirichlet 0.5), one local epoch of batch 16 with Adam 1e-3 per round (the paper's optimiser and
batch; it runs 5 epochs, 100 clients and 500 rounds), evaluated every ``--eval-every`` rounds
on a fixed 2,000-image test subset (mean accuracy of the five depths' global models).

Variants are one method with options, as in the paper (every baseline uses the same layer-wise
aggregation):

=================  ===========================================================
fedin              IN training, prox mu/2 = 0.05, Eq. 14, layer-wise
fedavg             no IN, no prox, layer-wise (FedAvg with InclusiveFL aggregation)
fedprox            no IN, prox 0.05, layer-wise (= the ablation "w/o IN")
fedhe              FedHe's logit exchange (no weights)
fedin-noprox       ablation "w/o Prox"
fedin-noopt        ablation "w/o Opt" (local step, then a separate IN step)
fedin-projection   Eq. 13 instead of Eq. 14
fedin-strict       FedIN, averaging only identical architectures (Table 5)
fedavg-strict      FedAvg-groups (Table 5)
=================  ===========================================================

Run variants in two single-threaded processes to use both cores, then merge::

    python bench/fedin_table1.py --threads 1 --variants fedin fedavg ... --tag a
    python bench/fedin_table1.py --merge bench/results/fedin-a.json bench/results/fedin-b.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from common import load, plot_curves, read_results, run_config, save, users_file, users_path

DEPTHS = ("resnet10", "resnet14", "resnet18", "resnet22", "resnet26")

VARIANTS: dict[str, tuple[str, dict]] = {
    "fedin": ("fedin", {}),
    "fedavg": ("fedin", {"in_training": False, "mu_half": 0.0}),
    "fedprox": ("fedin", {"in_training": False}),
    "fedhe": ("fedhe", {}),
    "fedin-noprox": ("fedin", {"mu_half": 0.0}),
    "fedin-noopt": ("fedin", {"alleviation": "none"}),
    "fedin-projection": ("fedin", {"alleviation": "projection"}),
    "fedin-strict": ("fedin", {"aggregation": "strict"}),
    "fedavg-strict": ("fedavg", {}),
}


def config(variant: str, partition: str, seed: int, args) -> dict:
    method, options = VARIANTS[variant]
    per_depth = args.clients // len(DEPTHS)
    opts = {"width": args.width, "stem": "imagenet"}
    return {
        "name": f"bench-{variant}-{partition}", "seed": seed, "rounds": args.rounds,
        "method": {"name": method, **options},
        "data": {"dataset": "fashion-mnist", "partition": partition, "alpha": 0.5,
                 "samples_per_client": args.samples, "test_samples": 2000},
        "train": {"epochs": 1, "batch_size": 16, "optimizer": "adam", "lr": 1e-3},
        "fleet": {"groups": [{"model": d, "count": per_depth, "options": opts} for d in DEPTHS],
                  "sample_ratio": args.sample_ratio},
        "eval": {"every": args.eval_every},
    }


def curve(history: list[dict]) -> list[tuple[int, float, dict]]:
    return [(h["round"], h["accuracy"]["overall"], h["accuracy"]["per_arch"]) for h in history if h.get("accuracy")]


def rounds_to(points: list[tuple[int, float, dict]], target: float) -> int | None:
    return next((r for r, acc, _ in points if acc >= target), None)


def run(args) -> None:
    ds = load()
    runs = []
    t0 = time.perf_counter()
    for partition in args.partitions:
        for seed in args.seeds:
            for variant in args.variants:
                out = run_config(config(variant, partition, seed, args), ds)
                s = out["summary"]
                points = curve(out["history"])
                runs.append({"variant": variant, "partition": partition, "seed": seed, "final": points[-1][1],
                             "best": max(a for _, a, _ in points), "per_arch": points[-1][2],
                             "curve": [(r, a) for r, a, _ in points], "bytes_up": s["bytes_up_total"],
                             "bytes_down": s["bytes_down_total"], "wall_s": s["wall_time_s"]})
                print(f"{partition:9s} seed {seed} {variant:16s} final {points[-1][1]:.4f}  best {runs[-1]['best']:.4f}"
                      f"  up {s['bytes_up_total'] / 1e6:8.1f} MB  {s['wall_time_s']:.0f}s"
                      f"  (elapsed {time.perf_counter() - t0:.0f}s)", flush=True)
    path = save(f"fedin-{args.tag}", {"args": vars(args), "runs": runs})
    print(f"wrote {path}")


def merge(paths: list[str], targets: list[float], plot_dir: Path | None) -> None:
    runs = [r for p in paths for r in read_results(Path(p), "runs")]
    variants = list(dict.fromkeys(r["variant"] for r in runs))
    partitions = list(dict.fromkeys(r["partition"] for r in runs))
    head = f"{'variant':17s} {'partition':9s} {'final':>7s} {'best':>7s} " + " ".join(f"{'to ' + format(t, '.0%'):>7s}" for t in targets)
    print(head + f" {'MB up/round':>11s}")
    for partition in partitions:
        for v in variants:
            mine = [r for r in runs if r["variant"] == v and r["partition"] == partition]
            if not mine:
                continue
            final = sum(r["final"] for r in mine) / len(mine)
            best = sum(r["best"] for r in mine) / len(mine)
            rounds = [rounds_to([(a, b, {}) for a, b in mine[0]["curve"]], t) for t in targets]
            n_rounds = mine[0]["curve"][-1][0]
            print(f"{v:17s} {partition:9s} {final:7.4f} {best:7.4f} "
                  + " ".join(f"{('-' if x is None else x)!s:>7s}" for x in rounds)
                  + f" {mine[0]['bytes_up'] / n_rounds / 1e6:11.2f}"
                  + (f"   ({len(mine)} seeds)" if len(mine) > 1 else ""))
    if plot_dir is not None:
        for partition in partitions:
            curves = {}
            for v in variants:
                mine = [r for r in runs if r["variant"] == v and r["partition"] == partition and r["seed"] == runs[0]["seed"]]
                if mine:
                    xs, ys = zip(*mine[0]["curve"])
                    curves[v] = (list(xs), list(ys))
            out = plot_curves(curves, f"FedIN and baselines, Fashion-MNIST, {partition}", "test accuracy (mean of the 5 depths)",
                              plot_dir / f"fedin-{partition}.png", highlight="fedin")
            print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=["fedin", "fedavg", "fedprox", "fedhe"], choices=list(VARIANTS))
    ap.add_argument("--partitions", nargs="+", default=["iid", "dirichlet"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--sample-ratio", type=float, default=0.25)
    ap.add_argument("--samples", type=int, default=600)
    ap.add_argument("--width", type=float, default=0.25)
    ap.add_argument("--eval-every", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tag", default="all")
    ap.add_argument("--merge", nargs="+", type=users_file, default=None, help="result files to merge into one table (no training)")
    ap.add_argument("--targets", type=float, nargs="+", default=[0.75, 0.80])
    ap.add_argument("--plot-dir", type=users_path, default=None)
    args = ap.parse_args()
    if args.merge:
        merge(args.merge, args.targets, args.plot_dir)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    run(args)


if __name__ == "__main__":
    main()
