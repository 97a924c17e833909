"""FedHe against Local-only in the paper's own training regime (the fedhe-paper preset, scaled to
width 0.25 and a 1,000-image test subset for this CPU): asynchronous, one client at a time drawn at random, three mini-batches
of 50 per step, Adam 1e-3, alpha = 1 with MSE. Fashion-MNIST, IID and Dirichlet(0.5), several
seeds; then, on Dirichlet(0.5), one change at a time of what could make FedHe trail Local-only:
Eq. 8's +1, Eq. 10 unweighted vs count-weighted, the warm-up, and the logit loss's weight.

    ./dev.sh bench fedhe_paper_regime [--updates 1000] [--seeds 0,1,2] [--partitions iid,dirichlet] [--variants only|no|yes]
                                      [--threads 2] [--tag NAME]
"""

from __future__ import annotations

import argparse
import copy
import time

from common import RESULTS, load, mean_std, run_config, save, save_figure

from edgefl.config import preset_text

try:
    import tomllib
except ImportError:  # pragma: no cover
    import tomli as tomllib

VARIANTS = {
    "Eq. 8 without +1 (count_offset = 0)": {"count_offset": 0},
    "Eq. 10 count-weighted": {"server_weighting": "count"},
    "no warm-up": {"warmup_rounds": 0},
    "long warm-up (500 downloads)": {"warmup_rounds": 500},
    "alpha = 0.3": {"alpha": 0.3},
    "KL at T = 2 instead of MSE": {"logit_loss": "kl", "temperature": 2.0},
}


def regime(updates: int, seed: int, partition: str, method: str, threads: int = 2, **options) -> dict:
    raw = tomllib.loads(preset_text("fedhe-paper"))
    raw = copy.deepcopy(raw)
    raw.update(seed=seed, rounds=updates, threads=threads)
    raw["eval"] = {"every": max(1, updates // 8)}
    raw["data"]["partition"] = partition
    raw["data"]["test_samples"] = 1000  # judging ten full-resolution CNNs costs more than training them here
    for group in raw["fleet"]["groups"]:
        group["options"] = {"width": 0.25}
    if method == "local":
        raw["method"] = {"name": "local"}
    else:
        raw["method"].update(options)
    return raw


def final(run: dict) -> tuple[float, dict[str, float]]:
    acc = run["summary"]["final_accuracy"]
    return acc["overall"], acc["per_arch"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--updates", type=int, default=1000)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--partitions", default="iid,dirichlet")
    ap.add_argument("--variants", choices=("yes", "no", "only"), default="yes")
    ap.add_argument("--which", default=None, help="variants to run, by number in VARIANTS (e.g. 0,1,2); default all")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tag", default="", help="suffix of the results file (runs split over processes)")
    args = ap.parse_args()
    partitions = args.partitions.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    ds = load("fashion-mnist")
    table: dict = {}
    curves: dict = {}
    for partition in partitions if args.variants != "only" else []:
        for method in ("fedhe", "local"):
            finals, arch_rows = [], []
            for seed in seeds:
                t0 = time.perf_counter()
                run = run_config(regime(args.updates, seed, partition, method, args.threads), ds)
                overall, per_arch = final(run)
                finals.append(overall)
                arch_rows.append(per_arch)
                curves[f"{method} {partition} s{seed}"] = [(h["round"], h["accuracy"]["overall"]) for h in run["history"] if h["accuracy"]]
                print(f"{partition:9} {method:6} seed {seed}: {overall:.4f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
            m, s = mean_std(finals)
            per_arch = {a: sum(r[a] for r in arch_rows) / len(arch_rows) for a in arch_rows[0]}
            table[f"{partition} {method}"] = {"mean": m, "std": s, "finals": finals, "per_arch": per_arch}
    variants: dict = {}
    if args.variants != "no":
        base_seed = seeds[0]
        chosen = [int(k) for k in args.which.split(",")] if args.which else range(len(VARIANTS))
        for label, options in [list(VARIANTS.items())[k] for k in chosen]:
            t0 = time.perf_counter()
            run = run_config(regime(args.updates, base_seed, "dirichlet", "fedhe", args.threads, **options), ds)
            overall, per_arch = final(run)
            variants[label] = {"options": options, "final": overall, "per_arch": per_arch}
            print(f"variant {label}: {overall:.4f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    print("\nfinal accuracy (mean +- std over seeds " + ",".join(map(str, seeds)) + f"), {args.updates} server updates")
    for key, row in table.items():
        print(f"  {key:18} {row['mean']:.4f} +- {row['std']:.4f}   {[round(f, 4) for f in row['finals']]}")
    for partition in partitions if table else []:
        fed, loc = table[f"{partition} fedhe"]["per_arch"], table[f"{partition} local"]["per_arch"]
        print(f"  {partition}: FedHe - Local per architecture: " + ", ".join(f"{a.split('(')[0]} {fed[a] - loc[a]:+.3f}" for a in fed))
    if variants:
        print(f"\nDirichlet(0.5), seed {seeds[0]}, FedHe with one change:")
        for label, row in variants.items():
            print(f"  {label:40} {row['final']:.4f}")
    name = "fedhe_paper_regime" + (f"-{args.tag}" if args.tag else "")
    path = save(name, {"updates": args.updates, "seeds": seeds, "table": table, "variants": variants, "curves": curves})
    print(f"saved {path}")
    if curves:
        _plot(curves, RESULTS / f"fedhe_paper_regime{'-' + args.tag if args.tag else ''}.png")


def _plot(curves: dict, out) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, partition in zip(axes, ("iid", "dirichlet")):  # an empty panel for a partition not run here
        for label, curve in curves.items():
            if f" {partition} " in label:
                ax.plot([u for u, _ in curve], [a for _, a in curve], color="C0" if label.startswith("fedhe") else "C1",
                        alpha=0.8, label=label)
        ax.set(title=f"Fashion-MNIST {partition}: FedHe vs Local-only, paper regime", xlabel="server updates (one per report)",
               ylabel="mean device accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, out)


if __name__ == "__main__":
    main()
