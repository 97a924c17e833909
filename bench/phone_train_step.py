"""Benchmark 24 (issue 37): a training step in ExecuTorch's runtime, per exportable zoo model.

For each model: export the training program (``executorch-train``: cross-entropy inside, SGD in the
runtime) at batch 32, then in a fresh process load it with ExecuTorch's Python bindings and time
``forward_backward`` + the runtime's SGD step (median of N after warm-up, one thread as the
runtime's portable kernels use) and the process's resident memory growth from before loading the
program to after the last step (the planned arena, weights, gradients); the same step in PyTorch eager (one thread) beside it. Models the training path cannot
take are listed with the reason.

    python bench/phone_train_step.py [--steps 30] [--out bench/results/phone_train_step.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = [("mlp", (1, 28, 28), {}), ("lenet5", (1, 28, 28), {}), ("cnn-small", (1, 28, 28), {}),
          ("fedhe-cnn-0", (1, 28, 28), {}), ("resnet10", (3, 32, 32), {}), ("vgg9", (3, 32, 32), {})]
BATCH = 32


def _rss_mib() -> float:
    """The process's resident memory now (not its peak: importing torch peaks above the runtime)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def measure(program: str, shape: list[int], steps: int) -> dict:
    """Runs in a fresh process: only ExecuTorch's runtime, numpy and torch (the bindings' tensors)."""
    import numpy as np
    import torch

    torch.set_num_threads(1)
    from executorch.extension.training import _load_for_executorch_for_training, get_sgd_optimizer

    rss0 = _rss_mib()
    tm = _load_for_executorch_for_training(program)
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((BATCH, *shape)).astype(np.float32))
    y = torch.from_numpy(np.random.default_rng(1).integers(0, 10, BATCH))
    tm.forward_backward("forward", (x, y))
    sgd = get_sgd_optimizer(tm.named_parameters(), 0.01, 0.9, 0.0, 0.0, False)
    times = []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        tm.forward_backward("forward", (x, y))
        sgd.step(tm.named_gradients())
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return {"step_ms_median": 1000 * float(np.median(times)), "step_ms_p90": 1000 * float(np.percentile(times, 90)),
            "rss_growth_mib": round(_rss_mib() - rss0, 1)}


def pytorch_step(net, shape, steps: int) -> float:
    import numpy as np
    import torch

    torch.set_num_threads(1)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(BATCH, *shape), torch.randint(0, 10, (BATCH,))
    times = []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return 1000 * float(np.median(times))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", type=str, default=None, help="default bench/results/phone_train_step.json in the checkout; a "
                   "relative path through ./dev.sh is taken from the folder you ran it in")
    p.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure[0], json.loads(args.measure[1]), args.steps)))
        return
    import torch
    from importlib.metadata import version

    from edgefl.exporters.executorch_train import export_training_program
    from edgefl.exporters.registry import ExportError
    from edgefl.models import build_model

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape, opts in MODELS:
            torch.manual_seed(0)
            net = build_model(name, num_classes=10, input_shape=shape, **opts)
            row = {"model": name, "input": list(shape), "batch": BATCH, "params": sum(q.numel() for q in net.parameters())}
            try:
                prog = export_training_program(net, torch.randn(BATCH, *shape), torch.randint(0, 10, (BATCH,)))
            except ExportError as exc:
                row.update(exportable=False, reason=str(exc))
                rows.append(row)
                print(json.dumps(row), flush=True)
                continue
            path = Path(tmp) / f"{name}.train.pte"
            path.write_bytes(prog.buffer)
            out = subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--measure", str(path), json.dumps(list(shape))],
                                 capture_output=True, text=True)
            if out.returncode != 0:  # exported, but the runtime could not run it: say what it said
                said = [ln.strip() for ln in out.stderr.splitlines() if ln.strip() and "Warning" not in ln and "warn" not in ln]
                errs = [ln for ln in said if "rror" in ln or "ailed" in ln]
                reason = " | ".join((errs or said)[-2:])[:600]
                if "0x14" in reason:
                    reason += " (OperatorMissing: a kernel the runtime's portable library lacks)"
                row.update(exportable=True, runs=False, reason=reason, pte_kib=round(len(prog.buffer) / 1024, 1))
                rows.append(row)
                print(json.dumps(row), flush=True)
                continue
            row.update(runs=True, exportable=True, export_s=round(prog.export_seconds, 1), pte_kib=round(len(prog.buffer) / 1024, 1),
                       rewritten=prog.rewritten, **json.loads(out.stdout.strip().splitlines()[-1]),
                       pytorch_step_ms_median=pytorch_step(net.train(), shape, args.steps))
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"executorch": version("executorch"), "torch": torch.__version__, "threads": 1, "rows": rows}
    from common import RESULTS, users_path  # (here: the --measure child keeps edgefl's imports out of its memory)

    written = users_path(args.out) if args.out is not None else RESULTS / "phone_train_step.json"
    written.parent.mkdir(parents=True, exist_ok=True)
    written.write_text(json.dumps(result, indent=1))
    print(f"wrote {written}")


if __name__ == "__main__":
    main()
