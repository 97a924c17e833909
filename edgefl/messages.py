"""Typed messages of named tensors: the only thing a client half and a server half exchange.

Every method fits the same record: a ``kind`` naming the payload, the round, the sender, a
dict of named tensors and a small JSON-able ``meta`` dict (sample counts, class counts, the
architecture...). :data:`MESSAGE_KINDS` lists the kinds with their tensors; which method
uploads and downloads which is declared on its :class:`~edgefl.methods.MethodSpec`
(``uploads``, ``downloads``), and a test checks that the two agree. A message may combine
several (Felo sends weights, features *and* logits): tensor names are namespaced by the method,
and ``kind`` names the primary content.

Serialisation is safetensors: an 8-byte header length, a JSON header and raw little-endian
tensor bytes. The message's own fields travel as one JSON string inside the safetensors
``__metadata__``. Nothing is ever unpickled, and decoding refuses oversized headers and bodies
before it allocates anything.
"""

from __future__ import annotations

import json
import math
import struct
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from edgefl.errors import PayloadError
from edgefl.safejson import loads

#: Format tag stored in the metadata so foreign safetensors files are not mistaken for messages.
FORMAT = "edgefl-message/1"
#: Largest JSON header accepted (the header lists tensor names, dtypes and offsets).
MAX_HEADER_BYTES = 1 << 20
#: Largest encoded message accepted by default (weights of the biggest zoo models fit).
DEFAULT_MAX_BYTES = 512 << 20

#: the tensor types a message may carry, by their safetensors names (F32, I64...)
SAFETENSORS_DTYPES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64",
                      torch.int8: "I8", torch.uint8: "U8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64",
                      torch.bool: "BOOL"}
ALLOWED_DTYPES = set(SAFETENSORS_DTYPES.values())
DTYPE_BYTES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8, "I8": 1, "U8": 1, "I16": 2, "I32": 4, "I64": 8, "BOOL": 1}
MAX_TENSORS = 4096  # the deepest zoo model has a few hundred; a header naming more is hostile
MAX_RANK = 8

#: every message kind in use: kind -> its tensors (docs/PROTOCOL.md gives their dtypes and shapes)
MESSAGE_KINDS: dict[str, str] = {
    "weights": "parameter and buffer names -> values (FedIN adds pairs.s_in / pairs.s_out)",
    "class_logits": "logits [k, C] F32, classes [k] I64, counts [k] I64 (uplink); logits [C, C] F32, mask [C] BOOL (downlink)",
    "class_features": "weights plus class.features / class.logits / class.classes / class.counts (uplink); "
                      "class.features / class.logits / class.mask (downlink)",
    "decoder": "a CVAE's decoder.* parameters; meta: class_counts, latent",
    "head": "weight [C, E] and bias [C] of the shared head",
    "status": "none: a device that trained and shares nothing (local-only); meta: num_samples, train_loss, eval_accuracy",
    "evaluation": "none: a device's answer to an evaluate request; meta: num_samples, eval_accuracy",
    "stage": "what the stage defines (its request and reply are the stage owner's: a filter or the method); meta: stage",
}
#: kinds the runners themselves use, whatever the method (an answer to an ``evaluate`` request or to a stage)
RUNNER_KINDS = ("evaluation", "stage")


@dataclass
class Message:
    """One payload between a client half and a server half."""

    kind: str
    round: int
    sender: str
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    message_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def num_samples(self) -> int:
        return int(self.meta.get("num_samples", 0))

    def payload_numbers(self) -> int:
        """How many scalars the tensors carry (the papers count communication this way)."""
        return sum(t.numel() for t in self.tensors.values())


def encode(message: Message) -> bytes:
    """Serialise a message to bytes (safetensors; no pickle)."""
    header = {
        "format": FORMAT,
        "kind": message.kind,
        "round": int(message.round),
        "sender": str(message.sender),
        "message_id": message.message_id,
        "meta": message.meta,
    }
    tensors = {name: t.detach().contiguous().cpu() for name, t in message.tensors.items()}
    return st_save(tensors, metadata={"edgefl": json.dumps(header, sort_keys=True)})


def _read_header(data: bytes) -> dict[str, Any]:
    if len(data) < 8:
        raise PayloadError(f"message truncated: {len(data)} bytes, need at least 8")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > MAX_HEADER_BYTES:
        raise PayloadError(f"message header claims {header_len} bytes (limit {MAX_HEADER_BYTES})")
    if 8 + header_len > len(data):
        raise PayloadError(f"message truncated: header needs {header_len} bytes, {len(data) - 8} present")
    header = loads(bytes(data[8 : 8 + header_len]), "message header")
    if not isinstance(header, dict):
        raise PayloadError("message header is not a JSON object")
    if len(header) > MAX_TENSORS + 1:
        raise PayloadError(f"message holds {len(header) - 1} tensors (at most {MAX_TENSORS})")
    body_len = len(data) - 8 - header_len
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise PayloadError("safetensors __metadata__ must map names to strings")
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise PayloadError(f"tensor {name[:64]!r}: a header entry is {{dtype, shape, data_offsets}}")
        if not isinstance(info["dtype"], str) or info["dtype"] not in ALLOWED_DTYPES:
            raise PayloadError(f"tensor {name[:64]!r}: dtype {str(info['dtype'])[:16]} not allowed")
        shape, offsets = info["shape"], info["data_offsets"]
        if not (isinstance(shape, list) and len(shape) <= MAX_RANK and all(type(d) is int and d >= 0 for d in shape)):
            raise PayloadError(f"tensor {name[:64]!r}: shape must be a list of at most {MAX_RANK} non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise PayloadError(f"tensor {name[:64]!r}: data_offsets must be [start, end] integers")
        start, end = offsets
        if not (0 <= start <= end <= body_len):
            raise PayloadError(f"tensor {name[:64]!r}: offsets {start}..{end} outside the {body_len}-byte body")
        if math.prod(shape) * DTYPE_BYTES[info["dtype"]] != end - start:
            raise PayloadError(f"tensor {name[:64]!r}: shape {shape} and dtype {info['dtype']} need "
                               f"{math.prod(shape) * DTYPE_BYTES[info['dtype']]} bytes, its offsets give {end - start}")
    return header


def decode(data: bytes, max_bytes: int = DEFAULT_MAX_BYTES) -> Message:
    """Parse bytes produced by :func:`encode`, refusing anything malformed or oversized."""
    if len(data) > max_bytes:
        raise PayloadError(f"message of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    header = _read_header(data)
    raw_meta = (header.get("__metadata__") or {}).get("edgefl")
    if raw_meta is None:
        raise PayloadError("not an edgefl message: safetensors metadata has no 'edgefl' entry")
    fields = loads(raw_meta, "message fields")
    if not isinstance(fields, dict) or fields.get("format") != FORMAT:
        raise PayloadError(f"unsupported message format {fields.get('format') if isinstance(fields, dict) else fields!r}")
    for key, typ in (("kind", str), ("round", int), ("sender", str), ("message_id", str), ("meta", dict)):
        if not isinstance(fields.get(key), typ):
            raise PayloadError(f"message field {key!r} missing or not {typ.__name__}")
    try:
        tensors = st_load(bytes(data))
    except Exception as exc:  # safetensors raises its own error type for bad bodies
        raise PayloadError(f"message body does not decode: {exc}") from None
    return Message(
        kind=fields["kind"],
        round=fields["round"],
        sender=fields["sender"],
        tensors=tensors,
        meta=fields["meta"],
        message_id=fields["message_id"],
    )
