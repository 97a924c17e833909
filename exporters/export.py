"""One model to the files a phone or board runs, each checked against PyTorch and described.

:func:`export_model` writes, for a :class:`~edgefl.exporters.source.ModelSource`:

=========================  ===============================================================
``NAME.onnx``              float, fixed batch (phone execution providers need fixed shapes)
``NAME.dynamic.onnx``      float, dynamic batch (servers)
``NAME.int8.onnx``         static QDQ int8, fixed batch (``int8=True``)
``NAME.tflite``            float, fixed batch, NHWC image I/O by default
``NAME.int8.tflite``       integer-only int8 (every op and tensor), int8 I/O (``int8=True``)
``NAME.int8.h``            the int8 file as a C array for TFLite Micro (``micro=True``)
=========================  ===============================================================

each with a ``.json`` sidecar. Every float file must match PyTorch on real test inputs within the
parity contract (:mod:`edgefl.exporters.parity`); int8 classifiers must keep at least
``INT8_MIN_RELATIVE_ACCURACY`` of the float model's test accuracy and be integer-only. A model's
files are built in a staging folder and moved into place together only when all passed
(:mod:`edgefl.exporters.staging`): a failure leaves the previous set as it was.
"""

from __future__ import annotations

import importlib.metadata
import json
import platform
import statistics
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
    embed_onnx_metadata,
    export_onnx,
    first_compute_node,
    mobile_usability,
    quantize_int8,
)
from edgefl.exporters.parity import ATOL, RTOL, Parity, ParityError, check_parity
from edgefl.exporters.source import ModelSource
from edgefl.exporters.staging import Staging, file_error
from edgefl.models import count_flops

INT8_MIN_RELATIVE_ACCURACY = 0.98  # MLPerf Mobile's bar for int8 classifiers
FORMATS = ("onnx", "tflite")

#: raw value -> model input, per dataset: x = (value - mean) / std (what an app must do)
NORMALISATION = {
    "fashion-mnist": {"value": "grayscale pixel, 0..255", "mean": [0.0], "std": [255.0], "min": 0, "max": 255,
                      "description": "grayscale pixels / 255, float32 in [0, 1]"},
    "mnist": {"value": "grayscale pixel, 0..255", "mean": [0.0], "std": [255.0], "min": 0, "max": 255,
              "description": "grayscale pixels / 255, float32 in [0, 1]"},
    "idx": {"value": "pixel, 0..255", "mean": [0.0], "std": [255.0], "min": 0, "max": 255,
            "description": "pixels / 255, float32 in [0, 1]"},
    "digits": {"value": "scikit-learn digits value, 0..16", "mean": [0.0], "std": [16.0], "min": 0, "max": 16,
               "description": "scikit-learn digits values (0..16) / 16, float32 in [0, 1]"},
}


def normalisation(dataset_name: str | None, dataset: Dataset | None) -> dict[str, Any]:
    """The input scaling as a formula with its numbers: x = (value - mean) / std."""
    if dataset is not None and dataset.standardisation is not None:
        mean, std = dataset.standardisation
        return {"formula": "x[i] = (feature[i] - mean[i]) / std[i]", "value": "raw feature", "mean": list(mean), "std": list(std),
                "description": "each feature standardised with the training split's mean and std"}
    known = NORMALISATION.get(dataset_name or "")
    if known is None:
        return {"formula": None, "description": "as in training (the dataset is unknown to edgefl)"}
    formula = "x = (value - mean) / std" if known["mean"] != [0.0] else f"x = value / {known['std'][0]:g}"
    return {"formula": formula, **known, "scale": 1 / known["std"][0], "offset": 0.0}


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
    dataset: Dataset | None = None


def exporter_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for pkg in ("edgefl", "torch", "onnx", "onnxscript", "onnxruntime", "litert-torch", "ai-edge-litert", "tflite-runtime",
                "tflite-micro", "mediapipe"):
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
        return ExportInputs(draws(parity_samples), None, None, calib, dataset)
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
    return ExportInputs((x_test[:parity_samples],), (x_test,), y_test, calib, dataset)


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


