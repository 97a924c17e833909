"""One model to the files a phone or board runs, each checked against PyTorch and described.

:func:`export_model` writes, for a :class:`~edgefl.exporters.source.ModelSource`:

=========================  ===============================================================
``NAME.onnx``              float, fixed batch (phone execution providers need fixed shapes)
``NAME.dynamic.onnx``      float, dynamic batch (servers)
``NAME.int8.onnx``         static QDQ int8, fixed batch (``int8=True``)
``NAME.tflite``            float, static batch, resizable at run time
``NAME.int8.tflite``       int8 weights and activations, int8 I/O (``int8=True``)
=========================  ===============================================================

each with a ``.json`` sidecar. Every float file must match PyTorch on real test inputs within the
parity contract (:mod:`edgefl.exporters.parity`) or the export fails and the file is removed.
int8 classifiers must keep at least ``INT8_MIN_RELATIVE_ACCURACY`` of the float model's test
accuracy, or the export fails the same way.
"""

from __future__ import annotations

import importlib.metadata
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edgefl.data import Dataset, load_dataset
from edgefl.errors import DataError
from edgefl.exporters.metadata import write_sidecar
from edgefl.exporters.onnx_export import (
    ExportError,
    OnnxRunner,
    check_model_file,
    export_onnx,
    mobile_usability,
    quantize_int8,
)
from edgefl.exporters.parity import ATOL, RTOL, Parity, ParityError, check_parity
from edgefl.exporters.source import ModelSource
from edgefl.models import count_flops

INT8_MIN_RELATIVE_ACCURACY = 0.98  # MLPerf Mobile's bar for int8 classifiers
FORMATS = ("onnx", "tflite")

#: how each dataset's inputs are scaled before the model sees them (what an app must do)
NORMALISATION = {
    "fashion-mnist": {"description": "grayscale pixels / 255, float32 in [0, 1]", "scale": 1 / 255, "offset": 0.0},
    "mnist": {"description": "grayscale pixels / 255, float32 in [0, 1]", "scale": 1 / 255, "offset": 0.0},
    "digits": {"description": "scikit-learn digits values (0..16) / 16, float32 in [0, 1]", "scale": 1 / 16, "offset": 0.0},
    "breast-cancer": {"description": "each feature standardised with the training split's mean and std"},
}


@dataclass
class ExportedFile:
    path: Path
    format: str
    precision: str  # "float32" | "int8"
    batch: int | None  # None: dynamic
    parity: Parity | None = None
    accuracy: float | None = None
    agreement: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    sidecar: Path | None = None


@dataclass
class ExportInputs:
    """Real inputs for one model: parity samples, test samples with labels, calibration batches."""

    parity: tuple[torch.Tensor, ...]
    test: tuple[torch.Tensor, ...] | None
    labels: torch.Tensor | None
    calibration: list[tuple[torch.Tensor, ...]]


