"""Benchmark 22: what DP-SGD costs per local training step against plain training (issue 36).

The same model, data, optimizer and batch size trained two ways by edgefl's own local loop
(:func:`edgefl.algorithms.training.train_local`), side by side:

* plain: shuffled batches of ``--batch``, one backward, the optimizer's step;
* DP-SGD (``train.dp_sgd``: noise multiplier 1, clip 1, Poisson sampling at q = batch / samples):
  Opacus' per-sample gradients (hooks on every layer), per-sample clipping, seeded Gaussian noise,
  then the same optimizer step.

Real data: ``--samples`` Fashion-MNIST training images (the IDX files of /usr/share/datasets or the
user cache, normalised as runs see them). Two zoo models: LeNet-5 (DP-SGD ready as it is) and
FedHe CNN 0 at ``--width`` built with ``norm = "group"`` (its BatchNorm as Opacus' GroupNorm fix:
plain training uses the same GroupNorm model, so the difference is DP-SGD's alone).

Time: one process per model trains two copies of it (the same initial weights), a warm-up round of
3 steps each, then ``--repeats`` rounds of ``--steps`` steps per mode, plain and DP-SGD
alternating (their order swapped every pair), so both see the same load on a shared machine. A
step's time is its round's time divided by its steps (a round includes attaching and removing
Opacus' hooks, amortised over its steps), as process CPU time (what other jobs on the machine
disturb least) and wall time; "x plain" is the median over the pairs of rounds run back to back.
Memory: a fresh process per (model, mode), a warm-up round, then one round watched: the heap in use
(glibc's mallinfo2, where torch's CPU tensors live) polled every half millisecond, its peak minus
the heap in use just before the round: what training adds on top of the model and the data
(activations, gradients, per-sample gradients, optimizer state). ``--threads`` torch threads (1:
the shared 2-core development machine).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

MODELS = {"lenet5": {}, "fedhe-cnn-0": {"norm": "group"}}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap_bytes() -> int:
    """Bytes the process has allocated and not freed (glibc's mallinfo2: in-use heap blocks plus
    mmapped blocks): torch's CPU tensors live there, and unlike the resident size it does not keep
    what was freed."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


class _PeakHeap:
    """The most heap in use seen by a thread polling mallinfo2 every half millisecond."""

    def __init__(self) -> None:
        self.peak = _heap_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _heap_bytes())
            time.sleep(0.0005)

    def __enter__(self) -> _PeakHeap:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _heap_bytes())


