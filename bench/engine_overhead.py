"""Benchmark 1: engine overhead. One FedAvg round of the simulation engine against a plain
PyTorch loop doing the same local training (same data, model, initial weights, batches, steps).

FedAvg is the worst case for the engine: full weights are serialised down and up for every
client, every round, and averaged. The plain loop only loads weights and trains. The two are
timed alternately in one process (``--repeats`` pairs) and the ratio of medians is reported;
the target is <= 1.10.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from common import load, save
from torch.nn import functional as F

from edgefl.algorithms.training import make_optimizer
from edgefl.config import validate_config
from edgefl.sim import Simulation


def plain_round(models, datas, global_state, cfg_train, seeds) -> None:
    for model, (x, y), seed in zip(models, datas, seeds):
        model.load_state_dict(global_state)
        model.train()
        opt = make_optimizer(model.parameters(), cfg_train)
        g = torch.Generator()
        g.manual_seed(seed)
        order = torch.randperm(len(y), generator=g)
        for step in range(cfg_train.max_steps):
            idx = order[step * cfg_train.batch_size : (step + 1) * cfg_train.batch_size]
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="fedhe-cnn-5")
    ap.add_argument("--width", type=float, default=0.25)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    ds = load()
    raw = {
        "name": "bench-overhead", "seed": 0, "rounds": 10_000, "method": {"name": "fedavg"},
        "data": {"dataset": "fashion-mnist", "partition": "iid"},
        "train": {"batch_size": 50, "max_steps": args.steps, "optimizer": "adam"},
        "fleet": {"groups": [{"model": args.model, "count": args.clients, "options": {"width": args.width}}]},
        "eval": {"every": 10_000},
    }
    cfg = validate_config(raw)
    sim = Simulation(cfg, None, dataset=ds, show_progress=False)
    clients = list(sim.clients.values())
    # the plain loop gets its own copies of the same models, data and starting weights
    models = [copy.deepcopy(c.model) for c in clients]
    datas = [(c.setup.x, c.setup.y) for c in clients]
    global_state = {k: v.clone() for k, v in sim.server.global_models()[clients[0].setup.arch].items()}
    engine_s, plain_s = [], []
    sim.run_round(1)  # warm-up both paths (allocator, kernels)
    plain_round(models, datas, global_state, cfg.train, range(args.clients))
    for rep in range(args.repeats):
        t = time.perf_counter()
        sim.run_round(rep + 2)
        engine_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        plain_round(models, datas, global_state, cfg.train, range(args.clients))
        plain_s.append(time.perf_counter() - t)
        print(f"pair {rep + 1}: engine {engine_s[-1]:.3f}s  plain {plain_s[-1]:.3f}s", flush=True)
    # the engine's rounds did the same work: every device reported and trained the same batches
    assert all(h["outcome"] == "complete" and len(h["reported"]) == args.clients for h in sim.history), "an engine round was incomplete"
    assert all(c.last_train_samples == args.steps * cfg.train.batch_size for c in clients), "engine clients trained other batches"
    e, p = statistics.median(engine_s), statistics.median(plain_s)
    ratio = e / p
    bytes_round = sim.history[-1]["bytes_up"] + sim.history[-1]["bytes_down"] if sim.history else None
    pairs = sorted(a / b for a, b in zip(engine_s, plain_s))
    print(f"\nmedian engine round {e:.3f}s, plain loop {p:.3f}s, ratio {ratio:.3f} (target <= 1.10); "
          f"pair ratios {pairs[0]:.2f}-{pairs[-1]:.2f}")
    path = save("engine_overhead", {"args": vars(args), "engine_s": engine_s, "plain_s": plain_s, "median_engine_s": e,
                                    "median_plain_s": p, "ratio": ratio, "bytes_per_round": bytes_round})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
