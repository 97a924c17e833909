"""What is inside a .tflite file: its operators and tensor types, and its embedded metadata.

The op listing reads the flatbuffer itself (LiteRT's own schema bindings, ``ai_edge_litert``), not
the interpreter, whose XNNPACK delegate hides the ops it takes. It decides whether an int8 file is
integer-only (no float32 tensor anywhere) and which kernels a TFLite Micro resolver must register.

The metadata is the standard TFLite model metadata (``TFLITE_METADATA``, schema
``metadata_schema.fbs``): name, description, version, the input's image or feature properties and
normalisation, the output's label file (packed into the model file as a zip, as the standard
says). It is built with the schema's generated bindings as maintained in MediaPipe
(``mediapipe.tasks.metadata``), the successor of the archived tflite-support: MediaPipe 1.2.2's
high-level writers import a binary module its wheel does not ship, so the record is packed here
with the generated classes and read back the same way.
"""

from __future__ import annotations

import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgefl.exporters.registry import ExportError

METADATA_NAME = "TFLITE_METADATA"
METADATA_IDENTIFIER = b"M001"
LABEL_FILE = "labels.txt"


def _schema():
    try:
        from ai_edge_litert import schema_py_generated as schema
        from ai_edge_litert.tools import flatbuffer_utils
    except ImportError:
        raise ExportError("reading a .tflite file's contents needs ai-edge-litert", hint="pip install -e '.[export]' in the edgefl checkout") from None
    return schema, flatbuffer_utils


def _names(cls: type) -> dict[int, str]:
    return {v: k for k, v in vars(cls).items() if not k.startswith("_") and isinstance(v, int)}


@dataclass
class OpListing:
    ops: list[dict[str, Any]]  # one per operator, in execution order: op, input and output dtypes
    counts: dict[str, int]
    float_ops: list[str]  # ops that read or write a float32 tensor

    @property
    def integer_only(self) -> bool:
        return not self.float_ops

    def to_dict(self) -> dict[str, Any]:
        return {"counts": self.counts, "integer_only": self.integer_only, "float_ops": self.float_ops,
                "ops": self.ops}


def list_ops(path: Path) -> OpListing:
    """Every operator of the file's main subgraph with the dtypes it reads and writes."""
    schema, fb = _schema()
    model = fb.read_model(str(path))
    op_names, type_names = _names(schema.BuiltinOperator), _names(schema.TensorType)
    graph = model.subgraphs[0]

    def dtype(i: int) -> str:
        return type_names.get(graph.tensors[i].type, "?").lower()

    ops, floats = [], []
    for op in graph.operators:
        name = op_names.get(fb.get_builtin_code_from_operator_code(model.operatorCodes[op.opcodeIndex]), "CUSTOM")
        ins = [dtype(i) for i in (op.inputs if op.inputs is not None else []) if i >= 0]
        outs = [dtype(i) for i in (op.outputs if op.outputs is not None else []) if i >= 0]
        ops.append({"op": name, "inputs": ins, "outputs": outs})
        if "float32" in ins + outs:
            floats.append(name)
    return OpListing(ops, dict(Counter(o["op"] for o in ops)), floats)


