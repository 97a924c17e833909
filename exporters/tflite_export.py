"""TFLite export with litert-torch, checked with the LiteRT interpreter.

litert-torch converts the PyTorch module directly (no TensorFlow). Its converter has no aarch64
wheel, so conversion is a server-side step; the interpreter (``ai-edge-litert``, or the old
``tflite_runtime`` on Pi images that only have that) runs anywhere.

Batch is static (``batch``): litert-torch cannot convert a dynamic batch through a reshape of the
batch dimension (flatten, ``view``), and the static file bakes that reshape too, so
``resize_tensor_input`` works only for models without one. :func:`resizable` tries it and the
metadata records the answer; for another batch size, export with ``--batch N``. ``channels_last`` wraps the model so image inputs (and
image outputs, for decoders) are NHWC, the layout phone delegates prefer, without transposes in
the app. int8 is PT2E static quantisation inside the converter (per-channel weights), calibrated
on real training samples; the resulting model takes and returns int8, so its metadata carries
the input and output scale and zero point.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from edgefl.exporters.registry import ExportError


def _litert_torch():
    try:
        import litert_torch
    except ImportError:
        raise ExportError("TFLite export needs litert-torch, which is not installed",
                          hint="pip install -e '.[export]' in the edgefl checkout on an x86-64 machine (the converter has no aarch64 wheel)") from None
    litert_torch.config.show_progress = False
    return litert_torch


@contextlib.contextmanager
def _quiet():
    """The converter logs every pass to stdout/stderr; keep the CLI's output readable."""
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        logging.getLogger("absl").setLevel(logging.ERROR)
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        yield


def channels_last_wrapper(module: torch.nn.Module, kind: str, sample: tuple[torch.Tensor, ...]) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """The module with NHWC image I/O, and the sample permuted to match."""
    litert_torch = _litert_torch()
    if kind == "classifier":
        if sample[0].dim() != 4:
            return module, sample  # nothing spatial to re-lay
        return litert_torch.to_channel_last_io(module, args=[0]), (sample[0].permute(0, 2, 3, 1).contiguous(),)
    return litert_torch.to_channel_last_io(module, outputs=[0]), sample


class _Named(nn.Module):
    """Gives the file's signature the same input and output names as the ONNX file."""

    def __init__(self, module: nn.Module, output: str) -> None:
        super().__init__()
        self.module, self.output = module, output


class _NamedClassifier(_Named):
    def forward(self, input: torch.Tensor) -> dict[str, torch.Tensor]:  # noqa: A002 (the tensor's name in the file)
        return {self.output: self.module(input)}


class _NamedDecoder(_Named):
    def forward(self, z: torch.Tensor, y_onehot: torch.Tensor) -> dict[str, torch.Tensor]:
        return {self.output: self.module(z, y_onehot)}


def io_names(kind: str) -> tuple[list[str], str]:
    """Input names and the output name, shared by the ONNX and TFLite files."""
    return (["input"], "logits") if kind == "classifier" else (["z", "y_onehot"], "sample")


def convert(module: torch.nn.Module, sample: tuple[torch.Tensor, ...], path: Path, kind: str = "classifier",
            calibration: Iterable[tuple[torch.Tensor, ...]] | None = None) -> Path:
    """Convert to ``path``: float, or integer-only int8 when ``calibration`` batches are given.

    The signature (``serving_default``) takes the inputs by the names of :func:`io_names` and
    returns the output under its name, as the ONNX file does."""
    litert_torch = _litert_torch()
    names, output = io_names(kind)
    named = (_NamedClassifier if kind == "classifier" else _NamedDecoder)(module.eval(), output).eval()
    kwargs = dict(zip(names, sample))
    try:
        with _quiet():
            if calibration is None:
                edge = litert_torch.convert(named, (), sample_kwargs=kwargs)
            else:
                from litert_torch.quantize import pt2e_quantizer
                from litert_torch.quantize.quant_config import QuantConfig
                from torchao.quantization.pt2e import quantize_pt2e

                quantizer = pt2e_quantizer.PT2EQuantizer().set_global(
                    pt2e_quantizer.get_symmetric_quantization_config(is_per_channel=True, is_dynamic=False))
                graph = torch.export.export(named, (), kwargs).module()
                graph = quantize_pt2e.prepare_pt2e(graph, quantizer)
                with torch.no_grad():
                    for batch in calibration:
                        graph(**dict(zip(names, batch)))
                graph = quantize_pt2e.convert_pt2e(graph, fold_quantize=False)
                edge = litert_torch.convert(graph, (), sample_kwargs=kwargs, quant_config=QuantConfig(pt2e_quantizer=quantizer))
            edge.export(str(path))
    except ExportError:
        raise
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExportError(f"litert-torch could not convert this model{' to int8' if calibration is not None else ''}: {first}",
                          hint="the converter's message names the op; change that layer, export float only (no --int8), "
                               "or export only ONNX (--format onnx)") from None
    return path


