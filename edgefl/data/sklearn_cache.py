"""The train/test split of a scikit-learn data set, kept as arrays in the user cache.

Importing scikit-learn pulls in SciPy and pandas: about 1.5 s of CPU in every process that loads
digits or breast-cancer, and a fleet starts one process per device. The split is computed by
scikit-learn once per (data set, scikit-learn version, test fraction, split seed) and read back
from a safetensors file after that (the class names, and a table's column names, in its metadata): safetensors checks that
the header's shapes, types and offsets describe the bytes the file holds before any array is
read. A file that cannot be read, whose contents do not match the SHA-256 it was written with (a
flipped bit), or whose arrays do not have the shapes, types and values a split has, is ignored and
written again (the digest guards against damage, not against someone who rewrites the file and
its digest: the cache is the user's own, like the downloaded data sets); a cache folder that
cannot be written only costs the import.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import secrets
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

#: the arrays of a split: inputs float32, labels int64 (the class names travel in the metadata)
KEYS = ("x_train", "y_train", "x_test", "y_test")
#: a standardised set's per-feature mean and std (float64), what its exports normalise with
SCALING = ("mean", "std")
#: a split of these small sets is well under this; a larger file is not one this module wrote
MAX_CACHE_BYTES = 64 << 20


def split_path(root: Path, name: str, test_fraction: float, split_seed: int) -> Path | None:
    """Where the split is kept, named by everything that decides it; None without scikit-learn
    (its version is part of the name: another version may split or scale differently)."""
    try:
        version = importlib.metadata.version("scikit-learn")
    except importlib.metadata.PackageNotFoundError:
        return None
    return root / "sklearn" / f"{name}-sklearn{version}-test{test_fraction!r}-seed{int(split_seed)}.safetensors"


def read_split(path: Path | None, samples: int, input_shape: tuple[int, ...], classes: int,
               standardised: bool) -> dict[str, np.ndarray] | None:
    """The arrays kept at ``path`` (``class_names`` among them, and ``feature_names`` for a
    standardised table), or None when there is no usable file: one whose split does not hold
    ``samples`` inputs of ``input_shape`` over ``classes`` classes, with the per-feature mean, std
    and column names exactly when the set is ``standardised``, is not usable."""
    if path is None:
        return None
    from safetensors import SafetensorError, safe_open

    try:
        if not path.is_file() or path.stat().st_size > MAX_CACHE_BYTES:
            return None
        with safe_open(str(path), framework="np") as stored:
            meta = stored.metadata() or {}
            names = json.loads(meta.get("class_names", "null"))
            features = json.loads(meta.get("feature_names", "null"))
            arrays = {k: stored.get_tensor(k) for k in stored.keys()}
    except (OSError, ValueError, SafetensorError, MemoryError, RecursionError) as exc:  # torn or foreign: computed again
        log.info("ignoring the cached split %s: %s", path, exc)
        return None
    if not (isinstance(names, list) and len(names) == classes and all(isinstance(n, str) and 0 < len(n) <= 100 for n in names)):
        return None
    if standardised != (isinstance(features, list) and len(features) == input_shape[0]
                        and all(isinstance(n, str) and 0 < len(n) <= 200 for n in features)):
        return None  # a table's columns are named (a file of an older version without them: computed again)
    if meta.get("sha256") != _digest(arrays, meta["class_names"], meta.get("feature_names", "")):  # a flipped bit passes every other check
        log.info("ignoring the cached split %s: its contents do not match their SHA-256", path)
        return None
    if not _is_a_split(arrays, samples, input_shape, classes, standardised):
        return None
    return {**arrays, "class_names": np.array(names), **({"feature_names": np.array(features)} if standardised else {})}


def _is_a_split(arrays: dict[str, np.ndarray], samples: int, input_shape: tuple[int, ...], classes: int, standardised: bool) -> bool:
    if not all(k in arrays for k in KEYS) or set(arrays) - set(KEYS) - set(SCALING):
        return False
    x_train, y_train, x_test, y_test = (arrays[k] for k in KEYS)
    if len(x_train) + len(x_test) != samples or x_train.shape[1:] != input_shape or x_test.shape[1:] != input_shape:
        return False
    if not standardised:
        scaled = all(k not in arrays for k in SCALING)
    else:
        mean, std = arrays.get("mean"), arrays.get("std")
        scaled = (mean is not None and std is not None and mean.dtype == std.dtype == np.float64 and mean.shape == std.shape == input_shape
                  and bool(np.isfinite(mean).all()) and bool(np.isfinite(std).all()) and bool((std > 0).all()))
    return (scaled and x_train.dtype == np.float32 and x_test.dtype == np.float32 and y_train.dtype == np.int64
            and y_test.dtype == np.int64 and y_train.shape == (len(x_train),) and y_test.shape == (len(x_test),)
            and bool(np.all((y_train >= 0) & (y_train < classes))) and bool(np.all((y_test >= 0) & (y_test < classes)))
            and bool(np.isfinite(x_train).all()) and bool(np.isfinite(x_test).all()))


def _digest(arrays: dict[str, np.ndarray], names: str, features: str = "") -> str:
    """SHA-256 of the split as written: each array's name, type, shape and bytes, then the class
    names and (a table's) the column names."""
    h = hashlib.sha256()
    for key in sorted(arrays):
        value = np.ascontiguousarray(arrays[key])
        h.update(f"{key}:{value.dtype.str}:{value.shape};".encode())
        h.update(value.tobytes())
    h.update(names.encode())
    h.update(features.encode())
    return h.hexdigest()


def write_split(path: Path | None, arrays: dict[str, np.ndarray]) -> None:
    """Keep ``arrays`` at ``path``, whole or not at all (written aside, then renamed: device
    processes started together may all write it)."""
    if path is None:
        return
    from safetensors.numpy import save

    tensors = {k: np.ascontiguousarray(v) for k, v in arrays.items() if k not in ("class_names", "feature_names")}
    names = json.dumps([str(c) for c in arrays["class_names"]])
    features = json.dumps([str(c) for c in arrays["feature_names"]]) if "feature_names" in arrays else ""
    blob = save(tensors, metadata={"class_names": names, **({"feature_names": features} if features else {}),
                                   "sha256": _digest(tensors, names, features)})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # a name of its own, created exclusively (mkstemp would make the file 0600: the cache is
        # as readable as the user's umask makes any file)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}-{secrets.token_hex(4)}.partial")
        try:
            with open(tmp, "xb") as f:
                f.write(blob)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:  # a read-only home: the split is computed each time
        log.info("not caching the split in %s: %s", path, exc)