def embed_metadata(path: Path, *, name: str, description: str, version: str, inputs: list[dict[str, Any]],
                   outputs: list[dict[str, Any]], labels: list[str] | None) -> None:
    """Write the standard TFLite metadata (and the label file) into ``path``.

    ``inputs``/``outputs``: ``name``, ``description``, ``kind`` ("image" with ``channels``, or
    "feature"), optional ``mean``/``std`` (normalised = (value - mean) / std) and ``min``/``max``.
    """
    import flatbuffers
    from mediapipe.tasks.metadata import metadata_schema_py_generated as md

    def tensor(entry: dict[str, Any], with_labels: bool) -> Any:
        t = md.TensorMetadataT()
        t.name, t.description = entry["name"], entry.get("description", "")
        t.content = md.ContentT()
        if entry.get("kind") == "image":
            props = md.ImagePropertiesT()
            props.colorSpace = md.ColorSpaceType.GRAYSCALE if entry.get("channels", 1) == 1 else md.ColorSpaceType.RGB
            t.content.contentPropertiesType, t.content.contentProperties = md.ContentProperties.ImageProperties, props
        else:
            t.content.contentPropertiesType = md.ContentProperties.FeatureProperties
            t.content.contentProperties = md.FeaturePropertiesT()
        if "mean" in entry and "std" in entry:
            unit = md.ProcessUnitT()
            unit.optionsType = md.ProcessUnitOptions.NormalizationOptions
            unit.options = md.NormalizationOptionsT()
            unit.options.mean, unit.options.std = [float(v) for v in entry["mean"]], [float(v) for v in entry["std"]]
            t.processUnits = [unit]
        if "min" in entry and "max" in entry:
            t.stats = md.StatsT()
            t.stats.min, t.stats.max = [float(entry["min"])], [float(entry["max"])]
        if with_labels and labels:
            f = md.AssociatedFileT()
            f.name, f.description, f.type = LABEL_FILE, "class names, one per line, in output order", md.AssociatedFileType.TENSOR_AXIS_LABELS
            t.associatedFiles = [f]
        return t

    meta = md.ModelMetadataT()
    meta.name, meta.description, meta.version, meta.author = name, description, version, "edgefl"
    meta.minParserVersion = "1.0.0"
    graph = md.SubGraphMetadataT()
    graph.inputTensorMetadata = [tensor(e, False) for e in inputs]
    graph.outputTensorMetadata = [tensor(e, i == 0) for i, e in enumerate(outputs)]
    meta.subgraphMetadata = [graph]
    builder = flatbuffers.Builder(0)
    builder.Finish(meta.Pack(builder), METADATA_IDENTIFIER)
    blob = bytes(builder.Output())

    schema, fb = _schema()
    model = fb.read_model(str(path))
    model.metadata = [m for m in (model.metadata or []) if m.name not in (METADATA_NAME, METADATA_NAME.encode())]
    buf = schema.BufferT()
    buf.data = list(blob)
    model.buffers.append(buf)
    entry = schema.MetadataT()
    entry.name, entry.buffer = METADATA_NAME, len(model.buffers) - 1
    model.metadata.append(entry)
    fb.write_model(model, str(path))
    if labels:
        with zipfile.ZipFile(path, "a") as packed:  # the standard's "associated files": a zip appended to the model
            packed.writestr(LABEL_FILE, "\n".join(labels) + "\n")


def read_metadata(path: Path) -> dict[str, Any] | None:
    """The file's TFLite metadata as a dict (None when it has none), labels included."""
    from mediapipe.tasks.metadata import metadata_schema_py_generated as md

    _, fb = _schema()
    model = fb.read_model(str(path))
    entry = next((m for m in (model.metadata or []) if m.name in (METADATA_NAME, METADATA_NAME.encode())), None)
    if entry is None:
        return None
    blob = bytes(bytearray(model.buffers[entry.buffer].data))
    if not md.ModelMetadata.ModelMetadataBufferHasIdentifier(blob, 0):
        raise ExportError(f"{path.name}: its {METADATA_NAME} entry is not TFLite model metadata")
    meta = md.ModelMetadataT.InitFromObj(md.ModelMetadata.GetRootAsModelMetadata(blob, 0))

    def text(v: Any) -> str | None:
        return v.decode() if isinstance(v, bytes) else v

    def tensor(t: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"name": text(t.name), "description": text(t.description)}
        if t.content is not None:
            out["content"] = {md.ContentProperties.ImageProperties: "image", md.ContentProperties.FeatureProperties: "feature"}.get(
                t.content.contentPropertiesType, "other")
        for unit in t.processUnits or []:
            if unit.optionsType == md.ProcessUnitOptions.NormalizationOptions:
                out["mean"], out["std"] = [float(v) for v in unit.options.mean], [float(v) for v in unit.options.std]
        if t.stats is not None:
            out["min"] = [] if t.stats.min is None else [float(v) for v in t.stats.min]
            out["max"] = [] if t.stats.max is None else [float(v) for v in t.stats.max]
        out["associated_files"] = [text(f.name) for f in t.associatedFiles or []]
        return out

    graph = meta.subgraphMetadata[0]
    labels = None
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as packed:
            if LABEL_FILE in packed.namelist():
                labels = packed.read(LABEL_FILE).decode().splitlines()
    return {"name": text(meta.name), "description": text(meta.description), "version": text(meta.version),
            "author": text(meta.author), "inputs": [tensor(t) for t in graph.inputTensorMetadata or []],
            "outputs": [tensor(t) for t in graph.outputTensorMetadata or []], "labels": labels}
