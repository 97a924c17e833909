"""The wire envelope of a fleet: magic, version, a small JSON header and a binary body.

Layout (all integers little-endian)::

    offset 0   4 bytes   magic  b"EDFL"
    offset 4   1 byte    version (1)
    offset 5   4 bytes   header length H (at most MAX_HEADER_BYTES)
    offset 9   H bytes   header: one UTF-8 JSON object (see HEADER_FIELDS)
    offset 9+H           body: ``header["body"]["length"]`` bytes

The body of an ``upload``/``download`` is an edgefl message (safetensors: named tensors, never
pickle); a ``chunk`` carries a slice of such a body; ``ack``, ``nack``, ``round`` and
``presence`` have empty bodies. Everything a receiver needs to route, deduplicate and check a
message is in the header, so an MQTT 3.1.1 broker (no message properties) carries it unchanged.
docs/PROTOCOL.md is the normative description.
"""

from __future__ import annotations

import hashlib
import json
import struct
import uuid
from dataclasses import dataclass, field
from typing import Any

from edgefl.errors import PayloadError
from edgefl.safejson import loads

MAGIC = b"EDFL"
VERSION = 1
PREFIX = struct.Struct("<4sBI")  # magic, version, header length
MAX_HEADER_BYTES = 64 << 10

TYPES = ("upload", "download", "evaluate", "stage", "chunk", "ack", "nack", "round", "presence", "join", "task")
CODECS = ("safetensors", "none")

# field -> (type, required)
HEADER_FIELDS: dict[str, tuple[type | tuple[type, ...], bool]] = {
    "type": (str, True),
    "federation": (str, True),
    "round": (int, True),
    "sender": (str, True),
    "message_id": (str, True),
    "reply_to": ((str, type(None)), True),
    "model_version": (int, True),
    "codec": (str, True),
    "body": (dict, True),  # {"length": int, "sha256": hex}
    "tensors": (dict, False),  # safetensors bodies: name -> [dtype, shape], for cheap checks before decoding
    "chunk": (dict, False),  # chunks: upload_id, seq, count, total_length, total_sha256
    "status": (str, False),  # ack: accepted | duplicate | late
    "reason": (str, False),  # nack: why
    "missing": (list, False),  # nack of an incomplete upload: missing chunk numbers
    "info": (dict, False),  # round announcements, downloads, evaluate requests, joins and tasks: small JSON facts
    "to": (str, False),  # signed server messages: the device addressed, or "*" (edgefl.transport.signing)
    "sig": (str, False),  # signed server messages: "ed25519"; the 64-byte signature follows the body
}
SIGNATURE_BYTES = 64
MAX_ID_CHARS = 64
MIN_CHUNK_BYTES = 4096  # so a chunk count is bounded by the declared length (and a nack's missing list with it)


def new_id() -> str:
    return uuid.uuid4().hex


def tensor_manifest(tensors: dict) -> dict[str, list]:
    """``name -> [dtype, shape]`` of a message's tensors, in safetensors' dtype names (F32, I64...):
    what the ``tensors`` header field declares about a safetensors body (docs/PROTOCOL.md)."""
    from edgefl.messages import SAFETENSORS_DTYPES

    return {name: [SAFETENSORS_DTYPES[t.dtype], list(t.shape)] for name, t in tensors.items()}


@dataclass
class Envelope:
    type: str
    federation: str
    round: int
    sender: str
    body: bytes = b""
    message_id: str = field(default_factory=new_id)
    reply_to: str | None = None
    model_version: int = 0
    codec: str = "none"
    extra: dict[str, Any] = field(default_factory=dict)  # the optional header fields

    def header(self) -> dict[str, Any]:
        return {
            "type": self.type, "federation": self.federation, "round": self.round, "sender": self.sender,
            "message_id": self.message_id, "reply_to": self.reply_to, "model_version": self.model_version,
            "codec": self.codec, "body": {"length": len(self.body), "sha256": hashlib.sha256(self.body).hexdigest()},
            **self.extra,
        }


def pack(env: Envelope) -> bytes:
    header = json.dumps(env.header(), separators=(",", ":"), sort_keys=True).encode()
    if len(header) > MAX_HEADER_BYTES:
        raise PayloadError(f"envelope header of {len(header)} bytes exceeds {MAX_HEADER_BYTES}")
    return PREFIX.pack(MAGIC, VERSION, len(header)) + header + env.body


