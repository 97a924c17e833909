"""The JSON sidecar next to every exported file: everything a phone app needs to use it.

``model.tflite`` gets ``model.tflite.json``. The SHA-256 of the model file is recorded so an app
(or :func:`read_sidecar`) can tell that the file and its description still belong together.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from edgefl.errors import EdgeflError

SIDECAR_FORMAT = "edgefl-export/1"


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sidecar_path(model_file: str | Path) -> Path:
    p = Path(model_file)
    return p.with_name(p.name + ".json")


def write_sidecar(model_file: str | Path, fields: dict[str, Any]) -> Path:
    """Write the sidecar (atomically) with the file's hash and size filled in."""
    model_file = Path(model_file)
    record = {**fields, "schema": SIDECAR_FORMAT, "file": model_file.name, "sha256": sha256_file(model_file),
              "size_bytes": model_file.stat().st_size}
    out = sidecar_path(model_file)
    tmp = out.with_name("." + out.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True, default=str))
    tmp.replace(out)
    return out


def read_sidecar(model_file: str | Path, verify: bool = True) -> dict[str, Any]:
    """The sidecar of ``model_file``; with ``verify`` the file's hash must match the record."""
    path = sidecar_path(model_file)
    if not path.is_file():
        raise EdgeflError(f"{model_file} has no metadata sidecar ({path.name})", hint="re-export it with `edgefl export`")
    record = json.loads(path.read_text())
    if record.get("schema") != SIDECAR_FORMAT:
        raise EdgeflError(f"{path} is not an edgefl export sidecar")
    if verify and sha256_file(model_file) != record["sha256"]:
        raise EdgeflError(f"{model_file} does not match its sidecar's SHA-256 (changed or truncated since export)",
                          hint="re-export it, or copy the file and its .json together")
    return record
