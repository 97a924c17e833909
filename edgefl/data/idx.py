"""Reader for the IDX format (MNIST, Fashion-MNIST), gzip-compressed or plain.

Written by hand because it is 40 lines and every library that reads it also downloads data at
import time or pulls in a framework; it validates everything it reads so a truncated or foreign
file is an error naming the file, never a silently short dataset.
"""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np

from edgefl.errors import DataError

_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: np.dtype(">i2"), 0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}
_GZIP_MAGIC = b"\x1f\x8b"


def read_idx(path: str | Path) -> np.ndarray:
    """Read one IDX file (``.gz`` or plain, detected from the content) into a numpy array."""
    path = Path(path)
    fix = "delete it and fetch it again (or reinstall the dataset package)"
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror}") from None
    if raw[:2] == _GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise DataError(f"{path} is a damaged gzip file ({exc})", hint=fix) from None
    if len(raw) < 4:
        raise DataError(f"{path} is too short to be an IDX file ({len(raw)} bytes)", hint=fix)
    zero, type_code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or type_code not in _DTYPES or not 1 <= ndim <= 4:
        raise DataError(f"{path} is not an IDX file (magic {raw[:4].hex()})", hint=fix)
    header_len = 4 + 4 * ndim
    if len(raw) < header_len:
        raise DataError(f"{path}: header truncated", hint=fix)
    dims = struct.unpack(f">{ndim}I", raw[4:header_len])
    dtype = np.dtype(_DTYPES[type_code])
    expected = int(np.prod(dims)) * dtype.itemsize
    body = len(raw) - header_len
    if body != expected:
        what = "truncated" if body < expected else "has trailing bytes"
        raise DataError(f"{path} {what}: header says {dims} ({expected} bytes), file holds {body}", hint=fix)
    arr = np.frombuffer(raw, dtype=dtype, offset=header_len).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def write_idx(path: str | Path, array: np.ndarray, compress: bool | None = None) -> None:
    """Write an array as IDX (uint8 only: what MNIST-format datasets use). For tests and tools."""
    path = Path(path)
    arr = np.ascontiguousarray(array, dtype=np.uint8)
    payload = struct.pack(">HBB", 0, 0x08, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes()
    if compress if compress is not None else path.suffix == ".gz":
        payload = gzip.compress(payload, mtime=0)
    path.write_bytes(payload)