def export_model(
    src: ModelSource,
    out_dir: str | Path,
    formats: tuple[str, ...] = FORMATS,
    int8: bool = False,
    batch: int = 1,
    dynamic_batch: bool = True,
    channels_last: bool | None = None,
    micro: bool = False,
    dataset: Dataset | None = None,
    test_samples: int = 2000,
    rtol: float = RTOL,
    atol: float = ATOL,
    mobile_check: bool = True,
    latency_runs: int = 30,
    int8_min_relative_accuracy: float = INT8_MIN_RELATIVE_ACCURACY,
    log: Callable[[str], None] = lambda _: None,
) -> list[ExportedFile]:
    """Export one model in every requested format; returns what was written (see module doc).

    ``channels_last`` (TFLite only): None lays image inputs and outputs out NHWC, the TFLite
    convention; False keeps PyTorch's NCHW. ``micro`` (implies int8 TFLite) adds the C array
    and the TFLite Micro facts. Nothing of this model reaches ``out_dir`` unless every file passes.
    """
    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        raise ExportError(f"unknown export format(s) {unknown}", hint="formats: onnx, tflite")
    if not formats:
        raise ExportError("no export format given", hint="formats: onnx, tflite")
    if batch < 1:
        raise ExportError("--batch must be at least 1")
    if micro and "tflite" not in formats:
        raise ExportError("--micro needs the TFLite format", hint="add tflite to --format")
    int8 = int8 or micro
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise file_error(exc, f"create {out}") from None
    inputs = prepare_inputs(src, dataset, test_samples)
    staging = Staging(out, src.name)
    try:
        job = _Job(src, inputs, staging.path, batch, rtol, atol, int8_min_relative_accuracy, latency_runs, log)
        if "onnx" in formats:
            job.onnx(int8, dynamic_batch, mobile_check)
        if "tflite" in formats:
            job.tflite(int8, channels_last, micro)
        job.write_sidecars()
        moved = staging.commit()
    except OSError as exc:
        raise file_error(exc, f"write {src.name}'s files into {out}") from None
    finally:
        staging.discard()
    for f in job.written:
        f.path, f.sidecar = moved[f.path], moved[f.sidecar] if f.sidecar is not None else None
        if "micro" in f.extra:
            f.extra["micro"]["c_header_path"] = str(out / f.extra["micro"]["c_header"])
    return job.written