def exporter_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for pkg in ("torch", "onnx", "onnxscript", "onnxruntime", "litert-torch", "ai-edge-litert", "tflite-runtime"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def prepare_inputs(src: ModelSource, dataset: Dataset | None, test_samples: int = 2000, parity_samples: int = 128,
                   calibration_samples: int = 512, calibration_batch: int = 32, seed: int = 0) -> ExportInputs:
    """Classifiers: the dataset's test split (parity, accuracy) and random training images
    (calibration). Decoders: latent draws z ~ N(0, I) with one-hot labels cycling over classes,
    which is exactly what a phone feeds a decoder."""
    gen = torch.Generator().manual_seed(seed)
    if src.kind == "decoder":
        latent, c = src.module.latent, src.num_classes

        def draws(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            z = torch.randn(n, latent, generator=gen)
            y = torch.nn.functional.one_hot(torch.arange(n) % c, c).float()
            return z, y

        calib = [draws(calibration_batch) for _ in range(max(1, calibration_samples // calibration_batch))]
        return ExportInputs(draws(parity_samples), None, None, calib)
    if dataset is None:
        if not src.dataset:
            raise DataError(f"{src.name}: no dataset to check the export on (the weights do not name one)",
                            hint="pass --dataset NAME (parity and int8 calibration use real samples)")
        dataset = load_dataset(src.dataset)
    if tuple(dataset.x_test.shape[1:]) != tuple(src.input_shape):
        raise DataError(f"{src.name} takes inputs of shape {list(src.input_shape)}, but {dataset.name} has {list(dataset.x_test.shape[1:])}",
                        hint="pass the dataset the model was trained on (--dataset)")
    n_test = min(test_samples, len(dataset.y_test))
    test_idx = torch.randperm(len(dataset.y_test), generator=torch.Generator().manual_seed(0))[:n_test].sort().values
    x_test, y_test = dataset.x_test[test_idx], dataset.y_test[test_idx]
    cal_idx = torch.randperm(len(dataset.y_train), generator=gen)[:calibration_samples]
    x_cal = dataset.x_train[cal_idx]
    calib = [(x_cal[i : i + calibration_batch],) for i in range(0, len(x_cal), calibration_batch)]
    return ExportInputs((x_test[:parity_samples],), (x_test,), y_test, calib)


def run_in_batches(runner: Callable[..., np.ndarray], inputs: tuple[torch.Tensor, ...], batch: int | None, chunk: int = 256) -> np.ndarray:
    """Outputs for all inputs; a fixed-batch runner gets batches of exactly ``batch`` (the last padded)."""
    n = inputs[0].shape[0]
    step = batch or chunk
    outs = []
    for start in range(0, n, step):
        part = [t[start : start + step].numpy() for t in inputs]
        got = part[0].shape[0]
        if batch and got < batch:
            part = [np.concatenate([p, np.repeat(p[-1:], batch - got, 0)]) for p in part]
        outs.append(runner(*part)[:got])
    return np.concatenate(outs)


def _accuracy(logits: np.ndarray, labels: torch.Tensor) -> float:
    return float((logits.argmax(1) == labels.numpy()).mean())


class _Checked:
    """Removes a written file unless its checks pass (no silent files on failure)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.path.unlink(missing_ok=True)


def export_model(
    src: ModelSource,
    out_dir: str | Path,
    formats: tuple[str, ...] = FORMATS,
    int8: bool = False,
    batch: int = 1,
    dynamic_batch: bool = True,
    channels_last: bool = False,
    dataset: Dataset | None = None,
    test_samples: int = 2000,
    rtol: float = RTOL,
    atol: float = ATOL,
    mobile_check: bool = True,
    int8_min_relative_accuracy: float = INT8_MIN_RELATIVE_ACCURACY,
    log: Callable[[str], None] = lambda _: None,
) -> list[ExportedFile]:
    """Export one model in every requested format; returns what was written (see module doc)."""
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        raise ExportError(f"unknown export format(s) {unknown}", hint="formats: onnx, tflite")
    if batch < 1:
        raise ExportError("--batch must be at least 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    module = src.module.eval()
    inputs = prepare_inputs(src, dataset, test_samples)
    classifier = src.kind == "classifier"
    with torch.no_grad():
        ref_parity = module(*inputs.parity).numpy()
        ref_test = torch.cat([module(*(t[i : i + 500] for t in inputs.test)) for i in range(0, len(inputs.test[0]), 500)]).numpy() if inputs.test else None
    torch_acc = _accuracy(ref_test, inputs.labels) if classifier and ref_test is not None else None
    sample = tuple(t[:batch] if t.shape[0] >= batch else t[:1].repeat(batch, *([1] * (t.dim() - 1))) for t in inputs.parity)
    with torch.no_grad():
        flops = count_flops(module, tuple(t[:1] for t in sample))
    base = {
        "model": src.model, "model_options": src.model_options, "kind": src.kind,
        "class_labels": src.class_names, "num_classes": src.num_classes,
        "parameters": sum(p.numel() for p in module.parameters()), "flops_per_sample": int(flops),
        "source": {"run": src.run, "round": src.round, "weights": src.weights_path, "dataset": src.dataset},
        "pytorch_test_accuracy": torch_acc, "test_samples": len(inputs.labels) if inputs.labels is not None else 0,
        "exporter_versions": exporter_versions(), "exported": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "normalisation": NORMALISATION.get(src.dataset or "", {"description": "as in training"}) if classifier else None,
    }
    written: list[ExportedFile] = []

    def judge(f: ExportedFile, runner, layout_fn=lambda a: a) -> None:
        """Parity for float files; accuracy for classifiers; the int8 bar."""
        got = run_in_batches(runner, tuple(layout_fn(t) for t in inputs.parity), f.batch)
        got = _output_layout(got, f.extra.get("layout"), src.kind)
        if f.precision == "float32":
            f.parity = check_parity(f"{f.path.name}", ref_parity, got, rtol=rtol, atol=atol, classifier=classifier)
        else:
            f.extra["relative_error"] = float(np.abs(got - ref_parity).max() / max(np.abs(ref_parity).max(), 1e-12))
        if classifier and inputs.test is not None:
            test_out = run_in_batches(runner, tuple(layout_fn(t) for t in inputs.test), f.batch)
            f.accuracy = _accuracy(test_out, inputs.labels)
            f.agreement = float((test_out.argmax(1) == ref_test.argmax(1)).mean())
            if f.precision == "int8" and torch_acc and f.accuracy < int8_min_relative_accuracy * torch_acc:
                raise ExportError(
                    f"{f.path.name}: int8 test accuracy {f.accuracy:.4f} is below {int8_min_relative_accuracy:.0%} of the "
                    f"float model's {torch_acc:.4f} (top-1 agreement {f.agreement:.3f})",
                    hint="ship the float file, or calibrate on more samples; the int8 file was not kept")

    if "onnx" in formats:
        input_names = ["input"] if classifier else ["z", "y_onehot"]
        variants = [(f"{src.name}.onnx", batch)] + ([(f"{src.name}.dynamic.onnx", None)] if dynamic_batch else [])
        for filename, b in variants:
            path = out / filename
            log(f"onnx: {filename}")
            with _Checked(path):
                export_onnx(module, sample, path, src.kind, dynamic=b is None)
                check_model_file(path)
                f = ExportedFile(path, "onnx", "float32", b, extra={"layout": "NCHW", "opset": _opset(path)})
                judge(f, OnnxRunner(path))
                if b is not None and mobile_check:
                    f.extra["mobile_usability"] = mobile_usability(path)
            written.append(f)
        if int8:
            path = out / f"{src.name}.int8.onnx"
            log(f"onnx: {path.name} (int8, calibrating on {sum(len(c[0]) for c in inputs.calibration)} real samples)")
            with _Checked(path):
                fixed_calib = [tuple(t.numpy() for t in c) for c in _fixed_batches(inputs.calibration, batch)]
                quantize_int8(out / f"{src.name}.onnx", path, iter(fixed_calib), input_names)
                f = ExportedFile(path, "onnx", "int8", batch, extra={"layout": "NCHW", "quantization": "QDQ static, per-channel weights"})
                judge(f, OnnxRunner(path))
            written.append(f)

    if "tflite" in formats:
        from edgefl.exporters.tflite_export import TFLiteRunner, channels_last_wrapper, convert, resizable

        conv_module, conv_sample = module, sample
        layout = "NCHW"
        to_layout = lambda t: t  # noqa: E731
        if channels_last:
            conv_module, conv_sample = channels_last_wrapper(module, src.kind, sample)
            if conv_module is not module:
                layout = "NHWC"
                if classifier:
                    to_layout = lambda t: t.permute(0, 2, 3, 1).contiguous()  # noqa: E731
        for precision in ("float32", "int8") if int8 else ("float32",):
            name = f"{src.name}.tflite" if precision == "float32" else f"{src.name}.int8.tflite"
            path = out / name
            log(f"tflite: {name}")
            with _Checked(path):
                calib = None
                if precision == "int8":
                    calib = [tuple(to_layout(t) if i == 0 and classifier else t for i, t in enumerate(c)) for c in _fixed_batches(inputs.calibration, batch)]
                convert(conv_module, conv_sample, path, calibration=calib)
                runner = TFLiteRunner(path)
                can_resize = resizable(path, tuple(t.numpy() for t in conv_sample))
                f = ExportedFile(path, "tflite", precision, batch,
                                 extra={"layout": layout, "interpreter": runner.runtime, "io": runner.quantization(),
                                        "resizable_batch": can_resize,
                                        "batch_note": "resize_tensor_input changes the batch" if can_resize else
                                        f"fixed batch {batch} (the graph reshapes the batch dimension); export with --batch N for another"})
                judge(f, runner, to_layout)
            written.append(f)

    for f in written:
        fields = {**base, "format": f.format, "precision": f.precision,
                  "inputs": _describe_inputs(src, f, sample), "outputs": _describe_outputs(src, f),
                  "parity": f.parity.to_dict() if f.parity else None, "test_accuracy": f.accuracy,
                  "top1_agreement_with_pytorch": f.agreement, **{k: v for k, v in f.extra.items() if k != "io"}}
        if f.precision == "int8":
            fields["float_test_accuracy"] = next((g.accuracy for g in written if g.format == f.format and g.precision == "float32"), None)
        f.sidecar = write_sidecar(f.path, fields)
    return written


def _opset(path: Path) -> int | None:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)


def _fixed_batches(calibration: list[tuple[torch.Tensor, ...]], batch: int) -> list[tuple[torch.Tensor, ...]]:
    """Calibration batches re-cut to the file's fixed batch size."""
    joined = tuple(torch.cat([c[i] for c in calibration]) for i in range(len(calibration[0])))
    n = joined[0].shape[0] // batch * batch
    cut = [tuple(t[i : i + batch] for t in joined) for i in range(0, n, batch)]
    if batch == 1:
        cut = cut[:256]  # one sample per step: enough for stable ranges, and quick
    return cut


def _output_layout(got: np.ndarray, layout: str | None, kind: str) -> np.ndarray:
    if layout == "NHWC" and kind == "decoder" and got.ndim == 4:
        return np.transpose(got, (0, 3, 1, 2))  # compare with PyTorch's NCHW
    return got


def _describe_inputs(src: ModelSource, f: ExportedFile, sample: tuple[torch.Tensor, ...]) -> list[dict[str, Any]]:
    io = f.extra.get("io", {}).get("inputs", [])
    if src.kind == "classifier":
        shape = list(sample[0].shape)
        if f.extra.get("layout") == "NHWC" and len(shape) == 4:
            shape = [shape[0], shape[2], shape[3], shape[1]]
        shape[0] = f.batch if f.batch else "batch"
        entries = [{"name": "input", "shape": shape, "layout": f.extra.get("layout", "NCHW")}]
    else:
        entries = [{"name": "z", "shape": [f.batch or "batch", src.module.latent], "meaning": "latent draw, z ~ N(0, I)"},
                   {"name": "y_onehot", "shape": [f.batch or "batch", src.num_classes], "meaning": "one-hot class"}]
    for i, e in enumerate(entries):
        q = io[i] if i < len(io) else None
        e["dtype"] = q["dtype"] if q else "float32"
        if q and q["dtype"] == "int8":
            e["scale"], e["zero_point"] = q["scale"], q["zero_point"]
            e["quantize"] = "int8 = clip(round(x / scale) + zero_point, -128, 127)"
    return entries


def _describe_outputs(src: ModelSource, f: ExportedFile) -> list[dict[str, Any]]:
    io = f.extra.get("io", {}).get("outputs", [])
    if src.kind == "classifier":
        e = {"name": "logits", "shape": [f.batch or "batch", src.num_classes], "meaning": "unnormalised class scores (argmax = class)"}
    else:
        shape = [f.batch or "batch", *src.input_shape]
        if f.extra.get("layout") == "NHWC" and len(shape) == 4:
            shape = [shape[0], shape[2], shape[3], shape[1]]
        e = {"name": "sample", "shape": shape, "meaning": "generated image, values in [0, 1]"}
    q = io[0] if io else None
    e["dtype"] = q["dtype"] if q else "float32"
    if q and q["dtype"] == "int8":
        e["scale"], e["zero_point"] = q["scale"], q["zero_point"]
        e["dequantize"] = "x = (int8 - zero_point) * scale"
    return [e]


__all__ = ["ExportError", "ExportedFile", "ParityError", "export_model", "prepare_inputs", "run_in_batches"]