def child(args: argparse.Namespace) -> None:
    """One model in a fresh process. ``time``: plain and DP-SGD rounds alternating on two copies of
    the model (the same initial weights), so both see the same load on a shared machine; ``plain``
    or ``dp-sgd``: one watched round of that mode alone, for its peak memory. A JSON line out."""
    torch.set_num_threads(args.threads)
    import opacus  # noqa: F401  (every process imports it: the same baseline)
    from torch.nn import functional as F

    from edgefl.algorithms.training import DPNoise, train_local
    from edgefl.config import DPSGDSettings, TrainSettings
    from edgefl.models import build_model
    from edgefl.seeding import generator

    x, y = torch.load(args.data)
    options = dict(MODELS[args.model])
    if args.model.startswith("fedhe-cnn"):
        options["width"] = args.width

    def build():
        torch.manual_seed(0)
        return build_model(args.model, num_classes=10, input_shape=tuple(x.shape[1:]), **options)

    def round_(model, mode: str, round_no: int, steps: int):
        dp = mode == "dp-sgd"
        cfg = TrainSettings(epochs=100, batch_size=args.batch, optimizer="sgd", lr=0.01, momentum=0.9, max_steps=steps,
                            dp_sgd=DPSGDSettings(noise_multiplier=1.0, max_grad_norm=1.0) if dp else None)
        noise = DPNoise(1.0, torch.Generator().manual_seed(round_no)) if dp else None
        return train_local(model, x, y, cfg, generator(0, "bench", round_no), lambda xb, yb: F.cross_entropy(model(xb), yb), dp=noise)

    if args.mode == "time":
        models = {"plain": build(), "dp-sgd": build()}
        for mode, model in models.items():
            round_(model, mode, 0, 3)  # warm-up: allocator, kernels, Opacus' first hooks
        out = {mode: {"wall_s": [], "cpu_s": [], "samples": []} for mode in models}
        for r in range(1, args.repeats + 1):
            for mode in (("plain", "dp-sgd") if r % 2 else ("dp-sgd", "plain")):
                wall, cpu = time.perf_counter(), time.process_time()
                stats = round_(models[mode], mode, r, args.steps)
                out[mode]["wall_s"].append((time.perf_counter() - wall) / stats.steps)
                out[mode]["cpu_s"].append((time.process_time() - cpu) / stats.steps)
                out[mode]["samples"].append(stats.samples / stats.steps)
        print(json.dumps({"model": args.model, "params": sum(p.numel() for p in models["plain"].parameters()), **out}))
        return
    model = build()
    round_(model, args.mode, 0, 3)
    base = _heap_bytes()
    with _PeakHeap() as peak:
        round_(model, args.mode, 1, args.steps)
    print(json.dumps({"model": args.model, "mode": args.mode, "peak_extra_bytes": peak.peak - base}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--samples", type=int, default=4096, help="Fashion-MNIST training images the rounds draw from")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed round")
    parser.add_argument("--repeats", type=int, default=6, help="timed rounds per mode (alternating plain and DP-SGD)")
    parser.add_argument("--width", type=float, default=0.5, help="FedHe CNN 0's width")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "MODE", "DATA"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.model, args.mode, args.data = args.child
        child(args)
        return

    from common import load, save

    ds = load("fashion-mnist")
    x, y = ds.model_input(ds.x_train[: args.samples]), ds.y_train[: args.samples]
    timed, memory = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data.pt"
        torch.save((x.contiguous(), y.contiguous()), data)

        def run(model: str, mode: str) -> dict:
            cmd = [sys.executable, __file__, "--child", model, mode, str(data), *_passed(args)]
            return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1])

        for model in MODELS:
            timed[model] = run(model, "time")
            memory[model] = {mode: run(model, mode)["peak_extra_bytes"] for mode in ("plain", "dp-sgd")}
            t = timed[model]
            print(f"{model}: plain {statistics.median(t['plain']['cpu_s']) * 1e3:.1f} ms, DP-SGD "
                  f"{statistics.median(t['dp-sgd']['cpu_s']) * 1e3:.1f} ms CPU a step", file=sys.stderr, flush=True)
    table = _table(timed, memory, args)
    print(table)
    path = save("dp_sgd_cost", {"timed": timed, "memory": memory, "args": vars(args), "table": table})
    print(f"results in {path}", file=sys.stderr)


def _passed(args: argparse.Namespace) -> list[str]:
    return [f"--{k}={getattr(args, k)}" for k in ("batch", "steps", "repeats", "width", "threads")]


def _table(timed: dict, memory: dict, args: argparse.Namespace) -> str:
    out = ["| model | params | mode | samples a step | CPU ms a step (median, min-max) | x plain | wall ms a step | peak extra memory | x plain | "
           "per-sample gradients (batch x params x 4 B) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for model, t in timed.items():
        name = model if model != "fedhe-cnn-0" else f"fedhe-cnn-0 (width {args.width:g}, norm=group)"
        # the ratio of each pair of rounds run back to back, then the median: the load they shared cancels
        ratios = [d / p for d, p in zip(t["dp-sgd"]["cpu_s"], t["plain"]["cpu_s"])]
        for mode in ("plain", "dp-sgd"):
            cpu, wall = t[mode]["cpu_s"], t[mode]["wall_s"]
            mem, plain_mem = memory[model][mode], memory[model]["plain"]
            dp = mode == "dp-sgd"
            grads = f"{args.batch * t['params'] * 4 / 2**20:.1f} MiB" if dp else ""
            out.append(
                f"| {name} | {t['params']:,} | {mode} | {statistics.fmean(t[mode]['samples']):.1f} | "
                f"{statistics.median(cpu) * 1e3:.1f} ({min(cpu) * 1e3:.1f}-{max(cpu) * 1e3:.1f}) | "
                f"{statistics.median(ratios) if dp else 1:.2f} | {statistics.median(wall) * 1e3:.1f} | {mem / 2**20:.1f} MiB | "
                f"{f'{mem / plain_mem:.1f}' if dp and plain_mem >= 2**20 else '-' if dp else ''} | "
                f"{grads} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
