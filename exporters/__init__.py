"""edgefl.exporters: the global model (or any zoo model's weights) as ONNX and TFLite files a phone
or board can run, each checked against PyTorch on real inputs and described by a JSON sidecar.

Installed as ``edgefl.exporters``; this folder sits at the repository's top level by design.
The heavy dependencies (onnx, onnxruntime, litert-torch, ai-edge-litert) come with the ``export``
extra and are imported only when a format needs them::

    from edgefl.exporters import export_path
    files = export_path("runs/my-run", "exports/", formats=("onnx", "tflite"), int8=True)

Formats are chosen by name through :mod:`edgefl.exporters.registry`; a new one is a module with an
``ExportFormat`` subclass and a ``register_format`` call (docs/export.md).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

# The built-in formats register on import, in this order (the order `edgefl export --help` lists
# them); their modules are light: each imports its converter only when a model is exported.
from edgefl.exporters import onnx_format, tflite_format, micro_format, executorch_format  # noqa: F401
from edgefl.exporters.registry import (
    ExportedFile,
    ExportError,
    ExportFormat,
    ExportOptions,
    Requirement,
    format_names,
    get_format,
    register_format,
)

# Names resolve on first use (PEP 562): importing edgefl.exporters stays cheap and works where
# torch and the export extra are not installed (a device's light install, the packaging test).
_LAZY = {
    "export_model": "export",
    "read_sidecar": "metadata", "sha256_file": "metadata",
    "ATOL": "parity", "RTOL": "parity", "Parity": "parity", "ParityError": "parity", "check_parity": "parity",
    "ExportSourceError": "source", "ModelSource": "source", "from_module": "source", "load_weights_file": "source",
    "sources_from_path": "source",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"edgefl.exporters.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'edgefl.exporters' has no attribute {name!r}")


def default_out_dir(path: str | Path) -> Path:
    """Where exports go by default: RUN_DIR/export, or export/ next to a weights file."""
    path = Path(path)
    return path / "export" if path.is_dir() else path.parent / "export"


def export_path(path: str | Path, out_dir: str | Path | None = None, *, model: str | None = None, select: str | None = None,
                **kwargs: Any) -> list[ExportedFile]:
    """Export a run directory's models (its global models when it has them) or one weights file.

    ``out_dir`` defaults to ``RUN_DIR/export`` (or next to the weights file).
    """
    from edgefl.exporters.export import export_model
    from edgefl.exporters.source import sources_from_path

    path = Path(path)
    sources = sources_from_path(path, model=model, select=select)
    out_dir = default_out_dir(path) if out_dir is None else out_dir
    files: list[ExportedFile] = []
    for src in sources:
        files += export_model(src, out_dir, **kwargs)
    return files


__all__ = [*_LAZY, "ExportError", "ExportFormat", "ExportOptions", "ExportedFile", "Requirement", "default_out_dir", "export_path",
           "format_names", "get_format", "register_format"]
