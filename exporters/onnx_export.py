"""ONNX export: torch's current (dynamo) exporter, checked by onnx.checker and ONNX Runtime.

Two float files per model: a fixed-shape one (``NAME.onnx``, batch ``batch``) because phone
execution providers (NNAPI, CoreML) run fixed shapes only, and a dynamic-batch one
(``NAME.dynamic.onnx``) for servers. Both are single self-contained files (no external data).
int8 is ONNX Runtime's static QDQ quantisation, per channel, after its pre-processing, calibrated
on real training samples.
"""

from __future__ import annotations

import logging
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edgefl.exporters.registry import ExportError  # defined with the registry (light); kept importable from here


def _names(kind: str) -> tuple[list[str], list[str]]:
    return (["input"], ["logits"]) if kind == "classifier" else (["z", "y_onehot"], ["sample"])


def export_onnx(module: torch.nn.Module, sample: tuple[torch.Tensor, ...], path: Path, kind: str, dynamic: bool) -> Path:
    """Write one ONNX file; ``dynamic`` makes the batch dimension symbolic."""
    inputs, outputs = _names(kind)
    kwargs: dict[str, Any] = {}
    if dynamic:
        batch = torch.export.Dim("batch", min=1, max=65536)
        kwargs["dynamic_shapes"] = tuple({0: batch} for _ in sample)
        if sample[0].shape[0] < 2:  # torch.export specialises a size-1 dimension
            sample = tuple(torch.cat([s, s]) for s in sample)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            logging.getLogger("torch.onnx").setLevel(logging.ERROR)
            program = torch.onnx.export(module, sample, dynamo=True, external_data=False, input_names=inputs,
                                        output_names=outputs, verbose=False, **kwargs)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExportError(f"torch.onnx could not export this model: {first}",
                          hint="an op without an ONNX lowering: replace it in the model, or export only TFLite") from None
    if program is None:
        raise ExportError("torch.onnx returned no program")
    program.save(str(path))
    return path


def check_model_file(path: Path) -> None:
    import onnx

    try:
        onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    except Exception as exc:
        raise ExportError(f"{path.name} fails onnx.checker (full check): {exc}") from None


class OnnxRunner:
    """An ONNX Runtime CPU session that takes and returns numpy arrays in the model's own order."""

    def __init__(self, path: Path, threads: int | None = None) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        if threads:
            opts.intra_op_num_threads = threads
            opts.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        self.inputs = [i.name for i in self.session.get_inputs()]
        shape = self.session.get_inputs()[0].shape
        self.fixed_batch = shape[0] if isinstance(shape[0], int) else None

    def io(self) -> dict[str, list[dict[str, Any]]]:
        """Names, shapes ("batch" for a symbolic dimension) and dtypes as ONNX Runtime reports them."""
        def entry(arg: Any) -> dict[str, Any]:
            dtype = {"tensor(float)": "float32", "tensor(int8)": "int8", "tensor(uint8)": "uint8"}.get(arg.type, arg.type)
            return {"name": arg.name, "shape": [d if isinstance(d, int) else "batch" for d in arg.shape], "dtype": dtype}

        return {"inputs": [entry(a) for a in self.session.get_inputs()], "outputs": [entry(a) for a in self.session.get_outputs()]}

    def __call__(self, *arrays: np.ndarray) -> np.ndarray:
        return self.session.run(None, dict(zip(self.inputs, arrays)))[0]


def first_compute_node(path: Path) -> str | None:
    """The name of the model's first Conv/Gemm/MatMul (the one int8 hurts most: it sees the raw input)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return next((n.name for n in graph.node if n.op_type in ("Conv", "Gemm", "MatMul")), None)


def quantize_int8(float_path: Path, out_path: Path, calibration: Iterator[tuple[np.ndarray, ...]], input_names: list[str],
                  exclude: list[str] | None = None) -> Path:
    """Static QDQ int8 (per-channel weights, per-tensor activations) calibrated on ``calibration``;
    the nodes in ``exclude`` stay float."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter(calibration)

        def get_next(self):
            batch = next(self.it, None)
            return None if batch is None else dict(zip(input_names, batch))

    with tempfile.TemporaryDirectory() as tmp:
        prepared = Path(tmp) / "prepared.onnx"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            logging.getLogger().setLevel(logging.ERROR)
            quant_pre_process(str(float_path), str(prepared), skip_symbolic_shape=True)
            quantize_static(str(prepared), str(out_path), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                            activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, nodes_to_exclude=exclude or [])
    return out_path


def mobile_usability(path: Path) -> dict[str, Any]:
    """ONNX Runtime's mobile-usability verdict (the check behind
    ``python -m onnxruntime.tools.check_onnx_model_mobile_usability``) as a record: for NNAPI and
    both CoreML formats, how many nodes the EP takes, in how many partitions, and its verdict."""
    from onnxruntime.tools.mobile_helpers import usability_checker as uc
    from onnxruntime.tools.onnx_model_utils import ModelProtoWithShapeInfo, optimize_model

    record: dict[str, Any] = {"tool": "onnxruntime.tools.check_onnx_model_mobile_usability"}
    with tempfile.TemporaryDirectory() as tmp:
        optimized = Path(tmp) / path.name
        optimize_model(path, optimized, use_external_initializers=True)
        model = ModelProtoWithShapeInfo(optimized.resolve()).model_with_shape_info
        dynamic_inputs, _ = uc.check_shapes(model.graph)
        record["dynamic_inputs"] = [i.name for i in dynamic_inputs] if dynamic_inputs else []
        checks = {
            "nnapi": lambda m: uc.check_nnapi_partitions(m, True),
            "coreml_neuralnetwork": lambda m: uc.check_coreml_partitions(m, True, "coreml_supported_neuralnetwork_ops.md"),
            "coreml_mlprogram": lambda m: uc.check_coreml_partitions(m, True, "coreml_supported_mlprogram_ops.md"),
        }
        for ep, check in checks.items():
            info = check(model)
            record[ep] = {"nodes": info.num_nodes, "supported_nodes": info.num_supported_nodes,
                          "partitions": info.num_partitions, "verdict": info.suitability().name,
                          "unsupported_ops": sorted(info.unsupported_ops)}
    record["usable_with"] = [ep for ep in checks if record[ep]["verdict"] != "NO"]
    record["usable"] = bool(record["usable_with"])  # with at least one of them: see usable_with
    return record


def embed_onnx_metadata(path: Path, props: dict[str, str], version: int, doc: str) -> None:
    """Describe the model inside the file: ``metadata_props`` (what ONNX Runtime's
    ``get_modelmeta().custom_metadata_map`` returns), ``model_version`` and ``doc_string``."""
    import onnx

    model = onnx.load(str(path))
    del model.metadata_props[:]
    for key, value in props.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    model.model_version = int(version)
    model.doc_string = doc
    onnx.save(model, str(path))
