"""edgefl.exporters: the global model (or any zoo model's weights) as ONNX and TFLite files a phone
or board can run, each checked against PyTorch on real inputs and described by a JSON sidecar.

Installed as ``edgefl.exporters``; this folder sits at the repository's top level by design.
The heavy dependencies (onnx, onnxruntime, litert-torch, ai-edge-litert) come with the ``export``
extra and are imported only when a format needs them::

    from edgefl.exporters import export_path
    files = export_path("runs/my-run", "exports/", formats=("onnx", "tflite"), int8=True)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from edgefl.exporters.export import ExportedFile, export_model
from edgefl.exporters.metadata import read_sidecar, sha256_file
from edgefl.exporters.onnx_export import ExportError
from edgefl.exporters.parity import ATOL, RTOL, Parity, ParityError, check_parity
from edgefl.exporters.source import ExportSourceError, ModelSource, from_module, load_weights_file, sources_from_path


def export_path(path: str | Path, out_dir: str | Path | None = None, *, model: str | None = None, select: str | None = None,
                **kwargs: Any) -> list[ExportedFile]:
    """Export a run directory's models (its global models when it has them) or one weights file.

    ``out_dir`` defaults to ``RUN_DIR/export`` (or next to the weights file).
    """
    path = Path(path)
    sources = sources_from_path(path, model=model, select=select)
    if out_dir is None:
        out_dir = path / "export" if path.is_dir() else path.parent / "export"
    files: list[ExportedFile] = []
    for src in sources:
        files += export_model(src, out_dir, **kwargs)
    return files


__all__ = [
    "ATOL", "RTOL", "ExportError", "ExportSourceError", "ExportedFile", "ModelSource", "Parity", "ParityError",
    "check_parity", "export_model", "export_path", "from_module", "load_weights_file", "read_sidecar", "sha256_file",
    "sources_from_path",
]
