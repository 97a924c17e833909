"""Benchmark 20: what the upload filters save and what they cost (issue 34).

Bytes uploaded per round and final accuracy, each filter chain beside the same run without
filters (same seed, data, initial weights and batches), on Fashion-MNIST:

* FedAvg, a LeNet-style CNN on every device (one group: plain FedAvg), SGD 0.01 with momentum;
* FedHe, the ten FedHe CNNs of paper 002 at width ``--fedhe-width``, one per device, Adam 1e-3.

Chains: none, ``quantize`` 16-bit, ``quantize`` 8-bit (blocks of 256), ``topk`` (fraction
``--topk``), ``topk`` then ``quantize`` 8-bit. FedHe uploads per-class logits, not weights:
``topk`` refuses it before the run starts, and the refusal is printed instead of a row.

Scaled for a 2-core CPU (about 12 minutes): ``--clients`` devices (10), every one selected each
round, at most ``--samples`` training images per device (600, about a tenth of a Dirichlet(0.5)
share); FedAvg ``--rounds`` rounds (30) of ``--epochs`` local epochs (2) in batches of 64, FedHe
``--fedhe-rounds`` rounds (10) of at most ``--fedhe-steps`` batches of 50 (12); evaluated on a
fixed ``--test-samples``-image subset of the test set (2,000) every 3 rounds and at the end. Bytes are the encoded uploads (``bytes_up`` of metrics.jsonl: the
message bodies as the wire carries them, tensor names and meta included). Accuracy is the mean
over the devices' models of the last round (FedAvg: the global model, FedHe: each device's).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path

import torch
from common import RESULTS, load, run_config, save, save_figure, users_path

from edgefl.config import validate_config
from edgefl.errors import ConfigError

CHAINS: dict[str, list[dict]] = {
    "none": [],
    "quantize16": [{"name": "quantize", "bits": 16}],
    "quantize8": [{"name": "quantize", "bits": 8}],
    "topk": [{"name": "topk"}],  # fraction filled in from --topk
    "topk+quantize8": [{"name": "topk"}, {"name": "quantize", "bits": 8}],
}


def base_config(method: str, seed: int, args) -> dict:
    data = {"dataset": "fashion-mnist", "partition": "dirichlet", "alpha": 0.5,
            "samples_per_client": args.samples, "test_samples": args.test_samples}
    if method == "fedavg":
        train = {"epochs": args.epochs, "batch_size": 64, "optimizer": "sgd", "lr": 0.01, "momentum": 0.9, "weight_decay": 1e-5}
        groups = [{"model": "lenet5", "count": args.clients}]
        rounds = args.rounds
    else:
        train = {"epochs": 1, "batch_size": 50, "optimizer": "adam", "lr": 1e-3, "max_steps": args.fedhe_steps}
        groups = [{"model": f"fedhe-cnn-{i % 10}", "options": {"width": args.fedhe_width}} for i in range(args.clients)]
        rounds = args.fedhe_rounds
    return {"name": f"bench-filters-{method}", "seed": seed, "rounds": rounds, "threads": args.threads or 1,
            "method": {"name": method}, "data": data, "train": train,
            "fleet": {"groups": groups}, "eval": {"every": 3}}


def chain(label: str, args) -> list[dict]:
    out = copy.deepcopy(CHAINS[label])
    for entry in out:
        if entry["name"] == "topk":
            entry["fraction"] = args.topk
    return out


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f}"


def run(args) -> dict:
    ds = load()
    rows, refusals = [], []
    t0 = time.perf_counter()
    for method in args.methods:
        for seed in args.seeds:
            for label in args.chains:
                raw = base_config(method, seed, args)
                if chain(label, args):
                    raw["filters"] = chain(label, args)
                try:
                    validate_config(raw, "benchmark config")
                except ConfigError as exc:  # topk for FedHe: refused before anything is created
                    reason = exc.message + (f" ({exc.hint})" if exc.hint else "")
                    if seed == args.seeds[0]:
                        refusals.append({"method": method, "chain": label, "refusal": reason})
                        print(f"{method:6s} {label:15s} refused: {reason}", flush=True)
                    continue
                out = run_config(raw, ds)
                hist, s = out["history"], out["summary"]
                up = [h["bytes_up"] for h in hist]
                curve = [(h["round"], h["accuracy"]["overall"]) for h in hist if h.get("accuracy")]
                rows.append({"method": method, "chain": label, "seed": seed, "filters": raw.get("filters", []),
                             "bytes_up_per_round": statistics.fmean(up), "bytes_up_rounds": up,
                             "bytes_down_per_round": statistics.fmean(h["bytes_down"] for h in hist),
                             "final": curve[-1][1], "curve": curve, "wall_s": s["wall_time_s"],
                             "complete": all(h["outcome"] == "complete" for h in hist)})
                print(f"{method:6s} {label:15s} seed {seed}  up {human(rows[-1]['bytes_up_per_round']):>9s}/round  "
                      f"acc {curve[-1][1]:.4f}  {s['wall_time_s']:.0f}s  (elapsed {time.perf_counter() - t0:.0f}s)", flush=True)
    return {"rows": rows, "refusals": refusals, "elapsed_s": time.perf_counter() - t0}


def table(result: dict, args) -> list[dict]:
    """One line per (method, chain): means over seeds, against the same method without filters."""
    lines = []
    rows = result["rows"]
    for method in args.methods:
        mine = [r for r in rows if r["method"] == method]
        base = [r for r in mine if r["chain"] == "none"]
        base_up = statistics.fmean(r["bytes_up_per_round"] for r in base) if base else None
        base_acc = statistics.fmean(r["final"] for r in base) if base else None
        for label in args.chains:
            these = [r for r in mine if r["chain"] == label]
            if not these:
                continue
            up = statistics.fmean(r["bytes_up_per_round"] for r in these)
            acc = statistics.fmean(r["final"] for r in these)
            lines.append({"method": method, "chain": label, "bytes_up_per_round": up, "final": acc, "seeds": len(these),
                          "smaller": base_up / up if base_up else None,
                          "delta_points": 100 * (acc - base_acc) if base_acc is not None else None,
                          "wall_s": statistics.fmean(r["wall_s"] for r in these), "complete": all(r["complete"] for r in these)})
    print(f"\n{'method':6s} | {'filters':15s} | {'up per round':>12s} | {'smaller':>7s} | {'accuracy':>8s} | {'vs none':>8s} | wall")
    for ln in lines:
        smaller = f"{ln['smaller']:.1f}x" if ln["smaller"] else "-"
        delta = f"{ln['delta_points']:+.2f}" if ln["delta_points"] is not None else "-"
        print(f"{ln['method']:6s} | {ln['chain']:15s} | {human(ln['bytes_up_per_round']):>12s} | {smaller:>7s} | "
              f"{100 * ln['final']:7.2f}% | {delta:>8s} | {ln['wall_s']:.0f}s" + ("" if ln["complete"] else "  (a round failed)"))
    for r in result["refusals"]:
        print(f"{r['method']:6s} | {r['chain']:15s} | refused: {r['refusal']}")
    return lines


def plot(lines: list[dict], args, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m in args.methods if any(ln["method"] == m for ln in lines)]
    fig, axes = plt.subplots(1, len(methods), figsize=(5.2 * len(methods), 4.0), squeeze=False)
    for ax, method in zip(axes[0], methods):
        for ln in (x for x in lines if x["method"] == method):
            ax.scatter(ln["bytes_up_per_round"], 100 * ln["final"], s=40)
            ax.annotate(ln["chain"], (ln["bytes_up_per_round"], 100 * ln["final"]), textcoords="offset points", xytext=(5, 4), fontsize=8)
        ax.set_xscale("log")
        ax.set_xlabel("bytes uploaded per round (all devices)")
        ax.set_ylabel("final test accuracy (%)")
        ax.set_title(f"{method}, Fashion-MNIST, {args.clients} devices")
        ax.grid(alpha=0.3, which="both")
    return save_figure(fig, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=["fedavg", "fedhe"])
    ap.add_argument("--chains", nargs="+", default=list(CHAINS), choices=list(CHAINS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--rounds", type=int, default=30, help="FedAvg rounds")
    ap.add_argument("--epochs", type=int, default=2, help="FedAvg local epochs per round")
    ap.add_argument("--fedhe-rounds", type=int, default=10)
    ap.add_argument("--fedhe-steps", type=int, default=12, help="FedHe: batches of 50 per round at most")
    ap.add_argument("--fedhe-width", type=float, default=0.25)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--samples", type=int, default=600, help="training images per device")
    ap.add_argument("--test-samples", type=int, default=2000)
    ap.add_argument("--topk", type=float, default=0.01, help="topk fraction")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default 1)")
    ap.add_argument("--plot", type=users_path, default=RESULTS / "filters_bytes.png", help="where the accuracy-vs-bytes figure goes")
    args = ap.parse_args()
    torch.set_num_threads(args.threads or 1)
    print(f"settings: {args.clients} devices, {args.samples} training images each (Dirichlet 0.5), FedAvg {args.rounds} rounds "
          f"of {args.epochs} epochs (LeNet-5), FedHe {args.fedhe_rounds} rounds (ten CNNs at width {args.fedhe_width}, <= {args.fedhe_steps} batches), "
          f"{args.test_samples} test images, seeds {args.seeds}: a subsample, scaled for a 2-core CPU", flush=True)
    result = run(args)
    lines = table(result, args)
    figure = plot(lines, args, args.plot)
    print(f"wrote {figure}")
    configs = {m: base_config(m, args.seeds[0], args) for m in args.methods}
    path = save("filters_bytes", {"args": vars(args), "configs": configs, "chains": {c: chain(c, args) for c in args.chains},
                                  "table": lines, **result})
    print(f"wrote {path}  ({result['elapsed_s']:.0f}s in all)")


if __name__ == "__main__":
    main()
