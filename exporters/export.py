"""One model to the files a phone or board runs, each checked against PyTorch and described.

:func:`export_model` runs the chosen formats of the registry (:mod:`edgefl.exporters.registry`)
for a :class:`~edgefl.exporters.source.ModelSource`; the built-in ones write:

=========================  ===============================================================
``NAME.onnx``              float, fixed batch (phone execution providers need fixed shapes)
``NAME.dynamic.onnx``      float, dynamic batch (servers)
``NAME.int8.onnx``         static QDQ int8, fixed batch (``int8=True``)
``NAME.tflite``            float, fixed batch, NHWC image I/O by default
``NAME.int8.tflite``       integer-only int8 (every op and tensor), int8 I/O (``int8=True``)
``NAME.int8.h``            the int8 file as a C array for TFLite Micro (format ``micro``)
=========================  ===============================================================

each with a ``.json`` sidecar. A format writes and checks its own files; :class:`ExportJob` is
what they share: the model, its real inputs and PyTorch's answers on them, the checks, the
sidecars. Every float file must match PyTorch on real test inputs within the
parity contract (:mod:`edgefl.exporters.parity`); int8 classifiers must keep at least
``INT8_MIN_RELATIVE_ACCURACY`` of the float model's test accuracy and be integer-only. A model's
files are built in a staging folder and moved into place together only when all passed
(:mod:`edgefl.exporters.staging`): a failure leaves the previous set as it was.
"""

from __future__ import annotations

import importlib.metadata
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edgefl.data import Dataset, load_dataset
from edgefl.data.views import View, make_view, view_record
from edgefl.errors import ConfigError, DataError
from edgefl.exporters.metadata import write_sidecar
from edgefl.exporters.parity import ATOL, RTOL, ParityError, check_parity
from edgefl.exporters.registry import ExportedFile, ExportError, ExportOptions, all_suffixes, chosen_formats
from edgefl.exporters.source import ModelSource
from edgefl.exporters.staging import Staging, file_error
from edgefl.models import count_flops

INT8_MIN_RELATIVE_ACCURACY = 0.98  # MLPerf Mobile's bar for int8 classifiers
DEFAULT_FORMATS = ("onnx", "tflite")

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
        named = {"feature_names": list(dataset.feature_names)} if dataset.feature_names and len(dataset.feature_names) == len(mean) else {}
        return {"formula": "x[i] = (feature[i] - mean[i]) / std[i]", "value": "raw feature", "mean": list(mean), "std": list(std), **named,
                "description": "each feature standardised with the training split's mean and std"
                               + ("; feature i is the column feature_names[i]" if named else "")}
    known = NORMALISATION.get(dataset_name or "")
    if known is None:
        return {"formula": None, "description": "as in training (the dataset is unknown to edgefl)"}
    formula = "x = (value - mean) / std" if known["mean"] != [0.0] else f"x = value / {known['std'][0]:g}"
    return {"formula": formula, **known, "scale": 1 / known["std"][0], "offset": 0.0}


@dataclass
class ExportInputs:
    """Real inputs for one model: parity samples, test samples with labels, calibration batches."""

    parity: tuple[torch.Tensor, ...]
    test: tuple[torch.Tensor, ...] | None
    labels: torch.Tensor | None
    calibration: list[tuple[torch.Tensor, ...]]
    dataset: Dataset | None = None
    view: View | None = None  # the device's view of the dataset the inputs went through