class _Job:
    """One model's export into a staging folder: each file written, checked, described."""

    def __init__(self, src: ModelSource, inputs: ExportInputs, folder: Path, batch: int, rtol: float, atol: float,
                 int8_bar: float, latency_runs: int, log: Callable[[str], None]) -> None:
        self.src, self.inputs, self.folder, self.batch = src, inputs, folder, batch
        self.rtol, self.atol, self.int8_bar, self.latency_runs, self.log = rtol, atol, int8_bar, latency_runs, log
        self.module = src.module.eval()
        self.classifier = src.kind == "classifier"
        self.written: list[ExportedFile] = []
        with torch.no_grad():
            self.ref_parity = self.module(*inputs.parity).numpy()
            self.ref_test = (torch.cat([self.module(*(t[i : i + 500] for t in inputs.test)) for i in range(0, len(inputs.test[0]), 500)]).numpy()
                             if inputs.test else None)
        self.torch_acc = _accuracy(self.ref_test, inputs.labels) if self.classifier and self.ref_test is not None else None
        self.sample = tuple(t[:batch] if t.shape[0] >= batch else t[:1].repeat(batch, *([1] * (t.dim() - 1))) for t in inputs.parity)
        with torch.no_grad():
            flops = count_flops(self.module, tuple(t[:1] for t in self.sample))
        self.labels = _labels(src, inputs.dataset)
        self.norm = normalisation(src.dataset or (inputs.dataset.name if inputs.dataset else None), inputs.dataset) if self.classifier else None
        self.base = {
            "model": src.model, "model_options": src.model_options, "kind": src.kind,
            "class_labels": self.labels, "num_classes": src.num_classes,
            "parameters": sum(p.numel() for p in self.module.parameters()), "flops_per_sample": int(flops),
            "source": {"run": src.run, "run_name": src.run_name, "method": src.method, "seed": src.seed, "round": src.round,
                       "weights": src.weights_path, "weights_sha256": src.weights_sha256, "dataset": src.dataset},
            "pytorch_test_accuracy": self.torch_acc, "test_samples": len(inputs.labels) if inputs.labels is not None else 0,
            "edgefl_version": _edgefl_version(), "exporter_versions": exporter_versions(),
            "exported": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "normalisation": self.norm,
        }

    # --- checks shared by every file --------------------------------------------------------------
    def judge(self, f: ExportedFile, runner: Callable[..., np.ndarray], layout_fn: Callable[[torch.Tensor], torch.Tensor] = lambda a: a) -> None:
        """Parity for float files; accuracy for classifiers; the int8 bar."""
        got = run_in_batches(runner, tuple(layout_fn(t) for t in self.inputs.parity), f.batch)
        got = _output_layout(got, f.extra.get("layout"), self.src.kind)
        if f.precision == "float32":
            f.parity = check_parity(f.path.name, self.ref_parity, got, rtol=self.rtol, atol=self.atol, classifier=self.classifier)
        else:
            f.extra["relative_error"] = float(np.abs(got - self.ref_parity).max() / max(np.abs(self.ref_parity).max(), 1e-12))
        if self.classifier and self.inputs.test is not None:
            test_out = run_in_batches(runner, tuple(layout_fn(t) for t in self.inputs.test), f.batch)
            f.accuracy = _accuracy(test_out, self.inputs.labels)
            f.agreement = float((test_out.argmax(1) == self.ref_test.argmax(1)).mean())
            if f.precision == "int8" and self.torch_acc and f.accuracy < self.int8_bar * self.torch_acc:
                raise ExportError(
                    f"{f.path.name}: int8 test accuracy {f.accuracy:.4f} is below {self.int8_bar:.0%} of the "
                    f"float model's {self.torch_acc:.4f} (top-1 agreement {f.agreement:.3f})",
                    hint="ship the float file, train longer, or calibrate on more samples; no file of this model was kept")
        if self.latency_runs:
            sample = tuple(layout_fn(t).numpy() for t in self.sample)
            f.extra["latency"] = _latency(runner, sample, self.latency_runs)

    # --- ONNX --------------------------------------------------------------------------------------
    def onnx(self, int8: bool, dynamic_batch: bool, mobile_check: bool) -> None:
        src, names = self.src, (["input"] if self.classifier else ["z", "y_onehot"])
        variants = [(f"{src.name}.onnx", self.batch)] + ([(f"{src.name}.dynamic.onnx", None)] if dynamic_batch else [])
        for filename, b in variants:
            path = self.folder / filename
            self.log(f"onnx: {filename}")
            export_onnx(self.module, self.sample, path, src.kind, dynamic=b is None)
            f = ExportedFile(path, "onnx", "float32", b, extra={"layout": _layout(self.sample, False), "opset": _opset(path)})
            self._describe_onnx(f)
            check_model_file(path)
            runner = OnnxRunner(path, threads=1)
            f.extra["io"] = runner.io()
            self.judge(f, runner)
            if b is not None and mobile_check:
                f.extra["mobile_usability"] = mobile_usability(path)
            self.written.append(f)
        if int8:
            path = self.folder / f"{src.name}.int8.onnx"
            self.log(f"onnx: {path.name} (int8, calibrating on {sum(len(c[0]) for c in self.inputs.calibration)} real samples)")
            fixed_calib = [tuple(t.numpy() for t in c) for c in _fixed_batches(self.inputs.calibration, self.batch)]
            float_file = self.folder / f"{src.name}.onnx"
            # all nodes int8 first; below the bar, once more with the first layer (which sees the
            # raw input) kept float, as is usual for int8 deployments; the sidecar names it
            first = first_compute_node(float_file)
            attempts = [[]] + ([[first]] if first else [])
            for attempt, exclude in enumerate(attempts):
                quantize_int8(float_file, path, iter(fixed_calib), names, exclude=exclude)
                f = ExportedFile(path, "onnx", "int8", self.batch, extra={
                    "layout": _layout(self.sample, False), "opset": _opset(path), "float_nodes": exclude,
                    "quantization": "QDQ static, per-channel weights" + (f"; {exclude[0]} kept float" if exclude else "")})
                self._describe_onnx(f)
                check_model_file(path)
                runner = OnnxRunner(path, threads=1)
                f.extra["io"] = runner.io()
                try:
                    self.judge(f, runner)
                    break
                except ExportError:
                    if attempt == len(attempts) - 1:
                        raise
                    self.log(f"onnx: {path.name} below the int8 bar; again with {first} kept float")
            if mobile_check:
                f.extra["mobile_usability"] = mobile_usability(path)
            self.written.append(f)

    def _describe_onnx(self, f: ExportedFile) -> None:
        src = self.src
        props = {
            "edgefl.version": _edgefl_version(), "edgefl.model": src.model, "edgefl.model_options": json.dumps(src.model_options),
            "edgefl.kind": src.kind, "edgefl.precision": f.precision, "edgefl.layout": f.extra["layout"],
            "edgefl.dataset": src.dataset or "", "edgefl.labels": json.dumps(self.labels),
            "edgefl.normalisation": json.dumps(self.norm), "edgefl.run": src.run_name or src.run or "",
            "edgefl.method": src.method or "", "edgefl.seed": "" if src.seed is None else str(src.seed),
            "edgefl.round": "" if src.round is None else str(src.round), "edgefl.weights_sha256": src.weights_sha256 or "",
        }
        embed_onnx_metadata(f.path, {k: v for k, v in props.items() if v}, version=_model_version(src), doc=self._doc(f))

    def _doc(self, f: ExportedFile) -> str:
        src = self.src
        if self.classifier:
            how = self.norm.get("formula") if self.norm else None
            return (f"edgefl {src.model} classifier ({src.num_classes} classes{', ' + src.dataset if src.dataset else ''}), "
                    f"{f.precision}. Input 'input' {f.extra['layout']}" + (f", {how}" if how else "") +
                    "; output 'logits' (argmax = class; labels in "
                    + ("the packed labels.txt)." if f.format == "tflite" else "metadata edgefl.labels).")
                    + (f" Run {src.run_name or src.run}, round {src.round}." if src.run else ""))
        return (f"edgefl {src.model} decoder: inputs 'z' (latent, N(0, I)) and 'y_onehot' (class), output 'sample' "
                f"(an image in [0, 1]), {f.precision}.")

    # --- TFLite ------------------------------------------------------------------------------------
    def tflite(self, int8: bool, channels_last: bool | None, micro: bool) -> None:
        from edgefl.exporters.residual import quantisable
        from edgefl.exporters.tflite_export import TFLiteRunner, channels_last_wrapper, convert, io_names, resizable
        from edgefl.exporters.tflite_model import list_ops

        src = self.src
        images = (self.classifier and self.sample[0].dim() == 4) or (not self.classifier and len(src.input_shape) == 3)
        nhwc = images and channels_last is not False
        conv_module, conv_sample = self.module, self.sample
        to_layout = lambda t: t  # noqa: E731
        if nhwc:
            conv_module, conv_sample = channels_last_wrapper(self.module, src.kind, self.sample)
            if self.classifier:
                to_layout = lambda t: t.permute(0, 2, 3, 1).contiguous()  # noqa: E731
        layout = _layout(self.sample, nhwc) if self.classifier else ("NHWC" if nhwc else "NCHW")
        for precision in ("float32", "int8") if int8 else ("float32",):
            name = f"{src.name}.tflite" if precision == "float32" else f"{src.name}.int8.tflite"
            path = self.folder / name
            self.log(f"tflite: {name}")
            calib = None
            module = conv_module
            if precision == "int8":
                calib = [tuple(to_layout(t) if i == 0 and self.classifier else t for i, t in enumerate(c))
                         for c in _fixed_batches(self.inputs.calibration, self.batch)]
                module = quantisable(conv_module, conv_sample)
            convert(module, conv_sample, path, kind=src.kind, calibration=calib)
            self._describe_tflite(path, precision, layout)
            order = io_names(src.kind)[0]
            runner = TFLiteRunner(path, input_order=order)
            can_resize = resizable(path, tuple(t.numpy() for t in conv_sample), order)
            listing = list_ops(path)
            f = ExportedFile(path, "tflite", precision, self.batch,
                             extra={"layout": layout, "interpreter": runner.runtime, "io": runner.io(),
                                    "signature_key": runner.signature_key, "ops": listing.to_dict(),
                                    "resizable_batch": can_resize,
                                    "batch_note": "resize_tensor_input changes the batch" if can_resize else
                                    f"fixed batch {self.batch} (the graph reshapes the batch dimension); export with --batch N for another"})
            if precision == "int8":
                f.extra["integer_only"] = listing.integer_only
                if self.classifier and not listing.integer_only:
                    raise ExportError(f"{name} is not integer-only: {', '.join(sorted(set(listing.float_ops)))} compute in float",
                                      hint="an op without an int8 kernel in the converter; ship the float file, or replace that layer")
            self.judge(f, runner, to_layout)
            if precision == "int8" and micro:
                self._micro(f, runner, to_layout, listing)
            self.written.append(f)

    def _describe_tflite(self, path: Path, precision: str, layout: str) -> None:
        from edgefl.exporters.tflite_model import embed_metadata

        src = self.src
        if self.classifier:
            image = len(src.input_shape) == 3
            entry: dict[str, Any] = {"name": "input", "kind": "image" if image else "feature",
                                     "channels": src.input_shape[0] if image else None,
                                     "description": f"{'image' if image else 'features'}, {layout}"
                                                    + (f"; {self.norm['formula']}" if self.norm and self.norm.get("formula") else "")}
            if self.norm and self.norm.get("mean") is not None:
                entry["mean"], entry["std"] = self.norm["mean"], self.norm["std"]
                if "min" in self.norm:
                    entry["min"], entry["max"] = self.norm["min"], self.norm["max"]
            inputs = [entry]
            outputs = [{"name": "logits", "kind": "feature", "description": "unnormalised class scores (argmax = class)"}]
            labels = self.labels
        else:
            inputs = [{"name": "z", "kind": "feature", "description": "latent draw, z ~ N(0, I)"},
                      {"name": "y_onehot", "kind": "feature", "description": "one-hot class"}]
            outputs = [{"name": "sample", "kind": "image", "channels": src.input_shape[0], "description": f"generated image in [0, 1], {layout}"}]
            labels = None
        embed_metadata(path, name=f"edgefl {src.model}", description=self._doc(ExportedFile(path, "tflite", precision, self.batch,
                                                                                               extra={"layout": layout})),
                       version=f"{_edgefl_version()}; round {src.round}" if src.round is not None else _edgefl_version(),
                       inputs=inputs, outputs=outputs, labels=labels)

    def _micro(self, f: ExportedFile, runner: Any, to_layout: Callable[[torch.Tensor], torch.Tensor], listing: Any) -> None:
        from edgefl.exporters.micro import measure_arena, micro_facts, micro_outputs, resolver_code, write_c_header

        self.log(f"tflite micro: {f.path.name}")
        samples = tuple(to_layout(t) for t in self.inputs.parity)
        n = samples[0].shape[0] // self.batch * self.batch
        batches = [runner.quantise(*(t[i : i + self.batch].numpy() for t in samples)) for i in range(0, n, self.batch)]
        arena = measure_arena(f.path, batches[0])
        micro = micro_outputs(f.path, arena, batches)
        litert = np.concatenate([runner.raw(*b) for b in batches])
        agreement = float((micro.reshape(len(micro), -1).argmax(1) == litert.reshape(len(litert), -1).argmax(1)).mean())
        if self.classifier and agreement < 0.99:
            raise ExportError(f"{f.path.name}: TFLite Micro agrees with LiteRT on only {agreement:.1%} of the parity inputs",
                              hint="report it: the two interpreters should compute the same int8 graph")
        header = write_c_header(f.path, f.path.with_name(f"{self.src.name}.int8.h"), arena, resolver_code(listing))
        f.extra["micro"] = micro_facts(listing, arena, agreement, header)

    # --- sidecars ----------------------------------------------------------------------------------
    def write_sidecars(self) -> None:
        for f in self.written:
            fields = {**self.base, "format": f.format, "precision": f.precision,
                      "inputs": _describe_inputs(self.src, f), "outputs": _describe_outputs(self.src, f),
                      "parity": f.parity.to_dict() if f.parity else None, "test_accuracy": f.accuracy,
                      "top1_agreement_with_pytorch": f.agreement, **{k: v for k, v in f.extra.items() if k != "io"}}
            if f.precision == "int8":
                fields["float_test_accuracy"] = next((g.accuracy for g in self.written if g.format == f.format and g.precision == "float32"), None)
            f.sidecar = write_sidecar(f.path, fields)