def _interpreter_class():
    try:
        from ai_edge_litert.interpreter import Interpreter

        return Interpreter, "ai-edge-litert"
    except ImportError:
        pass
    try:
        from tflite_runtime.interpreter import Interpreter  # old Pi images

        return Interpreter, "tflite-runtime"
    except ImportError:
        raise ExportError("checking a .tflite file needs the LiteRT interpreter",
                          hint="pip install ai-edge-litert (or tflite-runtime on Python <= 3.11 images)") from None


def resizable(path: Path, sample: tuple[np.ndarray, ...], input_order: list[str] | None = None) -> bool:
    """Whether the interpreter accepts a batch other than the file's (``resize_tensor_input``)."""
    runner = TFLiteRunner(path, input_order=input_order)
    try:
        runner(*(np.concatenate([a, a, a]) for a in sample))
        return True
    except (RuntimeError, ValueError):
        return False


def quantise_round(v: np.ndarray) -> np.ndarray:
    """Round half away from zero, as TFLite's own QUANTIZE kernel does (numpy rounds half to even)."""
    return np.sign(v) * np.floor(np.abs(v) + 0.5)


class TFLiteRunner:
    """The LiteRT interpreter over one file, called through the file's signature by input name
    (as an app does): quantises int8 inputs and dequantises int8 outputs with the scales in the
    file, so callers pass and get floats; :meth:`raw` passes and returns the file's own dtypes."""

    def __init__(self, path: Path, threads: int | None = None, input_order: list[str] | None = None) -> None:
        """``input_order``: the names positional arrays stand for (a signature lists its inputs
        sorted by name, which is not the model's order: a decoder takes z, then y_onehot)."""
        cls, self.runtime = _interpreter_class()
        self.interpreter = cls(model_path=str(path), num_threads=threads or 1)
        signatures = self.interpreter.get_signature_list()
        if not signatures:
            raise ExportError(f"{path.name} has no signature", hint="re-export it with edgefl export")
        self.signature_key = next(iter(signatures))
        self.input_names = list(signatures[self.signature_key]["inputs"])
        if input_order is not None:
            if sorted(input_order) != sorted(self.input_names):
                raise ExportError(f"{path.name}: its signature takes {self.input_names}, not {input_order}")
            self.input_names = list(input_order)
        self.output_names = list(signatures[self.signature_key]["outputs"])
        self.runner = self.interpreter.get_signature_runner(self.signature_key)
        self.inputs = self.runner.get_input_details()
        self.outputs = self.runner.get_output_details()

    def io(self) -> dict[str, list[dict[str, Any]]]:
        """What the runtime sees: signature names, tensor names, shapes, dtypes, quantisation."""
        def entry(name: str, d: dict) -> dict:
            scale, zero = d["quantization"]
            return {"name": name, "tensor": d["name"], "index": int(d["index"]), "shape": [int(v) for v in d["shape"]],
                    "dtype": np.dtype(d["dtype"]).name, "scale": float(scale), "zero_point": int(zero)}

        return {"inputs": [entry(n, self.inputs[n]) for n in self.input_names],
                "outputs": [entry(n, self.outputs[n]) for n in self.output_names]}

    def quantise(self, *arrays: np.ndarray) -> list[np.ndarray]:
        out = []
        for name, a in zip(self.input_names, arrays):
            d = self.inputs[name]
            if np.dtype(d["dtype"]) == np.int8:
                scale, zero = d["quantization"]
                a = np.clip(quantise_round(a / scale) + zero, -128, 127).astype(np.int8)
            out.append(np.ascontiguousarray(a, dtype=d["dtype"]))
        return out

    def raw(self, *arrays: np.ndarray) -> np.ndarray:
        return self.runner(**dict(zip(self.input_names, arrays)))[self.output_names[0]]

    def dequantise(self, y: np.ndarray) -> np.ndarray:
        d = self.outputs[self.output_names[0]]
        if np.dtype(d["dtype"]) == np.int8:
            scale, zero = d["quantization"]
            return (y.astype(np.float32) - zero) * scale
        return y

    def __call__(self, *arrays: np.ndarray) -> np.ndarray:
        return self.dequantise(self.raw(*self.quantise(*arrays)))
