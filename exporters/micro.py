"""An integer-only .tflite for microcontrollers: the TFLite Micro resolver, arena size and C array.

A TFLite Micro build links only the kernels its ``MicroMutableOpResolver`` registers and runs the
model out of one static tensor arena. :func:`micro_facts` gives the resolver lines for the file's
ops, the arena size *measured* with the TFLite Micro interpreter from PyPI (``tflite-micro``: the
smallest arena, to 256 bytes, in which it allocates and runs the model; add the headroom your
target's alignment needs), and the agreement of that interpreter's outputs with LiteRT's.
:func:`write_c_header` writes the file as a C array (what ``xxd -i`` gives, 16-byte aligned as
TFLite Micro requires), so the model links into firmware without a file system.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from edgefl.exporters.registry import ExportError
from edgefl.exporters.tflite_model import OpListing

ARENA_STEP = 256


def resolver_method(op: str) -> str:
    """TFLite op name -> MicroMutableOpResolver method: CONV_2D -> AddConv2D."""
    return "Add" + "".join(p.upper() if p[0].isdigit() else p.capitalize() for p in op.split("_"))


def resolver_code(listing: OpListing) -> str:
    ops = sorted(listing.counts)
    lines = [f"static tflite::MicroMutableOpResolver<{len(ops)}> resolver;"]
    lines += [f"resolver.{resolver_method(op)}();" for op in ops]
    return "\n".join(lines)


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """TFLite Micro prints each failed allocation to the C stderr; the search makes many."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _micro_runtime():
    try:
        from tflite_micro.python.tflite_micro import runtime
    except ImportError:
        raise ExportError("--micro needs the TFLite Micro interpreter", hint="pip install -e '.[export]' in the edgefl checkout (tflite-micro)") from None
    return runtime


def _run(runtime, data: bytes, arena: int, inputs: list[np.ndarray]) -> list[np.ndarray] | None:
    try:
        interp = runtime.Interpreter.from_bytes(data, arena_size=arena)
        for i, a in enumerate(inputs):
            interp.set_input(a, i)
        interp.invoke()
        return [interp.get_output(0)]
    except Exception:  # too small an arena: the interpreter refuses to allocate
        return None


def measure_arena(path: Path, inputs: list[np.ndarray], limit: int = 64 << 20) -> int:
    """The smallest tensor arena (to ``ARENA_STEP`` bytes) in which TFLite Micro runs the model."""
    runtime, data = _micro_runtime(), path.read_bytes()
    with _quiet_stderr():
        if _run(runtime, data, limit, inputs) is None:
            raise ExportError(f"{path.name}: TFLite Micro cannot run it even with a {limit >> 20} MiB arena",
                              hint="an op without a TFLite Micro kernel, or a model too large for a microcontroller")
        lo, hi = 0, limit
        while hi - lo > ARENA_STEP:
            mid = (lo + hi) // 2
            if _run(runtime, data, mid, inputs) is None:
                lo = mid
            else:
                hi = mid
    return -(-hi // ARENA_STEP) * ARENA_STEP


def micro_outputs(path: Path, arena: int, batches: list[list[np.ndarray]]) -> np.ndarray:
    """TFLite Micro's raw (int8) outputs for each batch of already-quantised inputs."""
    runtime, data = _micro_runtime(), path.read_bytes()
    outs = []
    with _quiet_stderr():
        for inputs in batches:
            got = _run(runtime, data, arena, inputs)
            if got is None:
                raise ExportError(f"{path.name}: TFLite Micro failed on an input with the measured arena ({arena} bytes)")
            outs.append(got[0])
    return np.concatenate(outs)


def c_identifier(name: str) -> str:
    return re.sub(r"\W", "_", name) if not name[:1].isdigit() else "_" + re.sub(r"\W", "_", name)


def write_c_header(path: Path, header: Path, arena_bytes: int, resolver: str) -> Path:
    data = path.read_bytes()
    ident = c_identifier(path.name)
    rows = [", ".join(f"0x{b:02x}" for b in data[i : i + 12]) for i in range(0, len(data), 12)]
    guard = c_identifier(header.name).upper()
    text = "\n".join([
        f"// {path.name} as a C array, written by edgefl export --micro. Do not edit.",
        f"// TFLite Micro: tensor arena measured at {arena_bytes} bytes; resolver:",
        *(f"//   {line}" for line in resolver.splitlines()),
        f"#ifndef {guard}", f"#define {guard}", "",
        f"alignas(16) const unsigned char {ident}[] = {{",
        *(f"  {row}," for row in rows),
        "};",
        f"const unsigned int {ident}_len = {len(data)};",
        f"const unsigned int {ident}_arena_bytes = {arena_bytes};",
        "", f"#endif  // {guard}", "",
    ])
    header.write_text(text)
    return header


def micro_facts(listing: OpListing, arena: int, agreement: float, header: Path) -> dict[str, Any]:
    from edgefl.exporters.metadata import sha256_file

    return {"interpreter": "tflite-micro", "arena_bytes": arena, "arena_step_bytes": ARENA_STEP,
            "ops": sorted(listing.counts), "resolver": resolver_code(listing),
            "top1_agreement_with_litert": agreement, "c_header": header.name, "c_header_sha256": sha256_file(header)}