def _labels(src: ModelSource, dataset: Dataset | None) -> list[str]:
    """The source's class names; for a bare module, the dataset's (never "0".."9" for named classes)."""
    if src.class_names and not (dataset is not None and src.class_names == [str(i) for i in range(src.num_classes)]):
        return list(src.class_names)
    if dataset is not None and len(dataset.class_names) == src.num_classes:
        return list(dataset.class_names)
    return list(src.class_names) or [str(i) for i in range(src.num_classes)]


def _edgefl_version() -> str:
    from edgefl import __version__

    return __version__


def _model_version(src: ModelSource) -> int:
    """ONNX model_version: the round the weights come from (1 for weights without one)."""
    return int(src.round) if isinstance(src.round, int) and src.round > 0 else 1


def _layout(sample: tuple[torch.Tensor, ...], nhwc: bool) -> str:
    if sample[0].dim() == 4:
        return "NHWC" if nhwc else "NCHW"
    return "NC" if sample[0].dim() == 2 else "N" + "D" * (sample[0].dim() - 1)


def _latency(runner: Callable[..., np.ndarray], sample: tuple[np.ndarray, ...], runs: int) -> dict[str, Any]:
    """Median wall time of one call at the file's batch, one thread, after warm-up."""
    for _ in range(3):
        runner(*sample)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        runner(*sample)
        times.append(time.perf_counter() - t0)
    return {"median_ms": round(statistics.median(times) * 1e3, 4), "runs": runs, "threads": 1, "batch": int(sample[0].shape[0]),
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip()}



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


