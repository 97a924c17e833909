"""Time-to-accuracy on the virtual clock, synchronous vs asynchronous, on a mixed fleet whose
device classes come from firmware_profiles/ (two Android phones, four Pi 4s, two Pi Zero 2 Ws:
the Pi Zeros are the stragglers, about 30x slower than a Pi 4).

Per method (FedHe and FedAvg-groups, each class its own architecture):
* sync, waiting for everyone: rounds whose deadline lets the Pi Zeros finish;
* sync, deadline: rounds closed at twice the Pi 4's time, the Pi Zeros dropped as stragglers,
  as many rounds as fit in the same virtual time (FedHe judges only devices that report, so its
  Pi Zeros are not in this run's mean; FedAvg judges every group's model);
* async: every device trains when free, the server updates on every report (FedHe) or every
  buffer of reports (FedBuff), for the same virtual time as the first.
Accuracy is measured on the same 1,000 test images; the table gives the accuracy reached by
fractions of the time budget and the virtual time to reach the synchronous run's final accuracy.

    ./dev.sh bench async_fl [--rounds 4] [--methods fedhe,fedavg]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from common import RESULTS, load, run_config, save, save_figure

FLEET = [  # each class the kind of model it would get (edgefl assign), small enough for this CPU
    {"profile": "android-midrange", "count": 2, "model": "fedhe-cnn-5", "options": {"width": 0.25}},
    {"profile": "pi4-4gb", "count": 4, "model": "lenet5"},
    {"profile": "pi-zero-2w", "count": 2, "model": "cnn-small"},
]


THREADS = 2


def base(method: str, rounds: int, seed: int) -> dict:
    return {
        "name": f"async-bench-{method}", "seed": seed, "rounds": rounds, "threads": THREADS,
        "method": {"name": method},
        "data": {"dataset": "fashion-mnist", "partition": "dirichlet", "alpha": 0.5, "test_samples": 1000},
        "train": {"epochs": 1, "batch_size": 50, "optimizer": "adam", "lr": 0.001, "max_steps": 10},
        "fleet": {"groups": FLEET},
        "eval": {"every": 1},
    }


FAST = {f"client-{i}" for i in range(6)}  # the phones and Pi 4s (the Pi Zeros are client-6 and client-7)


def score(h: dict, fast_only: bool) -> float:
    """The record's overall accuracy, or the mean over the phones and Pi 4s only: FedHe judges a
    device by what it reports, so a run that drops the Pi Zeros has no Pi Zero in its mean."""
    if not fast_only:
        return h["accuracy"]["overall"]
    fast = [a for d, a in h["accuracy"]["per_client"].items() if d in FAST]
    return sum(fast) / len(fast)


def sync_curve(history: list[dict], fast_only: bool = False) -> list[tuple[float, float]]:
    """(virtual time at the end of each round, accuracy)."""
    t, out = 0.0, []
    for h in history:
        t += h.get("round_virtual_s") or 0.0
        if h["accuracy"]:
            out.append((round(t, 2), score(h, fast_only)))
    return out


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    return next((t for t, acc in curve if acc >= target - 1e-9), None)


def at(curve: list[tuple[float, float]], when: float) -> float | None:
    seen = [acc for t, acc in curve if t <= when + 0.01]  # curves are rounded to 0.01 s
    return seen[-1] if seen else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", default="fedhe,fedavg")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    global THREADS
    THREADS = args.threads
    ds = load("fashion-mnist")
    results: dict = {}
    for method in args.methods.split(","):
        t0 = time.perf_counter()
        wait = base(method, args.rounds, args.seed)
        wait["clock"] = {"deadline_s": 1e6}
        runs = {"sync (wait for all)": run_config(wait, ds)}
        first = runs["sync (wait for all)"]["history"][0]["virtual_time_by_profile"]
        budget = sum(h["round_virtual_s"] for h in runs["sync (wait for all)"]["history"])
        deadline_s = round(2 * first["pi4-4gb"], 3)
        fitting = max(1, int(budget / deadline_s))
        deadline = base(method, fitting, args.seed)
        deadline["clock"] = {"deadline_s": deadline_s}
        deadline["network"] = {"quorum": 0.5}
        deadline["eval"] = {"every": max(1, fitting // (2 * args.rounds))}
        runs["sync (deadline, stragglers dropped)"] = run_config(deadline, ds)
        asynchronous = base(method, 10**7, args.seed)
        asynchronous["mode"] = "async"
        asynchronous["asynchronous"] = {"time_budget_s": round(budget, 3), "eval_every_s": round(budget / (2 * args.rounds), 3)}
        runs["async"] = run_config(asynchronous, ds)
        curves, fast = {}, {}
        for label, run in runs.items():
            history = run["history"]
            for fast_only, out in ((False, curves), (True, fast)):
                out[label] = ([(h["clock_s"], score(h, fast_only)) for h in history if h["accuracy"]]
                              if label == "async" else sync_curve(history, fast_only))
        target = curves["sync (wait for all)"][-1][1]
        reports = {label: sum(h.get("reports", len(h["reported"])) for h in run["history"]) for label, run in runs.items()}
        results[method] = {
            "budget_virtual_s": round(budget, 2),
            "class_seconds_round_1": first,
            "deadline_s": deadline_s,
            "deadline_rounds": fitting,
            "curves": curves,
            "curves_fast_devices": fast,
            "fast_accuracy_at": {label: {f: at(c, budget * f) for f in (0.25, 0.5, 1.0)} for label, c in fast.items()},
            "target": target,
            "time_to_target_s": {label: time_to(c, target) for label, c in curves.items()},
            "accuracy_at": {label: {f: at(c, budget * f) for f in (0.25, 0.5, 1.0)} for label, c in curves.items()},
            "reports": reports,
            "reports_by_profile_async": _by_profile(runs["async"]["history"]),
            "wall_s": round(time.perf_counter() - t0, 1),
        }
        _print(method, results[method])
    path = save("async_fl", {"rounds": args.rounds, "seed": args.seed, "fleet": FLEET, "results": results})
    print(f"saved {path}; plot {_plot(results, RESULTS / 'async_fl.png')}")


def _by_profile(history: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for h in history:
        for k, n in h["reports_by_profile"].items():
            out[k] = out.get(k, 0) + n
    return out


def _print(method: str, r: dict) -> None:
    print(f"\n{method}: budget {r['budget_virtual_s']} virtual s (sync waits for the Pi Zeros; round 1 by class "
          f"{r['class_seconds_round_1']}), deadline variant {r['deadline_rounds']} rounds of {r['deadline_s']} s; target = sync final {r['target']:.4f}")
    print(f"{'run':38} {'acc@25%':>8} {'acc@50%':>8} {'acc@100%':>9} {'time to target':>15} {'reports':>8}")
    for label in r["curves"]:
        a = r["accuracy_at"][label]
        ttt = r["time_to_target_s"][label]
        fmt = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
        f = r["fast_accuracy_at"][label]
        print(f"{label:38} {fmt(a[0.25]):>8} {fmt(a[0.5]):>8} {fmt(a[1.0]):>9} {('-' if ttt is None else f'{ttt:.1f} s'):>15} "
              f"{r['reports'][label]:>8}   phones+Pi 4s {fmt(f[0.25])} {fmt(f[0.5])} {fmt(f[1.0])}")
    print(f"async reports by class: {r['reports_by_profile_async']}   ({r['wall_s']} s wall)")


def _plot(results: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (method, r) in zip(axes[0], results.items()):
        for k, (label, curve) in enumerate(r["curves"].items()):
            ax.plot([t for t, _ in curve], [a for _, a in curve], marker="o", markersize=3, color=f"C{k}", label=label)
            fast = r["curves_fast_devices"][label]
            ax.plot([t for t, _ in fast], [a for _, a in fast], linestyle="--", color=f"C{k}", alpha=0.7,
                    label=f"{label}, phones + Pi 4s")
        ax.set(title=f"{method}: accuracy over virtual time", xlabel="virtual seconds", ylabel="test accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, out)


if __name__ == "__main__":
    main()
