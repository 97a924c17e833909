"""The ``micro`` export format: the integer-only NAME.int8.tflite as a C array (NAME.int8.h) for
TFLite Micro firmware, with the op resolver it needs and its measured tensor arena.

It builds on the ``tflite`` format (and turns int8 on): it adds no model file of its own, only the
header beside the int8 .tflite, whose sidecar gets the ``micro`` facts. The measuring and the C
array are :mod:`edgefl.exporters.micro`.
"""

from __future__ import annotations

from pathlib import Path

from edgefl.exporters.registry import ExportContext, ExportedFile, ExportError, ExportFormat, Requirement, register_format
from edgefl.exporters.tflite_format import input_layout_fn

#: TFLite Micro and LiteRT run the same int8 graph; below this they do not, and the header would lie
MIN_AGREEMENT = 0.99


@register_format
class MicroFormat(ExportFormat):
    name = "micro"
    summary = "NAME.int8.h for TFLite Micro firmware: the int8 .tflite as a C array, its op resolver, its measured arena (with tflite; implies --int8)"
    suffixes = (".int8.h",)
    requires = (Requirement(("tflite_micro",), "tflite-micro (the TFLite Micro interpreter)"),)
    builds_on = "tflite"
    needs_int8 = True

    def export(self, job: ExportContext, folder: Path) -> list[ExportedFile]:
        import numpy as np

        from edgefl.exporters.micro import measure_arena, micro_facts, micro_outputs, resolver_code, write_c_header
        from edgefl.exporters.tflite_export import TFLiteRunner, io_names
        from edgefl.exporters.tflite_model import list_ops

        f = next(g for g in job.written if g.format == "tflite" and g.precision == "int8")
        job.log(f"tflite micro: {f.path.name}")
        runner = TFLiteRunner(f.path, input_order=io_names(job.src.kind)[0])
        listing = list_ops(f.path)
        batch = job.options.batch
        samples = tuple(input_layout_fn(job, f)(t) for t in job.parity_inputs)
        n = samples[0].shape[0] // batch * batch
        batches = [runner.quantise(*(t[i : i + batch].numpy() for t in samples)) for i in range(0, n, batch)]
        arena = measure_arena(f.path, batches[0])
        micro = micro_outputs(f.path, arena, batches)
        litert = np.concatenate([runner.raw(*b) for b in batches])
        agreement = float((micro.reshape(len(micro), -1).argmax(1) == litert.reshape(len(litert), -1).argmax(1)).mean())
        if job.classifier and agreement < MIN_AGREEMENT:
            raise ExportError(f"{f.path.name}: TFLite Micro agrees with LiteRT on only {agreement:.1%} of the parity inputs",
                              hint="report it: the two interpreters should compute the same int8 graph")
        header = write_c_header(f.path, folder / f"{job.src.name}.int8.h", arena, resolver_code(listing))
        f.extra["micro"] = micro_facts(listing, arena, agreement, header)
        return []  # the header is described in the int8 .tflite's sidecar, not a file of its own
