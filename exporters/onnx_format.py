"""The ``onnx`` export format: NAME.onnx (fixed batch), NAME.dynamic.onnx, NAME.int8.onnx.

The conversion, checker, runtime and quantiser live in :mod:`edgefl.exporters.onnx_export`; this
module decides which files a model gets and checks each. Nothing heavy is imported until a model is
exported, so the registry stays cheap to list.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from edgefl.exporters.registry import ExportContext, ExportedFile, ExportError, ExportFormat, Requirement, register_format

if TYPE_CHECKING:
    from edgefl.exporters.source import ModelSource


@register_format
class OnnxFormat(ExportFormat):
    name = "onnx"
    summary = "NAME.onnx (fixed batch, for phones), NAME.dynamic.onnx (servers), NAME.int8.onnx with --int8; run in ONNX Runtime"
    suffixes = (".onnx", ".dynamic.onnx", ".int8.onnx")
    requires = (Requirement(("onnx",), "onnx"), Requirement(("onnxscript",), "onnxscript (torch's ONNX exporter)"),
                Requirement(("onnxruntime",), "onnxruntime"))

    def export(self, job: ExportContext, folder: Path) -> list[ExportedFile]:
        from edgefl.exporters.export import layout_of
        from edgefl.exporters.onnx_export import OnnxRunner, check_model_file, export_onnx, mobile_usability

        src, opts, written = job.src, job.options, []
        variants = [(f"{src.name}.onnx", opts.batch)] + ([(f"{src.name}.dynamic.onnx", None)] if opts.dynamic_batch else [])
        for filename, b in variants:
            path = folder / filename
            job.log(f"onnx: {filename}")
            export_onnx(job.module, job.sample, path, src.kind, dynamic=b is None)
            f = ExportedFile(path, "onnx", "float32", b, extra={"layout": layout_of(job.sample, False), "opset": _opset(path)})
            _describe(job, f)
            check_model_file(path)
            runner = OnnxRunner(path, threads=1)
            f.extra["io"] = runner.io()
            job.judge(f, runner)
            if b is not None and opts.mobile_check:  # a symbolic batch is refused by every mobile EP: no verdict to give
                f.extra["mobile_usability"] = mobile_usability(path)
            written.append(f)
        if opts.int8:
            written.append(self._int8(job, folder))
        return written

    def _int8(self, job: ExportContext, folder: Path) -> ExportedFile:
        from edgefl.exporters.export import layout_of
        from edgefl.exporters.onnx_export import OnnxRunner, check_model_file, first_compute_node, mobile_usability, quantize_int8

        src, batch = job.src, job.options.batch
        names = ["input"] if job.classifier else ["z", "y_onehot"]
        path = folder / f"{src.name}.int8.onnx"
        calibration = job.calibration()
        job.log(f"onnx: {path.name} (int8, calibrating on {sum(len(c[0]) for c in calibration)} real samples)")
        fixed_calib = [tuple(t.numpy() for t in c) for c in calibration]
        float_file = folder / f"{src.name}.onnx"
        # all nodes int8 first; below the bar, once more with the first layer (which sees the
        # raw input) kept float, as is usual for int8 deployments; the sidecar names it
        first = first_compute_node(float_file)
        attempts = [[]] + ([[first]] if first else [])
        for attempt, exclude in enumerate(attempts):
            quantize_int8(float_file, path, iter(fixed_calib), names, exclude=exclude)
            f = ExportedFile(path, "onnx", "int8", batch, extra={
                "layout": layout_of(job.sample, False), "opset": _opset(path), "float_nodes": exclude,
                "quantization": "QDQ static, per-channel weights" + (f"; {exclude[0]} kept float" if exclude else "")})
            _describe(job, f)
            check_model_file(path)
            runner = OnnxRunner(path, threads=1)
            f.extra["io"] = runner.io()
            try:
                job.judge(f, runner)
                break
            except ExportError:
                if attempt == len(attempts) - 1:
                    raise
                job.log(f"onnx: {path.name} below the int8 bar; again with {first} kept float")
        if job.options.mobile_check:
            f.extra["mobile_usability"] = mobile_usability(path)
        return f


def _describe(job: ExportContext, f: ExportedFile) -> None:
    """The facts an app reads from the file itself (ONNX Runtime's get_modelmeta)."""
    from edgefl.exporters.export import edgefl_version
    from edgefl.exporters.onnx_export import embed_onnx_metadata

    src = job.src
    props = {
        "edgefl.version": edgefl_version(), "edgefl.model": src.model, "edgefl.model_options": json.dumps(src.model_options),
        "edgefl.kind": src.kind, "edgefl.precision": f.precision, "edgefl.layout": f.extra["layout"],
        "edgefl.dataset": src.dataset or "", "edgefl.labels": json.dumps(job.labels),
        "edgefl.normalisation": json.dumps(job.norm), "edgefl.view": json.dumps(job.view) if job.view else "", "edgefl.run": src.run_name or src.run or "",
        "edgefl.method": src.method or "", "edgefl.seed": "" if src.seed is None else str(src.seed),
        "edgefl.round": "" if src.round is None else str(src.round), "edgefl.weights_sha256": src.weights_sha256 or "",
    }
    # unknown facts (a bare module has no run or seed) are left out rather than written empty
    embed_onnx_metadata(f.path, {k: v for k, v in props.items() if v}, version=_model_version(src), doc=job.describe(f))


def _model_version(src: ModelSource) -> int:
    """ONNX model_version: the round the weights come from (1 for weights without one)."""
    return int(src.round) if isinstance(src.round, int) and src.round > 0 else 1


def _opset(path: Path) -> int | None:
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
