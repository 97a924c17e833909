"""Benchmark (issue 5): the cost model's predictions against measurements on this host.

For every zoo classifier and generator (reduced widths where full width would take minutes per
step on 2 cores; the width is part of the model's name in the table), each measured in its own
child process by ``edgefl device-profile``'s code:

* step time: predicted ``3 x forward FLOPs x batch / effective GFLOP/s`` against the median of
  ``--steps`` timed training steps;
* peak training memory: predicted ``params x 16 + activations x batch`` (Adam) against the
  child's peak RSS minus its RSS before the model was built.

The host's effective GFLOP/s is measured the way ``edgefl device-profile`` measures it (median
train GFLOP/s over the models). Prints the error per model; the target is within 25 % for both.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import save

from edgefl.profile.cost import estimate
from edgefl.profile.measure import ModelCandidate, measure_model

MODELS = [
    "cnn-small", "lenet5", *[f"fedhe-cnn-{i}:width=0.5" for i in range(10)],
    "resnet10:width=0.25", "resnet14:width=0.25", "resnet18:width=0.25", "resnet22:width=0.25", "resnet26:width=0.25",
    "resnet34:width=0.25", "resnet50:width=0.25", "vgg9:width=0.25", "cvae-small", "cvae-large:width=0.5",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=MODELS)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    t0 = time.perf_counter()
    rows = []
    for text in args.models:
        cand = ModelCandidate.parse(text)
        m = measure_model(cand, (1, 28, 28), args.batch, args.steps, "cuda" if torch.cuda.is_available() else "cpu")
        if "error" in m:
            print(f"{cand.label}: {m['error']}", flush=True)
            continue
        est = estimate(cand.name, cand.options, batch=args.batch, optimizer="adam")
        rows.append({"model": cand.label, "kind": est.kind, "flops": m["flops_per_sample"], "params": m["params"],
                     "step_s": m["step_s"], "train_gflops": m["train_gflops"], "memory_measured": m["train_memory_bytes"],
                     "memory_predicted": est.train_memory_bytes})
        print(f"measured {cand.label:28s} step {m['step_s'] * 1000:8.1f} ms  {m['train_gflops']:6.2f} GFLOP/s  "
              f"memory {m['train_memory_bytes'] / 2**20:7.1f} MiB (elapsed {time.perf_counter() - t0:.0f}s)", flush=True)
    effective = statistics.median(r["train_gflops"] for r in rows)
    print(f"\nhost effective GFLOP/s (median over {len(rows)} models): {effective:.2f}\n")
    print(f"{'model':28s} {'step meas':>10s} {'step pred':>10s} {'err':>7s} {'mem meas':>10s} {'mem pred':>10s} {'err':>7s}")
    within = {"time": 0, "memory": 0}
    for r in rows:
        r["step_predicted"] = 3 * r["flops"] * args.batch / (effective * 1e9)
        r["time_error"] = r["step_predicted"] / r["step_s"] - 1
        r["memory_error"] = r["memory_predicted"] / r["memory_measured"] - 1
        within["time"] += abs(r["time_error"]) <= 0.25
        within["memory"] += abs(r["memory_error"]) <= 0.25
        print(f"{r['model']:28s} {r['step_s'] * 1000:8.1f}ms {r['step_predicted'] * 1000:8.1f}ms {r['time_error']:+7.0%} "
              f"{r['memory_measured'] / 2**20:8.1f}Mi {r['memory_predicted'] / 2**20:8.1f}Mi {r['memory_error']:+7.0%}")
    print(f"\nwithin 25 %: step time {within['time']}/{len(rows)}, memory {within['memory']}/{len(rows)}")
    path = save("cost_model", {"args": vars(args), "effective_gflops": effective, "rows": rows, "within_25pct": within})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
