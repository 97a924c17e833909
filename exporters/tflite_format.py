"""The ``tflite`` export format: NAME.tflite (float) and NAME.int8.tflite (integer-only int8).

The converter and interpreter live in :mod:`edgefl.exporters.tflite_export`, the op listing and
embedded metadata in :mod:`edgefl.exporters.tflite_model`; this module decides which files a model
gets and checks each. Nothing heavy is imported until a model is exported.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgefl.exporters.registry import EXPORT_EXTRA, ExportContext, ExportedFile, ExportError, ExportFormat, Requirement, register_format

if TYPE_CHECKING:
    import torch


@register_format
class TFLiteFormat(ExportFormat):
    name = "tflite"
    summary = "NAME.tflite (NHWC image I/O by default), NAME.int8.tflite with --int8 (integer-only); run in LiteRT"
    suffixes = (".tflite", ".int8.tflite")
    requires = (Requirement(("litert_torch",), "litert-torch (the TFLite converter)",
                            f"{EXPORT_EXTRA} on an x86-64 machine (the converter has no aarch64 wheel)"),
                Requirement(("ai_edge_litert",), "ai-edge-litert (the interpreter)"),
                Requirement(("mediapipe",), "mediapipe (the TFLite metadata schema)"))

    def export(self, job: ExportContext, folder: Path) -> list[ExportedFile]:
        from edgefl.exporters.export import layout_of
        from edgefl.exporters.residual import quantisable
        from edgefl.exporters.tflite_export import TFLiteRunner, channels_last_wrapper, convert, io_names, resizable
        from edgefl.exporters.tflite_model import list_ops

        src, opts, written = job.src, job.options, []
        images = (job.classifier and job.sample[0].dim() == 4) or (not job.classifier and len(src.input_shape) == 3)
        nhwc = images and opts.channels_last is not False
        conv_module, conv_sample = job.module, job.sample
        to_layout: Callable[[torch.Tensor], torch.Tensor] = _same
        if nhwc:
            conv_module, conv_sample = channels_last_wrapper(job.module, src.kind, job.sample)
            if job.classifier:
                to_layout = _nhwc  # a decoder's inputs are vectors: only its output image is re-laid
        layout = layout_of(job.sample, nhwc) if job.classifier else ("NHWC" if nhwc else "NCHW")
        for precision in ("float32", "int8") if opts.int8 else ("float32",):
            name = f"{src.name}.tflite" if precision == "float32" else f"{src.name}.int8.tflite"
            path = folder / name
            job.log(f"tflite: {name}")
            calib = None
            module = conv_module
            if precision == "int8":
                calib = [tuple(to_layout(t) if i == 0 and job.classifier else t for i, t in enumerate(c)) for c in job.calibration()]
                module = quantisable(conv_module, conv_sample)
            convert(module, conv_sample, path, kind=src.kind, calibration=calib)
            _describe(job, path, precision, layout)
            order = io_names(src.kind)[0]
            runner = TFLiteRunner(path, input_order=order)
            can_resize = resizable(path, tuple(t.numpy() for t in conv_sample), order)
            listing = list_ops(path)
            f = ExportedFile(path, "tflite", precision, opts.batch,
                             extra={"layout": layout, "interpreter": runner.runtime, "io": runner.io(),
                                    "signature_key": runner.signature_key, "ops": listing.to_dict(),
                                    "resizable_batch": can_resize,
                                    "batch_note": "resize_tensor_input changes the batch" if can_resize else
                                    f"fixed batch {opts.batch} (the graph reshapes the batch dimension); export with --batch N for another"})
            if precision == "int8":
                f.extra["integer_only"] = listing.integer_only
                if job.classifier and not listing.integer_only:
                    raise ExportError(f"{name} is not integer-only: {', '.join(sorted(set(listing.float_ops)))} compute in float",
                                      hint="an op without an int8 kernel in the converter; ship the float file, or replace that layer")
            job.judge(f, runner, to_layout)
            written.append(f)
        return written


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _nhwc(t: torch.Tensor) -> torch.Tensor:
    return t.permute(0, 2, 3, 1).contiguous()


def input_layout_fn(job: ExportContext, f: ExportedFile) -> Callable[[torch.Tensor], torch.Tensor]:
    """How PyTorch's inputs become ``f``'s (NCHW -> NHWC for a channels-last classifier)."""
    return _nhwc if job.classifier and f.extra.get("layout") == "NHWC" else _same


def _describe(job: ExportContext, path: Path, precision: str, layout: str) -> None:
    """The standard TFLite model metadata, read by Android's code generator and ML Binding."""
    from edgefl.exporters.export import edgefl_version
    from edgefl.exporters.tflite_model import embed_metadata

    src, norm = job.src, job.norm
    if job.classifier:
        image = len(src.input_shape) == 3
        entry: dict[str, Any] = {"name": "input", "kind": "image" if image else "feature",
                                 "channels": src.input_shape[0] if image else None,
                                 "description": f"{'image' if image else 'features'}, {layout}"
                                                + (f"; {norm['formula']}" if norm and norm.get("formula") else "")}
        view = job.view
        if view is not None:  # never a plain image: an app's own preprocessing would skip the view's steps
            cols = f"; the raw sample's columns {view['columns']}, in that order" if "columns" in view else ""
            entry = {"name": "input", "kind": "feature", "description": f"this device's own view ({view['kind']}) of a sample, {layout}{cols}: "
                                                                          f"{view['steps']} (the sidecar's view holds every number)"}
        if norm and norm.get("mean") is not None and (view is None or view["kind"] == "features"):
            entry["mean"], entry["std"] = norm["mean"], norm["std"]
            if "min" in norm:
                entry["min"], entry["max"] = norm["min"], norm["max"]
        inputs = [entry]
        outputs = [{"name": "logits", "kind": "feature", "description": "unnormalised class scores (argmax = class)"}]
        labels = job.labels
    else:
        inputs = [{"name": "z", "kind": "feature", "description": "latent draw, z ~ N(0, I)"},
                  {"name": "y_onehot", "kind": "feature", "description": "one-hot class"}]
        outputs = [{"name": "sample", "kind": "image", "channels": src.input_shape[0], "description": f"generated image in [0, 1], {layout}"}]
        labels = None
    embed_metadata(path, name=f"edgefl {src.model}",
                   description=job.describe(ExportedFile(path, "tflite", precision, job.options.batch, extra={"layout": layout})),
                   version=f"{edgefl_version()}; round {src.round}" if src.round is not None else edgefl_version(),
                   inputs=inputs, outputs=outputs, labels=labels)
