"""Export benchmark: file size and latency of every zoo classifier in PyTorch eager, ONNX Runtime,
LiteRT float and LiteRT int8, measured side by side in one run on this CPU.

For each model: export with edgefl's exporter (parity enforced: a model that fails parity fails
the benchmark), then time batch 1 and batch 32 on the same real Fashion-MNIST test images in
every runtime, round-robin (runtime A, B, C, D, A, B, ...) so that drifts in machine load hit all
of them alike; report the median per runtime and its ratio to PyTorch. All runtimes use
``--threads`` threads (1 by default: the phone-like single-core case, and stable on a shared
2-core machine). Weights are freshly initialised (latency does not depend on them), so int8
accuracy is not judged here; tests/test_export.py judges it on a trained model.

ONNX Runtime runs the fixed-shape file at batch 1 and the dynamic-batch file at batch 32;
LiteRT files have a static batch, so the batch-32 numbers come from a second export at
``--batch 32``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from common import load, save

from edgefl.exporters import export_model, from_module
from edgefl.exporters.onnx_export import OnnxRunner
from edgefl.exporters.tflite_export import TFLiteRunner
from edgefl.models import build_model, get_spec, model_names

RUNTIMES = ("pytorch", "onnxruntime", "litert-float", "litert-int8")


def median_latencies(runners: dict, x: np.ndarray, repeats: int, warmup: int = 3) -> dict[str, float]:
    for fn in runners.values():
        for _ in range(warmup):
            fn(x)
    times: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(repeats):
        for name, fn in runners.items():
            t0 = time.perf_counter()
            fn(x)
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=[n for n in model_names() if get_spec(n).kind == "classifier" and n != "mlp"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=20, help="timed runs per runtime at batch 1 (batch 32: a quarter)")
    ap.add_argument("--width", type=float, default=None, help="width option for models that take one (default: full size)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ds = load()
    rows = []
    t_start = time.perf_counter()
    for name in args.models:
        opts = {"width": args.width} if args.width and name.startswith(("resnet", "fedhe-cnn", "vgg9")) else {}
        torch.manual_seed(0)
        model = build_model(name, num_classes=10, input_shape=(1, 28, 28), **opts).eval()
        src = from_module(model, name, 10, (1, 28, 28), **opts)
        src.dataset = "fashion-mnist"
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            # NCHW TFLite files: every runtime takes the same NCHW batch here (an app's NHWC default is the exporter's)
            b1 = {f.path.name: f for f in export_model(src, Path(tmp) / "b1", int8=True, dataset=ds, test_samples=256, channels_last=False,
                                                          mobile_check=False, int8_min_relative_accuracy=0.0)}
            b32 = {f.path.name: f for f in export_model(src, Path(tmp) / "b32", formats=("tflite",), int8=True, batch=32, dataset=ds,
                                                           test_samples=256, channels_last=False, int8_min_relative_accuracy=0.0)}
            export_s = time.perf_counter() - t0
            row = {"model": name, "options": opts, "params": sum(p.numel() for p in model.parameters()), "export_s": round(export_s, 1),
                   "size_float_tflite": b1[f"{name}.tflite"].path.stat().st_size,
                   "size_int8_tflite": b1[f"{name}.int8.tflite"].path.stat().st_size,
                   "size_float_onnx": b1[f"{name}.onnx"].path.stat().st_size,
                   "size_int8_onnx": b1[f"{name}.int8.onnx"].path.stat().st_size,
                   "parity_max_abs": max(f.parity.max_abs_diff for f in b1.values() if f.parity)}
            for batch, files, onnx_file in ((1, b1, f"{name}.onnx"), (32, b32, None)):
                x = ds.x_test[:batch].numpy()
                ort = OnnxRunner(b1[onnx_file].path if onnx_file else b1[f"{name}.dynamic.onnx"].path, threads=args.threads)
                lite_f = TFLiteRunner(files[f"{name}.tflite"].path, threads=args.threads)
                lite_q = TFLiteRunner(files[f"{name}.int8.tflite"].path, threads=args.threads)

                def torch_run(a, m=model):
                    with torch.inference_mode():
                        return m(torch.from_numpy(a))

                runners = {"pytorch": torch_run, "onnxruntime": ort, "litert-float": lite_f, "litert-int8": lite_q}
                med = median_latencies(runners, x, args.repeats if batch == 1 else max(5, args.repeats // 4))
                row[f"b{batch}"] = {k: v * 1000 for k, v in med.items()}
        rows.append(row)
        b1m, b32m = row["b1"], row["b32"]
        print(f"{name:12s} export {row['export_s']:5.1f}s  b1 ms " + " ".join(f"{b1m[k]:8.3f}" for k in RUNTIMES)
              + "  b32 ms " + " ".join(f"{b32m[k]:9.2f}" for k in RUNTIMES)
              + f"  (elapsed {time.perf_counter() - t_start:.0f}s)", flush=True)
    print("\nratios to PyTorch eager (lower is faster)")
    print(f"{'model':12s} {'float MB':>8s} {'int8 MB':>8s} | b1: " + " ".join(f"{k:>12s}" for k in RUNTIMES[1:])
          + " | b32: " + " ".join(f"{k:>12s}" for k in RUNTIMES[1:]))
    for r in rows:
        print(f"{r['model']:12s} {r['size_float_tflite'] / 1e6:8.2f} {r['size_int8_tflite'] / 1e6:8.2f} | b1: "
              + " ".join(f"{r['b1'][k] / r['b1']['pytorch']:12.2f}" for k in RUNTIMES[1:]) + " | b32: "
              + " ".join(f"{r['b32'][k] / r['b32']['pytorch']:12.2f}" for k in RUNTIMES[1:]))
    path = save("export_latency", {"args": vars(args), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