def exporter_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for pkg in ("edgefl", "torch", "onnx", "onnxscript", "onnxruntime", "litert-torch", "ai-edge-litert", "tflite-runtime",
                "tflite-micro", "mediapipe"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


class NotItsDataset(DataError):
    """The data set the export was given does not fit the model (its input shape, its class
    names, its view): the command's input is wrong, not the model (``edgefl export`` exits 2)."""


def no_dataset_error(names: list[str]) -> DataError:
    """Models whose weights name no data set, and none given: what to pass."""
    return DataError(f"no dataset to check the export of {', '.join(names[:3])} on (the weights do not name one)",
                     hint="pass --dataset NAME, the data set the model was trained on (for a device's model, the run's: "
                          "the run's ship.json names it, as dataset); parity and int8 calibration use its real samples")


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
            raise no_dataset_error([src.name])
        dataset = load_dataset(src.dataset)
    named = list(src.class_names)
    if named and len(named) == len(dataset.class_names) and named != list(dataset.class_names) \
            and named != [str(i) for i in range(len(named))]:
        # the sidecar's labels come from the file, its accuracy from the data set's order: a phone
        # would name every answer wrongly
        differ = next(i for i, (a, b) in enumerate(zip(named, dataset.class_names)) if a != b)
        raise NotItsDataset(f"{src.name} names its classes otherwise than {dataset.name}: class {differ} is "
                            f"{named[differ][:60]!r} in the file, {dataset.class_names[differ][:60]!r} in the data set",
                            hint="pass the data set the model was trained on (--dataset); if it is, the file's class_names were changed "
                                 "after edgefl wrote it: restore it from a copy")
    view = device_view(src, dataset)
    raw_shape = tuple(dataset.x_test.shape[1:])
    if view is not None and tuple(view.input_shape) != raw_shape:
        raise NotItsDataset(f"{src.name} was trained on a view of inputs of shape {list(view.input_shape)}, but {dataset.name} has {list(raw_shape)}",
                            hint="pass the dataset the model was trained on (--dataset)")
    if view is None and raw_shape != tuple(src.input_shape):
        older = ("; a device's model trained on a view of the data (fleet.groups[].view) records it from this version on: export "
                 "that run's models again after re-running it") if src.client_id and not src.run_id else ""  # a fleet device's file is newer
        raise NotItsDataset(f"{src.name} takes inputs of shape {list(src.input_shape)}, but {dataset.name} has {list(raw_shape)}",
                            hint=f"pass the dataset the model was trained on (--dataset){older}")
    # parity (the files against PyTorch) on any real samples; accuracy on samples the model never trained on
    parity_idx = torch.randperm(len(dataset.y_test), generator=torch.Generator().manual_seed(0))[:parity_samples].sort().values
    x_parity = dataset.x_test[parity_idx]
    x_pool, y_pool = dataset.x_test, dataset.y_test
    if src.held_out is not None:  # a pooled run: its devices trained on part of the test split, never on what they held out
        x_pool, y_pool = torch.cat([dataset.x_train, dataset.x_test]), torch.cat([dataset.y_train, dataset.y_test])
        if max(src.held_out) >= len(y_pool):
            raise NotItsDataset(f"{src.name} was judged on samples up to {max(src.held_out)} of {dataset.name}'s train and test splits, "
                                f"which hold {len(y_pool)}",
                                hint="pass the dataset the model was trained on (--dataset); if it is, the file's held_out_indices were changed "
                                     "after edgefl wrote it")
        held = torch.tensor(src.held_out, dtype=torch.long)
        x_pool, y_pool = x_pool[held], y_pool[held]
    n_test = min(test_samples, len(y_pool))
    test_idx = torch.randperm(len(y_pool), generator=torch.Generator().manual_seed(0))[:n_test].sort().values
    x_test, y_test = x_pool[test_idx], y_pool[test_idx]
    cal_idx = torch.randperm(len(dataset.y_train), generator=gen)[:calibration_samples]
    x_cal = dataset.x_train[cal_idx]
    if view is not None:  # the model sees what its device saw: the view of each (normalised) sample
        x_test, x_cal, x_parity = view.apply(x_test), view.apply(x_cal), view.apply(x_parity)
    calib = [(x_cal[i : i + calibration_batch],) for i in range(0, len(x_cal), calibration_batch)]
    return ExportInputs((x_parity,), (x_test,), y_test, calib, dataset, view)


def device_view(src: ModelSource, dataset: Dataset) -> View | None:
    """The view a device's model was trained through: recorded in its file, or for a file that
    recorded only the view's settings, fitted again from the run's seed and the device's id
    (views are built from those two, edgefl/data/views.py)."""
    if src.view is not None or src.view_settings is None:
        return src.view
    if src.seed is None or src.client_id is None:
        raise DataError(f"{src.name} was trained on a per-device view ({src.view_settings.kind}) that its file does not record, "
                        "and its run's seed or device is unknown",
                        hint="export it from its run directory (run.json holds the seed), or re-run with this version, which records the view")
    try:
        return make_view(src.view_settings, tuple(dataset.x_test.shape[1:]), src.seed, src.client_id)
    except ConfigError as exc:
        raise NotItsDataset(f"{src.name}: its view does not fit {dataset.name}: {exc}", hint="pass the dataset the model was trained on (--dataset)") from None


_VIEW_STEPS = {
    "features": "the model's input i is raw feature columns[i] (of input_shape[0], in the data set's column order), standardised "
                "with normalisation's mean[i] and std[i] (listed for the model's inputs)",
    "permute": "normalise the image, flatten it in channel, row, column order, take pixel permutation[i] as pixel i, reshape",
    "resize": "normalise the image, then resize it bilinearly to output_shape as PyTorch's interpolate(mode='bilinear', "
              "align_corners=False, antialias=False) does: half-pixel centres, source coordinates clamped at the edges, no antialiasing",
    "crop": "normalise the image, then cut the centred output_shape square out of it: rows from floor((H - size) / 2), "
            "columns from floor((W - size) / 2)",
    "rgb": "normalise the grey image, then repeat it over three channels and multiply channel c by gains[c]",
}


def describe_view(view: View, norm: dict[str, Any] | None) -> dict[str, Any]:
    """How a phone turns a raw sample into this model's input (the device's view, with every number
    it needs). A features view also narrows ``norm``'s per-feature mean and std to its columns, in
    their order, so that ``normalisation`` describes the model's own input."""
    record = view_record(view)
    cols = record.get("columns")
    if norm is not None and cols is not None and isinstance(norm.get("mean"), list) and len(norm["mean"]) == view.input_shape[0]:
        norm["mean"] = [norm["mean"][c] for c in cols]
        norm["std"] = [norm["std"][c] for c in cols]
        if isinstance(norm.get("feature_names"), list):
            norm["feature_names"] = [norm["feature_names"][c] for c in cols]
        norm["formula"] = "x[i] = (feature[columns[i]] - mean[i]) / std[i]"  # columns: the view's (the sidecar's view.columns)
        norm["description"] = f"{norm.get('description', '')}; listed for the model's {len(cols)} inputs (the view's columns)".lstrip("; ")
    return {**record, "steps": _VIEW_STEPS[view.settings.kind],
            "description": "this device's model was trained on its own view of the data (fleet.groups[].view): build its input as 'steps' "
                           "says; shapes are channels, rows, columns: a channels-last file takes the result transposed as its 'layout' says"}


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
    formats: tuple[str, ...] = DEFAULT_FORMATS,
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

    ``formats`` are registry names; ``micro=True`` stands for the ``micro`` format (it builds on
    tflite and implies int8). ``channels_last`` (TFLite only): None lays image inputs and outputs
    out NHWC, the TFLite convention; False keeps PyTorch's NCHW. Nothing of this model reaches
    ``out_dir`` unless every file passes.
    """
    chosen = chosen_formats((*formats, *(("micro",) if micro else ())))
    if batch < 1:
        raise ExportError("--batch must be at least 1")
    for fmt in chosen:  # a missing converter is said before minutes of work on the other formats
        fmt.check_available()
    options = ExportOptions(batch=batch, int8=int8 or any(f.needs_int8 for f in chosen), dynamic_batch=dynamic_batch,
                            channels_last=channels_last, mobile_check=mobile_check)
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise file_error(exc, f"create {out}") from None
    inputs = prepare_inputs(src, dataset, test_samples)
    staging = Staging(out, src.name, all_suffixes())
    try:
        job = ExportJob(src, inputs, options, rtol, atol, int8_min_relative_accuracy, latency_runs, log)
        for fmt in chosen:
            job.written += fmt().export(job, staging.path)
        job.write_sidecars()
        moved = staging.commit()
    except OSError as exc:
        raise file_error(exc, f"write {src.name}'s files into {out}") from None
    finally:
        staging.discard()
    for f in job.written:
        f.path, f.sidecar = moved[f.path], moved[f.sidecar] if f.sidecar is not None else None
    return job.written


class ExportJob:
    """One model's export: what every format shares (the model, real inputs, PyTorch's answers on
    them, the checks, the sidecars). Formats get it as an :class:`~edgefl.exporters.registry.ExportContext`."""

    def __init__(self, src: ModelSource, inputs: ExportInputs, options: ExportOptions, rtol: float, atol: float,
                 int8_bar: float, latency_runs: int, log: Callable[[str], None]) -> None:
        self.src, self.inputs, self.options, self.batch = src, inputs, options, options.batch
        self.rtol, self.atol, self.int8_bar, self.latency_runs, self.log = rtol, atol, int8_bar, latency_runs, log
        self.module = src.module.eval()
        self.classifier = src.kind == "classifier"
        self.parity_inputs = inputs.parity
        self.written: list[ExportedFile] = []
        with torch.no_grad():
            self.ref_parity = self.module(*inputs.parity).numpy()
            self.ref_test = (torch.cat([self.module(*(t[i : i + 500] for t in inputs.test)) for i in range(0, len(inputs.test[0]), 500)]).numpy()
                             if inputs.test else None)
        self.torch_acc = _accuracy(self.ref_test, inputs.labels) if self.classifier and self.ref_test is not None else None
        batch = self.batch
        self.sample = tuple(t[:batch] if t.shape[0] >= batch else t[:1].repeat(batch, *([1] * (t.dim() - 1))) for t in inputs.parity)
        with torch.no_grad():
            flops = count_flops(self.module, tuple(t[:1] for t in self.sample))
        self.labels = _labels(src, inputs.dataset)
        self.norm = normalisation(src.dataset or (inputs.dataset.name if inputs.dataset else None), inputs.dataset) if self.classifier else None
        self.view = describe_view(inputs.view, self.norm) if inputs.view is not None else None
        self.base = {
            "model": src.model, "model_options": src.model_options, "kind": src.kind,
            "class_labels": self.labels, "num_classes": src.num_classes,
            "parameters": sum(p.numel() for p in self.module.parameters()), "flops_per_sample": int(flops),
            "source": {"run": src.run, "run_name": src.run_name, "method": src.method, "seed": src.seed, "round": src.round,
                       "weights": src.weights_path, "weights_sha256": src.weights_sha256,
                       "dataset": src.dataset or (inputs.dataset.name if inputs.dataset else None),
                       "device": src.client_id, "run_id": src.run_id},
            "pytorch_test_accuracy": self.torch_acc, "test_samples": len(inputs.labels) if inputs.labels is not None else 0,
            "test_set": (None if inputs.labels is None else
                         "samples its run's devices held out and never trained on (the run pooled the data set's splits)"
                         if src.held_out is not None else
                         "the data set's test split, part of which its run's devices trained on (the run pooled the splits, and "
                         "this model file predates edgefl recording what they held out): an optimistic accuracy"
                         if src.pooled else "the data set's test split"),
            "edgefl_version": edgefl_version(), "exporter_versions": exporter_versions(),
            "exported": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "normalisation": self.norm, "view": self.view,
        }

    def calibration(self) -> list[tuple[torch.Tensor, ...]]:
        return fixed_batches(self.inputs.calibration, self.batch)

    # --- checks shared by every file --------------------------------------------------------------
    def judge(self, f: ExportedFile, runner: Callable[..., np.ndarray], layout_fn: Callable[[torch.Tensor], torch.Tensor] = lambda a: a,
              atol: float | None = None) -> None:
        """Parity for float files (``atol``: a format's own floor, when its runtime's kernels are
        known to sum in another order); accuracy for classifiers; the int8 bar."""
        got = run_in_batches(runner, tuple(layout_fn(t) for t in self.inputs.parity), f.batch)
        got = _output_layout(got, f.extra.get("layout"), self.src.kind)
        if f.precision == "float32":
            f.parity = check_parity(f.path.name, self.ref_parity, got, rtol=self.rtol, atol=max(self.atol, atol or 0.0),
                                    classifier=self.classifier)
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

    def describe(self, f: ExportedFile) -> str:
        src = self.src
        if self.classifier:
            how = self.norm.get("formula") if self.norm else None
            return (f"edgefl {src.model} classifier ({src.num_classes} classes{', ' + src.dataset if src.dataset else ''}), "
                    f"{f.precision}. Input 'input' {f.extra['layout']}" + (f", {how}" if how else "") +
                    "; output 'logits' (argmax = class; labels in "
                    + ("the packed labels.txt)." if f.format == "tflite" else "metadata edgefl.labels).")
                    + (" The input is this device's own view of a sample (" + ("the sidecar's view" if f.format == "tflite" else "metadata edgefl.view")
                       + " says how to build it)." if self.view else "")
                    + (f" Run {src.run_name or src.run}, round {src.round}." if src.run else ""))
        return (f"edgefl {src.model} decoder: inputs 'z' (latent, N(0, I)) and 'y_onehot' (class), output 'sample' "
                f"(an image in [0, 1]), {f.precision}.")

    # --- sidecars ----------------------------------------------------------------------------------
    def write_sidecars(self) -> None:
        for f in self.written:
            io = f.extra.get("io")  # what the runtime reports; a format without a runtime may leave it out
            fields = {**self.base, "format": f.format, "precision": f.precision,
                      "inputs": _describe_inputs(self.src, f) if io else None, "outputs": _describe_outputs(self.src, f) if io else None,
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


def edgefl_version() -> str:
    from edgefl import __version__

    return __version__


def layout_of(sample: tuple[torch.Tensor, ...], nhwc: bool) -> str:
    """The layout name of a classifier's input: NCHW/NHWC for images, NC for features."""
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


def fixed_batches(calibration: list[tuple[torch.Tensor, ...]], batch: int) -> list[tuple[torch.Tensor, ...]]:
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


__all__ = ["ExportError", "ExportJob", "ExportedFile", "ParityError", "export_model", "prepare_inputs", "run_in_batches"]