def unpack(data: bytes, max_bytes: int) -> Envelope:
    """Parse and check an envelope, cheapest checks first: size, magic and version, header
    schema, body length, body SHA-256. Raises :class:`PayloadError` naming what is wrong."""
    if len(data) > max_bytes:
        raise PayloadError(f"message of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    if len(data) < PREFIX.size:
        raise PayloadError(f"truncated: {len(data)} bytes, an envelope starts with {PREFIX.size}")
    magic, version, header_len = PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise PayloadError(f"bad magic {magic!r} (not an edgefl envelope)")
    if version != VERSION:
        raise PayloadError(f"envelope version {version} not supported (this side speaks {VERSION})")
    if header_len > MAX_HEADER_BYTES:
        raise PayloadError(f"header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte cap")
    if PREFIX.size + header_len > len(data):
        raise PayloadError(f"truncated or corrupt: header length {header_len} does not fit the {len(data)}-byte message")
    header = loads(bytes(data[PREFIX.size : PREFIX.size + header_len]), "header")
    problem = header_problem(header)
    if problem:
        # the header parsed: a refusal answers its id whenever one is usable (section 8)
        raise PayloadError(problem, message_id=answerable_id(header), round_no=answerable_round(header))
    # a signed envelope carries its signature after the body (edgefl.transport.signing checks it)
    end = len(data) - (SIGNATURE_BYTES if "sig" in header else 0)
    body = data[PREFIX.size + header_len : max(end, PREFIX.size + header_len)]
    if len(body) != header["body"]["length"] or end < PREFIX.size + header_len:
        raise PayloadError(f"body is {len(body)} bytes, the header says {header['body']['length']}",
                           message_id=answerable_id(header), round_no=header["round"])
    if hashlib.sha256(body).hexdigest() != header["body"]["sha256"]:
        raise PayloadError("body SHA-256 does not match the header", message_id=answerable_id(header), round_no=header["round"])
    extra = {k: header[k] for k in header if k not in ("type", "federation", "round", "sender", "message_id",
                                                         "reply_to", "model_version", "codec", "body")}
    return Envelope(header["type"], header["federation"], header["round"], header["sender"], bytes(body),
                    header["message_id"], header["reply_to"], header["model_version"], header["codec"], extra)


def answerable_id(header: Any) -> str | None:
    """The id a refusal of this parsed envelope header answers: a chunk's upload id, since the
    device tracks the upload, not its chunks (docs/PROTOCOL.md section 5), else its message id.
    The header may break other rules (an unknown field, a wrong type): its id is still answered
    when it is a usable id (a string of 1-64 characters); None when there is none."""

    def usable(value: Any) -> str | None:
        return value if isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS else None

    if not isinstance(header, dict):
        return None
    chunk = header.get("chunk")
    if header.get("type") == "chunk" and isinstance(chunk, dict) and usable(chunk.get("upload_id")):
        return chunk["upload_id"]
    return usable(header.get("message_id"))


def answerable_round(header: Any) -> int | None:
    """The round a refusal of this parsed header names: its own when valid (section 8)."""
    value = header.get("round") if isinstance(header, dict) else None
    return value if type(value) is int and value >= 0 else None


def header_problem(header: Any) -> str | None:
    if not isinstance(header, dict):
        return "header is not a JSON object"
    unknown = sorted(set(header) - set(HEADER_FIELDS))
    if unknown:
        return f"unknown header fields {unknown[:3]}"
    for name, (typ, required) in HEADER_FIELDS.items():
        if name not in header:
            if required:
                return f"header field {name!r} missing"
            continue
        value = header[name]
        if not isinstance(value, typ) or (isinstance(value, bool) and typ is int):
            return f"header field {name!r} has the wrong type"
    if "sig" in header and header["sig"] != "ed25519":
        return f"unknown signature scheme {header['sig'][:16]!r} (ed25519 only)"
    if "to" in header and not (0 < len(header["to"]) <= MAX_ID_CHARS):
        return f"header field 'to' must be 1-{MAX_ID_CHARS} characters"
    if header["type"] not in TYPES:
        return f"unknown message type {header['type']!r}"
    if header["codec"] not in CODECS:
        return f"unknown codec {header['codec']!r}"
    for name in ("sender", "message_id", "federation"):
        if not (0 < len(header[name]) <= MAX_ID_CHARS):
            return f"header field {name!r} must be 1-{MAX_ID_CHARS} characters"
    if header["reply_to"] is not None and not (0 < len(header["reply_to"]) <= MAX_ID_CHARS):
        return f"header field 'reply_to' must be null or 1-{MAX_ID_CHARS} characters"
    if "missing" in header and not all(type(i) is int and i >= 0 for i in header["missing"]):
        return "header field 'missing' must list non-negative chunk numbers"
    body = header["body"]
    if not (set(body) == {"length", "sha256"} and isinstance(body["length"], int) and not isinstance(body["length"], bool)
            and body["length"] >= 0 and isinstance(body["sha256"], str) and len(body["sha256"]) == 64
            and all(ch in "0123456789abcdef" for ch in body["sha256"])):
        return "header field 'body' must be {length: int >= 0, sha256: 64 hex digits}"
    if header["round"] < 0 or header["model_version"] < 0:
        return "round and model_version must be >= 0"
    if header["type"] == "chunk":
        c = header.get("chunk")
        if not isinstance(c, dict):
            return "a chunk needs its 'chunk' header"
        for key in ("seq", "count", "total_length"):
            if not isinstance(c.get(key), int) or isinstance(c.get(key), bool) or c[key] < 0:
                return f"chunk field {key!r} must be a non-negative integer"
        if not isinstance(c.get("upload_id"), str) or not (0 < len(c["upload_id"]) <= MAX_ID_CHARS):
            return "chunk field 'upload_id' must be 1-64 characters"
        if not isinstance(c.get("total_sha256"), str) or len(c["total_sha256"]) != 64 \
                or not all(ch in "0123456789abcdef" for ch in c["total_sha256"]):
            return "chunk field 'total_sha256' must be 64 hex digits"
        if not (c["count"] >= 1 and c["seq"] < c["count"]):
            return f"chunk {c['seq']} of {c['count']} is out of range"
        if c["count"] > max(1, -(-c["total_length"] // MIN_CHUNK_BYTES)):
            return (f"{c['count']} chunks for {c['total_length']} bytes: chunks other than the last carry at least "
                    f"{MIN_CHUNK_BYTES} bytes")
        if header["body"]["length"] > c["total_length"]:
            return "a chunk's body is larger than the whole upload it belongs to"
    return None
