"""Benchmark (issue 5): the cost model's predictions against measurements on this host.

For every zoo classifier and generator (reduced widths where full width would take minutes per
step on 2 cores; the width is part of the model's name in the table), each measured in its own
child process by ``edgefl device-profile``'s code:

* step time against the median of ``--steps`` timed training steps;
* peak training memory against the child's peak RSS minus its RSS before the model was built.

Three versions of the cost model side by side: *naive* (``3 x forward FLOPs x batch`` at one
effective GFLOP/s, the median over the models; ``params x 16 + activations x batch`` for Adam),
*four_term* (the previous form, re-fitted here: operators, all FLOPs, params and new-tensor bytes,
one rate each; memory: activations x a factor + a constant) and *full* (``edgefl
device-profile``'s current fit, :func:`edgefl.profile.cost.fit_step_model`: every kind of work at
its own rate, the optimizer fitted apart; memory adds the largest parameter tensor). The fits
are calibrated on the models ``edgefl device-profile`` measures by default
(those of them this benchmark measures with the same options) and evaluated on every model.
``--from-results FILE`` re-evaluates saved measurements without measuring again. The target is
within 25 % for both.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from common import read_results, save, users_file

from edgefl.models import get_spec
from edgefl.profile.cost import fit_step_model, forward_stats, freeze, relative_nnls
from edgefl.profile.measure import DEFAULT_MODELS, ModelCandidate, measure_model

MODELS = [
    "cnn-small", "lenet5", *[f"fedhe-cnn-{i}:width=0.5" for i in range(10)],
    "resnet10:width=0.25", "resnet14:width=0.25", "resnet18:width=0.25", "resnet22:width=0.25", "resnet26:width=0.25",
    "resnet34:width=0.25", "resnet50:width=0.25", "vgg9:width=0.25", "cvae-small", "cvae-large:width=0.5",
]


def measure(args) -> list[dict]:
    t0 = time.perf_counter()
    rows = []
    for text in args.models:
        cand = ModelCandidate.parse(text)
        m = measure_model(cand, (1, 28, 28), args.batch, args.steps, "cuda" if torch.cuda.is_available() else "cpu")
        if "error" in m:
            print(f"{cand.label}: {m['error']}", flush=True)
            continue
        rows.append({"model": cand.label, "spec": text, "kind": get_spec(cand.name).kind, "flops": m["flops_per_sample"],
                     "params": m["params"], "batch": args.batch, "step_s": m["step_s"], "optimizer_s": m["optimizer_s"],
                     "train_gflops": m["train_gflops"], "memory_measured": m["train_memory_bytes"],
                     "memory_method": m.get("memory_method", "rss")})
        print(f"measured {cand.label:28s} step {m['step_s'] * 1000:8.1f} ms  {m['train_gflops']:6.2f} GFLOP/s  "
              f"memory {m['train_memory_bytes'] / 2**20:7.1f} MiB (elapsed {time.perf_counter() - t0:.0f}s)", flush=True)
    return rows


def four_term_columns(r: dict) -> list[float]:
    """The previous session's form: operators, all FLOPs, params, new-tensor bytes, one rate each."""
    st = r["stats"]
    return [st.operators, 3 * r["flops"] * r["batch"], r["params"], st.new_bytes * r["batch"]]


def fit_four_term(rows: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """The previous form's step coefficients and its memory coefficients (activation factor, constant)."""
    t = np.array([r["step_s"] for r in rows])
    step = relative_nnls([four_term_columns(r) for r in rows], t, t)
    measured = np.array([r["memory_measured"] for r in rows], dtype=float)
    memory = relative_nnls([four_term_memory_columns(r) for r in rows],
                           measured - np.array([r["params"] * 16 for r in rows], dtype=float), measured)
    return step, memory


def four_term_memory_columns(r: dict) -> list[float]:
    return [r["stats"].new_bytes * r["batch"], 1.0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--from-results", type=users_file, default=None, help="re-evaluate the measurements of an earlier run")
    ap.add_argument("--calibrate-on", nargs="+", default=DEFAULT_MODELS,
                    help="models whose measurements fit the host terms (default: edgefl device-profile's default set)")
    args = ap.parse_args()
    if args.from_results:
        rows = read_results(args.from_results, "rows")
    else:
        rows = measure(args)
    for r in rows:  # the model statistics come from the current cost model (the measurements stay)
        cand = ModelCandidate.parse(r["spec"])
        r["stats"] = forward_stats(cand.name, freeze(cand.options), (1, 28, 28), 10)
    batch = rows[0]["batch"]
    effective = statistics.median(r["train_gflops"] for r in rows)
    calibration = [r for r in rows if r["spec"] in args.calibrate_on]
    four_term, four_term_memory = fit_four_term(calibration)
    fit = fit_step_model(calibration)
    print(f"\nnaive: effective {effective:.2f} GFLOP/s (median over {len(rows)} models)")
    print(f"full fit on {len(calibration)} models: " + ", ".join(f"{k} {v:.4g}" for k, v in vars(fit).items()) + "\n")
    keys = ("naive", "four_term", "full")
    print(f"{'model':28s} {'step':>9s} " + " ".join(f"{k:>9s}" for k in keys) + f" {'memory':>9s} " + " ".join(f"{k:>9s}" for k in keys))
    within = {f"{what}_{k}": 0 for what in ("time", "memory") for k in keys}
    for r in rows:
        st = r["stats"]
        r["step_naive"] = 3 * r["flops"] * batch / (effective * 1e9)
        r["step_four_term"] = float(np.dot(four_term_columns(r), four_term))
        r["step_full"] = fit.step_seconds(st, r["params"], batch)
        r["memory_naive"] = r["params"] * 16 + st.new_bytes * batch
        r["memory_four_term"] = r["params"] * 16 + float(np.dot(four_term_memory_columns(r), four_term_memory))
        r["memory_full"] = fit.memory_bytes(r["params"], 8, st, batch)
        for key in keys:
            r[f"time_error_{key}"] = r[f"step_{key}"] / r["step_s"] - 1
            r[f"memory_error_{key}"] = r[f"memory_{key}"] / r["memory_measured"] - 1
            within[f"time_{key}"] += int(abs(r[f"time_error_{key}"]) <= 0.25)
            within[f"memory_{key}"] += int(abs(r[f"memory_error_{key}"]) <= 0.25)
        print(f"{r['model']:28s} {r['step_s'] * 1000:7.1f}ms " + " ".join(f"{r[f'time_error_{k}']:+9.0%}" for k in keys)
              + f" {r['memory_measured'] / 2**20:7.1f}Mi " + " ".join(f"{r[f'memory_error_{k}']:+9.0%}" for k in keys))
        r["stats"] = vars(st)
    n = len(rows)
    print("\nwithin 25 %: step time " + ", ".join(f"{k} {within[f'time_{k}']}/{n}" for k in keys)
          + "; memory " + ", ".join(f"{k} {within[f'memory_{k}']}/{n}" for k in keys))
    worst = max(rows, key=lambda r: abs(r["time_error_full"]))
    print(f"largest full-fit time error: {worst['model']} {worst['time_error_full']:+.1%}")
    path = save("cost_model", {"args": {k: str(v) for k, v in vars(args).items()}, "effective_gflops_median": effective,
                               "fit_four_term": {"step": list(four_term), "memory": list(four_term_memory)}, "fit": vars(fit), "rows": rows,
                               "within_25pct": within})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
