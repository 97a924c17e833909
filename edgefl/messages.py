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
import struct
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from edgefl.errors import PayloadError

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

#: every message kind in use: kind -> its tensors (docs/PROTOCOL.md gives their dtypes and shapes)
MESSAGE_KINDS: dict[str, str] = {
    "weights": "parameter and buffer names -> values (FedIN adds pairs.s_in / pairs.s_out)",
    "class_logits": "logits [k, C] F32, classes [k] I64, counts [k] I64 (uplink); logits [C, C] F32, mask [C] BOOL (downlink)",
    "class_features": "weights plus knowledge.features / knowledge.logits / knowledge.classes / knowledge.counts",
    "decoder": "a CVAE's decoder.* parameters; meta: class_counts, latent",
    "head": "weight [C, E] and bias [C] of the shared head",
    "status": "none: a device that trained and shares nothing (local-only); meta: num_samples, train_loss, eval_accuracy",
    "evaluation": "none: a device's answer to an evaluate request; meta: num_samples, eval_accuracy",
}
#: kinds the runners themselves use, whatever the method (an answer to an ``evaluate`` request)
RUNNER_KINDS = ("evaluation",)


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
    try:
        header = json.loads(data[8 : 8 + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PayloadError(f"message header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise PayloadError("message header is not a JSON object")
    body_len = len(data) - 8 - header_len
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or "dtype" not in info or "data_offsets" not in info:
            raise PayloadError(f"tensor {name!r}: malformed header entry")
        if info["dtype"] not in ALLOWED_DTYPES:
            raise PayloadError(f"tensor {name!r}: dtype {info['dtype']} not allowed")
        start, end = info["data_offsets"]
        if not (0 <= start <= end <= body_len):
            raise PayloadError(f"tensor {name!r}: offsets {start}..{end} outside the {body_len}-byte body")
    return header


def decode(data: bytes, max_bytes: int = DEFAULT_MAX_BYTES) -> Message:
    """Parse bytes produced by :func:`encode`, refusing anything malformed or oversized."""
    if len(data) > max_bytes:
        raise PayloadError(f"message of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    header = _read_header(data)
    raw_meta = (header.get("__metadata__") or {}).get("edgefl")
    if raw_meta is None:
        raise PayloadError("not an edgefl message: safetensors metadata has no 'edgefl' entry")
    try:
        fields = json.loads(raw_meta)
    except json.JSONDecodeError as exc:
        raise PayloadError(f"message fields are not JSON: {exc}") from None
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
