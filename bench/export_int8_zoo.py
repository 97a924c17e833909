"""int8 export of every zoo image classifier after a short training: accuracy kept, integer-only.

For each classifier: train it briefly on Fashion-MNIST (Adam, batch 64, ``--steps`` steps, seed 0;
widths as in ``--width``), export ONNX + TFLite with ``int8=True`` (calibrated on 512 training
images), and report side by side: float and int8 test accuracy on ``--test`` test images, their
ratio (the bar is 98 %), the top-1 agreement with PyTorch, whether the int8 TFLite file is
integer-only (every op reads and writes only int8/int32 tensors), its residual ADD count, and the
int8 file's size. A model whose int8 file misses the bar or is not integer-only is reported as a
failure row (the exporter refuses to keep such a file) and the benchmark exits 1.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch
from common import load, save

from edgefl.errors import EdgeflError
from edgefl.exporters import export_model, from_module
from edgefl.exporters.tflite_model import list_ops
from edgefl.models import build_model, get_spec, model_names

WIDTHS = {"resnet": 0.25, "vgg9": 0.25, "fedhe-cnn": 0.25}  # small widths: the ops, not the sizes, decide int8 behaviour


def train(name: str, options: dict, ds, steps: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = build_model(name, num_classes=10, input_shape=(1, 28, 28), **options)
    opt = torch.optim.Adam(model.parameters(), 2e-3)
    gen = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, len(ds.y_train), (64,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(ds.x_train[idx]), ds.y_train[idx]).backward()
        opt.step()
    return model.eval()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=[n for n in model_names() if get_spec(n).kind == "classifier" and n != "mlp"])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--test", type=int, default=2000)
    args = ap.parse_args()
    torch.set_num_threads(1)  # accuracy, not speed, is measured here; one core leaves the other free
    ds = load()
    rows, failed = [], 0
    print(f"{'model':14} {'float':>7} {'int8':>7} {'ratio':>6} {'agree':>6} {'int-only':>8} {'ADDs':>4} {'int8 KiB':>8} {'s':>5}")
    for name in args.models:
        options = next((dict(width=w) for k, w in WIDTHS.items() if name.startswith(k)), {})
        t0 = time.perf_counter()
        model = train(name, options, ds, args.steps)
        src = from_module(model, name, 10, (1, 28, 28), dataset=ds.name, **options)
        with tempfile.TemporaryDirectory() as tmp:
            try:
                files = {f.path.name: f for f in export_model(src, tmp, int8=True, dynamic_batch=False, mobile_check=False,
                                                               latency_runs=0, dataset=ds, test_samples=args.test)}
            except EdgeflError as exc:
                failed += 1
                rows.append({"model": name, "options": options, "failed": exc.message})
                print(f"{name:14} FAILED: {exc.message}")
                continue
            fl, q = files[f"{name}.tflite"], files[f"{name}.int8.tflite"]
            listing = list_ops(q.path)
            row = {"model": name, "options": options, "steps": args.steps, "float_accuracy": fl.accuracy, "int8_accuracy": q.accuracy,
                   "ratio": q.accuracy / fl.accuracy, "agreement": q.agreement, "integer_only": listing.integer_only,
                   "adds": listing.counts.get("ADD", 0), "ops": listing.counts, "int8_bytes": q.path.stat().st_size,
                   "onnx_int8_accuracy": files[f"{name}.int8.onnx"].accuracy, "seconds": time.perf_counter() - t0}
        rows.append(row)
        print(f"{name:14} {row['float_accuracy']:7.4f} {row['int8_accuracy']:7.4f} {row['ratio']:6.3f} {row['agreement']:6.3f} "
              f"{str(row['integer_only']):>8} {row['adds']:4d} {row['int8_bytes'] / 1024:8.1f} {row['seconds']:5.0f}", flush=True)
    path = save("export_int8_zoo", {"steps": args.steps, "test": args.test, "rows": rows})
    print(f"{len(rows) - failed} of {len(rows)} classifiers kept >= 98 % of float accuracy, integer-only; results in {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
