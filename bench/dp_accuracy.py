"""Benchmark 23: accuracy against epsilon under the differential-privacy filters (issue 36).

Fashion-MNIST, one seed, each private run beside the same run without privacy (same seed, shares,
initial weights and batch order):

* FedAvg, LeNet-5 (``lenet5``) on every device, with device-level DP-FedAvg (``dp-fedavg``) at
  ``target_epsilon`` in ``--epsilons`` (the noise multiplier derived from the planned rounds,
  every device selected each round: sampling rate 1). DP-FedAvg's noise on the mean has standard
  deviation z x clip / m per weight, m the devices of a round: the run uses as many devices as the
  2-core CPU allows (``--clients``, ``--samples`` images each, ``--steps`` batches of 32 a round).
* FedHe, the ten FedHe CNNs at width ``--fedhe-width``, one per device, with local DP of the
  logits uploads (``local-dp``) at the noise multipliers that give the same epsilons per device
  over its rounds (each device takes part in every round; the per-device epsilon_max the run
  reports is in the table).

``clip``: the "none" run of each method carries the filter with nothing it does (``dp-fedavg``
clip 1e6 and noise 0; ``local-dp`` clip 1e6 and noise 0, so it is the non-private run: with equal
shares DP-FedAvg's uniform weighting equals FedAvg's sample weighting) and the script records
what the filter sees (each device's update norm; each reported logits row's norm). Unless
``--clip`` / ``--fedhe-clip`` is given, ``clip`` for the private runs is the median of those norms
over the run (docs/privacy.md: "clip near the median update norm of a non-private run").

Scaled for a 2-core CPU (about 12 minutes with the defaults): FedAvg ``--clients`` 150 devices of
``--samples`` 300 images (IID), ``--rounds`` 10 rounds of ``--steps`` 20 batches of 32 (about two
local epochs), SGD 0.05 with momentum 0.9; FedHe ``--fedhe-clients`` 20 devices, Dirichlet(0.5),
``--fedhe-rounds`` 10 rounds of at most 12 batches of 50, Adam 1e-3. Accuracy on a fixed
``--test-samples``-image test subset after the last round (FedAvg: the global model; FedHe: the
mean over the devices' models).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import torch
from common import RESULTS, load, run_config, save, save_figure, users_path

from edgefl.filters.dp import DPFedAvg
from edgefl.filters.local_dp import LocalDP
from edgefl.privacy.accounting import noise_for

# --- what the filters see: recorded by wrapping their device side (nothing in edgefl changes) ----------
SEEN: list[tuple[int, float]] = []  # (round, norm)
_dp_upload_out, _ldp_upload_out = DPFedAvg.upload_out, LocalDP.upload_out


def _dp_seen(self, message):
    if message.kind == "weights" and self._reference is not None:
        sq = sum(float(((message.tensors[k].double() - r.double()) ** 2).sum()) for k, r in self._reference.items() if k in message.tensors)
        SEEN.append((message.round, math.sqrt(sq)))
    return _dp_upload_out(self, message)


def _ldp_seen(self, message):
    if message.kind == "class_logits":
        for n in message.tensors["logits"].double().norm(dim=1).tolist():
            SEEN.append((message.round, n))
    return _ldp_upload_out(self, message)


DPFedAvg.upload_out, LocalDP.upload_out = _dp_seen, _ldp_seen


def base_config(method: str, args) -> dict:
    if method == "fedavg":
        data = {"dataset": "fashion-mnist", "partition": args.partition, "alpha": 0.5, "samples_per_client": args.samples,
                "test_samples": args.test_samples}
        epochs = math.ceil(args.steps * 32 / args.samples) + 1
        train = {"epochs": epochs, "max_steps": args.steps, "batch_size": 32, "optimizer": "sgd", "lr": args.lr, "momentum": 0.9}
        groups = [{"model": "lenet5", "count": args.clients}]
        rounds = args.rounds
    else:
        data = {"dataset": "fashion-mnist", "partition": args.fedhe_partition, "alpha": 0.5,
                "samples_per_client": args.fedhe_samples, "test_samples": args.test_samples}
        train = {"epochs": 1, "batch_size": 50, "optimizer": "adam", "lr": 1e-3, "max_steps": args.fedhe_steps}
        groups = [{"model": f"fedhe-cnn-{i % 10}", "options": {"width": args.fedhe_width}} for i in range(args.fedhe_clients)]
        rounds = args.fedhe_rounds
    return {"name": f"bench-dp-{method}", "seed": args.seed, "rounds": rounds, "threads": args.threads or 1,
            "method": {"name": method}, "data": data, "train": train, "fleet": {"groups": groups},
            "eval": {"every": args.eval_every}}


def dp_filter(method: str, epsilon: float | None, clip: float, args) -> dict:
    if method == "fedavg":
        if epsilon is None:
            return {"name": "dp-fedavg", "clip": 1e6, "noise_multiplier": 0.0, "delta": args.delta}
        return {"name": "dp-fedavg", "clip": clip, "target_epsilon": epsilon, "delta": args.delta}
    if epsilon is None:
        return {"name": "local-dp", "clip": 1e6, "noise_multiplier": 0.0, "delta": args.delta}
    # each device releases once a round, sampling rate 1: the z that spends epsilon over the rounds
    return {"name": "local-dp", "clip": clip, "noise_multiplier": round(noise_for(epsilon, args.delta, 1.0, args.fedhe_rounds), 4),
            "delta": args.delta}


def run(args) -> dict:
    ds = load()
    rows, t0 = [], time.perf_counter()
    for method in args.methods:
        clip = args.clip if method == "fedavg" else args.fedhe_clip
        measured = None
        for epsilon in [None, *args.epsilons]:
            if epsilon is not None and clip is None:
                raise SystemExit(f"{method}: no clip given and no non-private run to measure it from")
            raw = base_config(method, args)
            raw["filters"] = [dp_filter(method, epsilon, clip, args)]
            SEEN.clear()
            out = run_config(raw, ds)
            hist, s = out["history"], out["summary"]
            curve = [(h["round"], h["accuracy"]["overall"]) for h in hist if h.get("accuracy")]
            facts = (hist[-1].get("filters") or {}).get(raw["filters"][0]["name"], {})
            spent = facts.get("epsilon") if method == "fedavg" else facts.get("epsilon_max")
            norms = [n for _, n in SEEN]
            row = {"method": method, "target_epsilon": epsilon, "epsilon": spent if epsilon is not None else None,
                   "noise_multiplier": facts.get("noise_multiplier"), "clip": raw["filters"][0]["clip"],
                   "delta": args.delta, "filters": raw["filters"], "final": curve[-1][1], "curve": curve,
                   "seen_norm_median": statistics.median(norms) if norms else None,
                   "seen_norm_p10_p90": ([sorted(norms)[len(norms) // 10], sorted(norms)[9 * len(norms) // 10]] if norms else None),
                   "seen_norm_by_round": {r: statistics.median([n for rr, n in SEEN if rr == r]) for r in sorted({r for r, _ in SEEN})},
                   "clipped_share": (sum(n > raw["filters"][0]["clip"] for n in norms) / len(norms)) if norms else None,
                   "privacy": s.get("privacy"), "wall_s": s["wall_time_s"],
                   "complete": all(h["outcome"] == "complete" for h in hist)}
            if epsilon is None:
                measured = row["seen_norm_median"]
                if clip is None:
                    clip = round(measured, 3 if measured < 10 else 1)
                    print(f"{method}: clip = {clip:g}, the median norm the filter saw in the non-private run", flush=True)
                row["clip_chosen"] = clip
            rows.append(row)
            eps = "none" if epsilon is None else f"{spent:.3g}"
            print(f"{method:6s} target {('none' if epsilon is None else f'{epsilon:g}'):>5s}  epsilon {eps:>6s}  "
                  f"z {row['noise_multiplier']:<8.4g} clip {row['clip']:<8g} acc {row['final']:.4f}  "
                  f"norm median {row['seen_norm_median']:.3g} clipped {row['clipped_share']:.0%}  {s['wall_time_s']:.0f}s  "
                  f"(elapsed {time.perf_counter() - t0:.0f}s)", flush=True)
    return {"rows": rows, "elapsed_s": time.perf_counter() - t0}


def table(result: dict, args) -> list[dict]:
    lines = []
    for method in args.methods:
        mine = [r for r in result["rows"] if r["method"] == method]
        base = next((r for r in mine if r["target_epsilon"] is None), None)
        for r in mine:
            lines.append({"method": method, "target_epsilon": r["target_epsilon"], "epsilon": r["epsilon"],
                          "noise_multiplier": r["noise_multiplier"], "clip": r["clip"], "final": r["final"],
                          "delta_points": 100 * (r["final"] - base["final"]) if base else None,
                          "noise_sd_on_mean": (r["noise_multiplier"] * r["clip"] / args.clients) if method == "fedavg" else None,
                          "wall_s": r["wall_s"], "complete": r["complete"]})
    print(f"\n{'method':6s} | {'target eps':>10s} | {'epsilon':>8s} | {'z':>7s} | {'clip':>7s} | {'accuracy':>8s} | {'vs none':>7s} | wall")
    for ln in lines:
        tgt = "none" if ln["target_epsilon"] is None else f"{ln['target_epsilon']:g}"
        eps = "inf" if ln["epsilon"] is None else f"{ln['epsilon']:.3g}"
        print(f"{ln['method']:6s} | {tgt:>10s} | {eps:>8s} | {ln['noise_multiplier']:7.4g} | {ln['clip']:7g} | "
              f"{100 * ln['final']:7.2f}% | {ln['delta_points']:+7.2f} | {ln['wall_s']:.0f}s" + ("" if ln["complete"] else "  (a round failed)"))
    return lines


def plot(lines: list[dict], args, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    labels = {"fedavg": f"FedAvg + dp-fedavg ({args.clients} devices, LeNet-5)",
              "fedhe": f"FedHe + local-dp ({args.fedhe_clients} devices, per-device epsilon)"}
    for i, method in enumerate(m for m in args.methods if any(ln["method"] == m for ln in lines)):
        mine = sorted((ln for ln in lines if ln["method"] == method and ln["epsilon"] is not None), key=lambda ln: ln["epsilon"])
        base = next((ln for ln in lines if ln["method"] == method and ln["epsilon"] is None), None)
        color = f"C{i}"
        ax.plot([ln["epsilon"] for ln in mine], [100 * ln["final"] for ln in mine], "o-", color=color, label=labels[method])
        if base:
            ax.axhline(100 * base["final"], color=color, ls="--", lw=1, label=f"{method}, no privacy")
    ax.axvline(8, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_xlabel(f"epsilon spent over the run (delta {args.delta:g})")
    ax.set_ylabel("final test accuracy (%)")
    ax.set_title("Fashion-MNIST: accuracy against epsilon")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return save_figure(fig, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=["fedavg", "fedhe"], choices=["fedavg", "fedhe"])
    ap.add_argument("--epsilons", type=float, nargs="+", default=[16, 8, 4, 1], help="target epsilons (a non-private run is always added)")
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clients", type=int, default=150, help="FedAvg devices, all selected every round")
    ap.add_argument("--samples", type=int, default=300, help="FedAvg: training images per device")
    ap.add_argument("--partition", default="iid", choices=["iid", "dirichlet"], help="FedAvg partition")
    ap.add_argument("--rounds", type=int, default=10, help="FedAvg rounds")
    ap.add_argument("--steps", type=int, default=20, help="FedAvg: batches of 32 per round")
    ap.add_argument("--lr", type=float, default=0.05, help="FedAvg: local SGD learning rate (momentum 0.9)")
    ap.add_argument("--clip", type=float, default=None, help="dp-fedavg clip (default: the median update norm of the non-private run)")
    ap.add_argument("--fedhe-clients", type=int, default=20)
    ap.add_argument("--fedhe-samples", type=int, default=600)
    ap.add_argument("--fedhe-partition", default="dirichlet", choices=["iid", "dirichlet"])
    ap.add_argument("--fedhe-rounds", type=int, default=10)
    ap.add_argument("--fedhe-steps", type=int, default=12, help="FedHe: batches of 50 per round at most")
    ap.add_argument("--fedhe-width", type=float, default=0.25)
    ap.add_argument("--fedhe-clip", type=float, default=None, help="local-dp clip (default: the median logits-row norm of the non-private run)")
    ap.add_argument("--test-samples", type=int, default=2000)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default 1)")
    ap.add_argument("--plot", type=users_path, default=RESULTS / "dp_accuracy.png", help="where the accuracy-vs-epsilon figure goes")
    ap.add_argument("--tag", default="", help="suffix of the results file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads or 1)
    print(f"settings: FedAvg {args.clients} devices x {args.samples} images ({args.partition}), {args.rounds} rounds of {args.steps} "
          f"batches of 32 (LeNet-5); FedHe {args.fedhe_clients} devices ({args.fedhe_partition}), {args.fedhe_rounds} rounds "
          f"(ten CNNs at width {args.fedhe_width}, <= {args.fedhe_steps} batches of 50); target epsilons {args.epsilons}, "
          f"delta {args.delta:g}, seed {args.seed}: scaled for a 2-core CPU", flush=True)
    result = run(args)
    lines = table(result, args)
    figure = plot(lines, args, args.plot)
    print(f"wrote {figure}")
    path = save("dp_accuracy" + (f"-{args.tag}" if args.tag else ""),
                {"args": vars(args), "configs": {m: base_config(m, args) for m in args.methods}, "table": lines, **result})
    print(f"wrote {path}  ({result['elapsed_s']:.0f}s in all)")


if __name__ == "__main__":
    main()