_MEANING = {"input": None, "z": "latent draw, z ~ N(0, I)", "y_onehot": "one-hot class",
            "logits": "unnormalised class scores (argmax = class)", "sample": "generated image, values in [0, 1]"}


def _runtime_entry(e: dict[str, Any], f: ExportedFile, image: bool) -> dict[str, Any]:
    """One input or output as the runtime reports it, with what an app must do with it."""
    out: dict[str, Any] = {"name": e["name"], "shape": e["shape"], "dtype": e["dtype"]}  # a dynamic batch is "batch" already
    if "tensor" in e:
        out["tensor"] = e["tensor"]  # the interpreter's tensor name (get_input_details); apps call the signature by "name"
        out["index"] = e["index"]  # the tensor's index in subgraph 0, for index-based APIs (iOS Interpreter.copy(_:toInputAt:))
    if image:
        out["layout"] = f.extra.get("layout")
    elif len(e["shape"]) == 2:
        out["layout"] = "NC"
    if _MEANING.get(e["name"]):
        out["meaning"] = _MEANING[e["name"]]
    if e["dtype"] in ("int8", "uint8") and e.get("scale"):
        lo, hi = (-128, 127) if e["dtype"] == "int8" else (0, 255)
        out["scale"], out["zero_point"] = e["scale"], e["zero_point"]
        out["quantize"] = f"{e['dtype']} = clip(round_half_away_from_zero(x / scale) + zero_point, {lo}, {hi})"
        out["dequantize"] = f"x = ({e['dtype']} - zero_point) * scale"
    return out


def _describe_inputs(src: ModelSource, f: ExportedFile) -> list[dict[str, Any]]:
    return [_runtime_entry(e, f, image=src.kind == "classifier" and len(e["shape"]) == 4) for e in f.extra["io"]["inputs"]]


def _describe_outputs(src: ModelSource, f: ExportedFile) -> list[dict[str, Any]]:
    return [_runtime_entry(e, f, image=len(e["shape"]) == 4) for e in f.extra["io"]["outputs"]]


__all__ = ["ExportError", "ExportedFile", "ParityError", "export_model", "prepare_inputs", "run_in_batches"]
