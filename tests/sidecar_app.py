"""A phone app's view of an exported file: it knows the sidecar and nothing of edgefl.

It reads ``FILE.json``, turns raw values (8-bit pixels or raw features) into the model's input by
the sidecar's normalisation formula, layout, dtype and quantisation, calls ONNX Runtime by input
name or the LiteRT signature runner by signature key and input name, dequantises the output and
maps the argmax to the sidecar's labels. It deliberately imports nothing from edgefl, so a
sidecar that leaves out something an app needs makes this fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def load(model_file: Path) -> dict:
    return json.loads(Path(str(model_file) + ".json").read_text())


def prepare(meta: dict, raw: np.ndarray) -> np.ndarray:
    """Raw values -> the array the runtime takes. ``raw``: [N, H, W] or [N, H, W, C] images of
    values as the sidecar's ``normalisation.value`` describes, or [N, features]."""
    spec, norm = meta["inputs"][0], meta["normalisation"]
    x = raw.astype(np.float32)
    if x.ndim == 3:
        x = x[..., None]  # grayscale: one channel, channels last as a camera gives it
    mean, std = np.asarray(norm["mean"], np.float32), np.asarray(norm["std"], np.float32)
    x = (x - mean) / std  # per channel (images, channels last) or per feature
    if spec.get("layout") == "NCHW":
        x = np.transpose(x, (0, 3, 1, 2))
    if spec["dtype"] in ("int8", "uint8"):
        lo, hi = (-128, 127) if spec["dtype"] == "int8" else (0, 255)
        assert "round_half_away_from_zero" in spec["quantize"], spec["quantize"]  # the formula says how to round
        v = x / spec["scale"]
        x = np.clip(np.sign(v) * np.floor(np.abs(v) + 0.5) + spec["zero_point"], lo, hi)
    return x.astype(spec["dtype"])


def _batches(x: np.ndarray, batch: int | str):
    step = batch if isinstance(batch, int) else len(x)
    for start in range(0, len(x), step):
        part = x[start : start + step]
        got = len(part)
        if isinstance(batch, int) and got < batch:
            part = np.concatenate([part, np.repeat(part[-1:], batch - got, 0)])
        yield part, got


def predict(model_file: Path, raw: np.ndarray) -> list[str]:
    """The label the model gives each raw input."""
    meta = load(model_file)
    x = prepare(meta, raw)
    spec_in, spec_out = meta["inputs"][0], meta["outputs"][0]
    batch = spec_in["shape"][0]
    if meta["format"] == "onnx":
        import onnxruntime as ort

        session = ort.InferenceSession(str(model_file), providers=["CPUExecutionProvider"])
        call = lambda part: session.run([spec_out["name"]], {spec_in["name"]: part})[0]  # noqa: E731
    else:
        from ai_edge_litert.interpreter import Interpreter

        runner = Interpreter(model_path=str(model_file)).get_signature_runner(meta["signature_key"])
        call = lambda part: runner(**{spec_in["name"]: part})[spec_out["name"]]  # noqa: E731
    outs = []
    for part, got in _batches(x, batch):
        y = call(part)[:got].astype(np.float32)
        if spec_out["dtype"] in ("int8", "uint8"):
            y = (y - spec_out["zero_point"]) * spec_out["scale"]
        outs.append(y)
    return [meta["class_labels"][i] for i in np.concatenate(outs).argmax(1)]
