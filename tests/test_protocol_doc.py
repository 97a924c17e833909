"""docs/PROTOCOL.md, kept honest: its worked examples are generated here, byte for byte.

Every ``<!-- example: NAME -->`` marker in the doc is followed by a fenced block that must equal
what :data:`EXAMPLES` builds with the real envelope and message code (fixed ids, fixed values), so
the hex cannot drift from the implementation. ``EDGEFL_WRITE_DOCS=1 pytest
tests/test_protocol_doc.py`` rewrites the blocks instead of comparing them. The examples are
also checked the way a receiver reads them (unpack, decode, reassembly), and the doc's tables
are compared with the registries they describe: message kinds, what each method uploads and
downloads, the envelope's header fields, and docs/config.md's ``[network]`` section with
:class:`edgefl.config.NetworkSettings`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import tomllib
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import numpy as np

import pytest
import torch

from edgefl.messages import MESSAGE_KINDS, Message, decode, encode
from edgefl.transport.chunks import Reassembler, split
from edgefl.transport.envelope import HEADER_FIELDS, Envelope, header_problem, pack, tensor_manifest, unpack

DOCS = Path(__file__).resolve().parent.parent / "docs"
PROTOCOL = DOCS / "PROTOCOL.md"
CONFIG = DOCS / "config.md"
WRITE = os.environ.get("EDGEFL_WRITE_DOCS") == "1"

FED = "demo"
DEVICE = "client-0"
BASE = f"edgefl/v1/{FED}"
UP, DOWN, ROUND = f"{BASE}/dev/{DEVICE}/up", f"{BASE}/dev/{DEVICE}/down", f"{BASE}/round"
DEADLINE_UNIX = 1767225720.0  # 2026-01-01 00:02:00 UTC


def ident(n: int) -> str:
    """A fixed message id (real ones are 32 random hex digits: uuid4().hex)."""
    return f"{n:032x}"


# --- rendering ------------------------------------------------------------------------------------
def hexdump(data: bytes, width: int = 32) -> list[str]:
    return [f"{i:04x}  " + " ".join(f"{b:02x}" for b in data[i : i + width]) for i in range(0, len(data), width)]


def spaced(data: bytes) -> str:
    return " ".join(f"{b:02x}" for b in data)


def pretty(obj: dict, indent: str = "  ", sort: bool = True) -> list[str]:
    """A JSON object one top-level key a line (values compact), for reading; the wire form is in the hex."""
    keys = sorted(obj) if sort else list(obj)
    lines = [indent + "{"]
    for i, key in enumerate(keys):
        comma = "," if i < len(keys) - 1 else ""
        lines.append(f"{indent}  {json.dumps(key)}: {json.dumps(obj[key], sort_keys=sort, separators=(', ', ': '))}{comma}")
    return [*lines, indent + "}"]


def safetensors_lines(body: bytes, at: int) -> list[str]:
    """The parts of a safetensors body that starts at payload offset ``at``."""
    (n,) = struct.unpack_from("<Q", body)
    text = body[8 : 8 + n].decode()
    pad = len(text) - len(text.rstrip(" "))
    header = json.loads(text)
    data_at = at + 8 + n
    lines = [
        f"  {at:<6}{8:<6}header length N   {spaced(body[:8])}  = {n} (u64 little-endian)",
        f"  {at + 8:<6}{n:<6}header JSON       " + (f"(ends in {pad} spaces: padded to a multiple of 8)" if pad else "(no padding)"),
        f"  {data_at:<6}{len(body) - 8 - n:<6}tensor data",
        "  header JSON (key order as written; a reader must not depend on it):",
        *pretty({k: ({"edgefl": "<a JSON string, decoded below>"} if k == "__metadata__" else v) for k, v in header.items()},
                "    ", sort=False),
        '  __metadata__["edgefl"], a JSON string, decoded:',
        *pretty(json.loads(header["__metadata__"]["edgefl"]), "    "),
    ]
    message = decode(body)
    if message.tensors:
        lines.append("  tensors (offsets relative to the tensor data; little-endian values):")
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            values = message.tensors[name].tolist()
            lines.append(f"    {name:<12}{info['dtype']:<5}{json.dumps(info['shape']):<8}bytes {start}..{end} "
                         f"(payload {data_at + start}..{data_at + end}) = {json.dumps(values)}")
    else:
        lines.append("  tensors: none (the header holds only __metadata__)")
    return lines


def envelope_text(title: str, data: bytes, note: str = "") -> str:
    magic, version, hlen = struct.unpack_from("<4sBI", data)
    header = json.loads(data[9 : 9 + hlen])
    body = data[9 + hlen :]
    lines = [f"{title}: {len(data)} bytes", *([note] if note else []), "",
             "offset size  field",
             f"0     4     magic             {spaced(data[:4])}  = {magic.decode()!r}",
             f"4     1     version           {spaced(data[4:5])}  = {version}",
             f"5     4     header length H   {spaced(data[5:9])}  = {hlen} (u32 little-endian)",
             f"9     {hlen:<6}header JSON       UTF-8, compact, keys sorted (shown below one key a line)",
             f"{9 + hlen:<6}{len(body):<6}body              " + ("empty" if not body else f"codec {header['codec']!r}"),
             "", "header JSON:", *pretty(header)]
    if body and header["codec"] == "safetensors":
        lines += ["", "body, a safetensors file (offsets are the payload's):", *safetensors_lines(body, 9 + hlen)]
    elif body and header["type"] == "chunk":
        c = header["chunk"]
        lines += ["", f"body: bytes {9 + hlen}.. of this payload are chunk {c['seq']} of {c['count']}: a slice of the packed "
                      "inner envelope (the slices joined in seq order are the whole upload)"]
    return "\n".join([*lines, "", "hex:", *hexdump(data)])


# --- the examples -------------------------------------------------------------------------------------
def _upload(message: Message, model_version: int) -> bytes:
    """What a device publishes: the message in an upload envelope whose id is the message's."""
    return pack(Envelope("upload", FED, message.round, message.sender, encode(message), message.message_id,
                         model_version=model_version, codec="safetensors", extra={"tensors": tensor_manifest(message.tensors)}))


def status_upload() -> bytes:
    meta = {"num_samples": 386, "arch": "mlp", "train_loss": 0.5, "eval_accuracy": 0.875}
    return _upload(Message("status", 1, DEVICE, {}, meta, message_id=ident(0x101)), 1)


def class_logits_upload() -> bytes:
    tensors = {"logits": torch.tensor([[2.0, -1.0, 0.5], [0.25, 1.5, -0.75]]), "classes": torch.tensor([0, 2]),
               "counts": torch.tensor([120, 80])}
    meta = {"num_samples": 200, "arch": "mlp", "train_loss": 0.5}
    return _upload(Message("class_logits", 2, DEVICE, tensors, meta, message_id=ident(0x201)), 2)


def evaluation_upload() -> bytes:
    return _upload(Message("evaluation", 2, DEVICE, {}, {"num_samples": 121, "eval_accuracy": 0.75}, message_id=ident(0x301)), 2)


RUN = "5f3a9c0e12d47b86"  # a run id (info.run), as the server draws one


def round_announcement() -> bytes:
    info = {"selected": ["client-0", "client-1"], "selected_count": 2, "target": 2, "deadline_unix": DEADLINE_UNIX, "rounds": 3, "done": False,
            "run": RUN, "classes": 3}
    return pack(Envelope("round", FED, 1, "server", message_id=ident(0x1), model_version=1, extra={"info": info}))


def done_announcement() -> bytes:
    return pack(Envelope("round", FED, 3, "server", message_id=ident(0x4), model_version=3,
                         extra={"info": {"done": True, "rounds": 3, "run": RUN, "classes": 3}}))


def download_none() -> bytes:
    return pack(Envelope("download", FED, 1, "server", b"", ident(0x2), model_version=1, codec="none",
                         extra={"info": {"evaluate": True, "run": RUN}}))


def download_fedhe_first() -> bytes:
    # the server's message has its own id: only an upload's message and envelope share theirs
    message = Message("class_logits", 1, "server", {}, {"empty": True}, message_id=ident(0x1003))
    return pack(Envelope("download", FED, 1, "server", encode(message), ident(0x3), model_version=1, codec="safetensors",
                         extra={"info": {"run": RUN}}))


def download_fedhe() -> bytes:
    logits = torch.tensor([[2.0, -1.0, 0.5], [0.0, 0.0, 0.0], [0.25, 1.5, -0.75]])
    message = Message("class_logits", 2, "server", {"logits": logits, "mask": torch.tensor([True, False, True])},
                      message_id=ident(0x1005))
    return pack(Envelope("download", FED, 2, "server", encode(message), ident(0x5), model_version=2, codec="safetensors",
                         extra={"info": {"run": RUN}}))


def evaluate_request() -> bytes:
    weights = {"head.weight": torch.tensor([[0.5, -0.5], [1.0, 0.0], [-1.0, 0.25]]), "head.bias": torch.tensor([0.0, 0.125, -0.125])}
    # the global model as a download for round r + 1 would carry it, in an envelope of round r
    message = Message("weights", 3, "server", weights, {"arch": "mlp"}, message_id=ident(0x1006))
    return pack(Envelope("evaluate", FED, 2, "server", encode(message), ident(0x6), model_version=2, codec="safetensors",
                         extra={"info": {"run": RUN}}))


def ack() -> bytes:
    return pack(Envelope("ack", FED, 1, "server", message_id=ident(0x7), reply_to=ident(0x101), model_version=1,
                         extra={"status": "accepted"}))


def ack_late() -> bytes:
    return pack(Envelope("ack", FED, 1, "server", message_id=ident(0x8), reply_to=ident(0x102), model_version=1,
                         extra={"status": "late", "reason": "round 1 is closed; not used"}))


def nack() -> bytes:
    reason = "num_samples must be an integer in 1..1000000000, got 0"
    return pack(Envelope("nack", FED, 1, "server", message_id=ident(0x9), reply_to=ident(0x103), model_version=1,
                         extra={"reason": reason}))


def nack_unreadable() -> bytes:
    reason = "bad magic b'EDFX' (not an edgefl envelope)"
    return pack(Envelope("nack", FED, 1, "server", message_id=ident(0xA), reply_to=None, model_version=1, extra={"reason": reason}))


FIELD_RULE_REASON = "unknown header fields ['priority']"


def field_rule_upload() -> bytes:
    """An upload whose header parses but breaks a field rule (an unknown field)."""
    message = Message("status", 1, DEVICE, {}, {"num_samples": 386, "arch": "mlp", "train_loss": 0.5}, message_id=ident(0x104))
    return pack(Envelope("upload", FED, 1, DEVICE, encode(message), message.message_id, model_version=1, codec="safetensors",
                         extra={"tensors": {}, "priority": "high"}))


def nack_field_rule() -> bytes:
    return pack(Envelope("nack", FED, 1, "server", message_id=ident(0xC), reply_to=ident(0x104), model_version=1,
                         extra={"reason": FIELD_RULE_REASON}))


CHUNK_INNER_ID = ident(0x401)


def chunked_upload() -> tuple[bytes, list[bytes]]:
    """A weights upload a little over 4 KiB, split at 4 KiB: (packed inner envelope, its two chunks)."""
    weight = (torch.arange(10 * 85, dtype=torch.float32).reshape(10, 85) % 7 - 3) / 8
    message = Message("weights", 2, DEVICE, {"head.weight": weight, "head.bias": torch.zeros(10)},
                      {"num_samples": 386, "arch": "linear", "train_loss": 0.5}, message_id=CHUNK_INNER_ID)
    inner = Envelope("upload", FED, 2, DEVICE, encode(message), CHUNK_INNER_ID, model_version=2, codec="safetensors",
                     extra={"tensors": tensor_manifest(message.tensors)})
    ids = iter([ident(0x402), ident(0x403)])
    with mock.patch("edgefl.transport.chunks.new_id", lambda: next(ids)):
        chunks = split(inner, chunk_bytes=4096, threshold=1024)
    return pack(inner), chunks


def last_chunk() -> bytes:
    return chunked_upload()[1][-1]


def nack_missing() -> bytes:
    reason = f"partial upload {CHUNK_INNER_ID} went stale; resend the missing chunks"
    return pack(Envelope("nack", FED, 2, "server", message_id=ident(0xB), reply_to=CHUNK_INNER_ID, model_version=2,
                         extra={"reason": reason, "missing": [0]}))


def chunk_text() -> str:
    inner, chunks = chunked_upload()
    first = unpack(chunks[0], 1 << 20)
    inner_header = json.loads(inner[9 : 9 + struct.unpack_from("<I", inner, 5)[0]])
    note = (f"The packed inner upload is {len(inner)} bytes, more than the chunk threshold: at 4,096-byte slices it travels as\n"
            f"{len(chunks)} chunks. Its own header (the body it describes, {inner_header['body']['length']} bytes, is a "
            f"weights message)\n" + "\n".join(pretty(inner_header)) +
            f"\nChunk 0 ({len(chunks[0])} bytes) carries bytes 0..4095 of it; its header:\n" + "\n".join(pretty(first.header())) +
            "\nChunk 1, the last, in full:")
    return envelope_text(f"chunk 1 of 2 on {UP}", chunks[-1], note)


def presence_text() -> str:
    return "\n".join([f"presence on {BASE}/presence/{DEVICE} (retained, QoS 1; the same for presence/server):",
                      f"online   {spaced(b'online')}", f"offline  {spaced(b'offline')}   (also the last will)"])


SIGNING_SEED = bytes(range(32))  # the example key pair's private seed (never use a known seed for a real server)


def signed_ack() -> bytes:
    from edgefl.transport.signing import Signer

    return Signer.from_seed(SIGNING_SEED).sign(ack(), DEVICE)


def signed_text() -> str:
    from edgefl.transport.signing import Signer

    signer = Signer.from_seed(SIGNING_SEED)
    data = signed_ack()
    note = (f"The ack above, signed for {DEVICE}. Example key pair: private seed {SIGNING_SEED.hex()},\n"
            f"public key (what the device holds, server-signing.pub) {signer.public_hex()}.\n"
            "The signature is the last 64 bytes; it covers every byte before it (prefix, header, body).")
    text = envelope_text(f"signed ack on {DOWN}", data[:-64], note)
    return (text + f"\n{len(data) - 64:<6}64    Ed25519 signature\n" + "\n".join("      " + line[6:] for line in hexdump(data[-64:]))
            + f"\n(the whole message: {len(data)} bytes)")


def join_hello() -> bytes:
    return pack(Envelope("join", FED, 0, DEVICE, message_id=ident(0x301), extra={"info": {"stage": "hello"}}))


def task_message() -> bytes:
    from edgefl.config import NetworkSettings, TrainSettings
    from edgefl.task import Task, TaskData, TaskMethod, TaskModel

    task = Task(run="5e1f0c2a9b3d4e6f", federation=FED, device=DEVICE, seed=0, rounds=20, method=TaskMethod(name="fedhe", options={}),
                model=TaskModel(name="cnn-small", options={}, arch="cnn-small"),
                data=TaskData(kind="image", class_names=["T-shirt/top", "Trouser", "Pullover"], input_shape=[1, 28, 28], pixel_divisor=255.0,
                              validation_fraction=0.1),
                train=TrainSettings(batch_size=32, max_steps=30), network=NetworkSettings(federation=FED))
    return pack(Envelope("task", FED, 0, "server", message_id=ident(0x302), reply_to=ident(0x301),
                         extra={"info": {"run": task.run, "task": task.to_info()}}))


def join_ready() -> bytes:
    return pack(Envelope("join", FED, 0, DEVICE, message_id=ident(0x303),
                         extra={"info": {"stage": "ready", "run": "5e1f0c2a9b3d4e6f", "samples": 120, "validation": 12,
                                         "class_counts": [40, 80, 0], "source": "ImageFolder /var/lib/edgefl/data (2 classes, 120 images)"}}))


def join_decline() -> bytes:
    reason = ("/var/lib/edgefl/data holds class folders the federation's task does not know: 'unicorn' "
              "(the task's classes: T-shirt/top, Trouser, Pullover)")
    return pack(Envelope("join", FED, 0, DEVICE, message_id=ident(0x304),
                         extra={"info": {"stage": "decline", "run": "5e1f0c2a9b3d4e6f", "reason": reason}}))


def stage_request() -> bytes:
    message = Message("stage", 2, "server", {"nonce": torch.tensor([7], dtype=torch.int64)}, {"stage": "ping"}, message_id=ident(0x1401))
    return pack(Envelope("stage", FED, 2, "server", encode(message), ident(0x401), model_version=2, codec="safetensors",
                         extra={"info": {"run": RUN, "stage": "ping"}}))


def stage_upload() -> bytes:
    return _upload(Message("stage", 2, DEVICE, {"nonce": torch.tensor([7], dtype=torch.int64)}, {"stage": "ping"},
                           message_id=ident(0x402)), 2)


# --- secure aggregation (section 6.12): client-0 of a three-device group, k = 2 neighbours, t = 2 ----------
SECAGG_IDS = {"client-0": 1, "client-1": 2, "client-2": 3}


def _secagg_key(name: str):
    from edgefl.secagg.keys import KeyPair

    return KeyPair.from_private_bytes(hashlib.sha256(f"example key {name}".encode()).digest())


def _u8(data: bytes) -> torch.Tensor:
    return torch.tensor(list(data), dtype=torch.uint8)


def _stage_request(stage: str, n: int, message: Message) -> bytes:
    return pack(Envelope("stage", FED, 2, "server", encode(message), ident(n), model_version=2, codec="safetensors",
                         extra={"info": {"run": RUN, "stage": stage}}))


def secagg_keys_request() -> bytes:
    return _stage_request("secagg-keys", 0x501, Message("stage", 2, "server", {}, {"federation": FED}, message_id=ident(0x1501)))


def secagg_keys_reply() -> bytes:
    tensors = {"c_pk": _u8(_secagg_key("c0").public_bytes()), "s_pk": _u8(_secagg_key("s0").public_bytes())}
    return _upload(Message("stage", 2, DEVICE, tensors, {"stage": "secagg-keys"}, message_id=ident(0x502)), 2)


def secagg_shares_request() -> bytes:
    keys = {"c_pk": torch.stack([_u8(_secagg_key(f"c{i}").public_bytes()) for i in (1, 2)]),
            "s_pk": torch.stack([_u8(_secagg_key(f"s{i}").public_bytes()) for i in (1, 2)])}
    meta = {"neighbours": ["client-1", "client-2"], "x": SECAGG_IDS, "threshold": 2, "modulus_bits": 34}
    return _stage_request("secagg-shares", 0x503, Message("stage", 2, "server", keys, meta, message_id=ident(0x1503)))


def _sealed_bundles() -> list[bytes]:
    from edgefl.secagg import keys, shamir

    fixed = iter(range(7, 1000))
    draw = lambda n: next(fixed) % n  # noqa: E731  (a fixed polynomial: the example stays the same)
    s_shares = shamir.split(_secagg_key("s0").private_bytes(), 2, [2, 3], draw)
    b_shares = shamir.split(bytes(range(32)), 2, [2, 3], draw)
    context = f"edgefl-secagg|{FED}".encode()
    out = []
    for name, x in (("c1", 2), ("c2", 3)):
        key = keys.share_encryption_key(_secagg_key("c0").agree(_secagg_key(name).public_bytes()), 2, context)
        out.append(keys.seal_bundle(key, s_shares[x] + b_shares[x], round_no=2, sender=1, recipient=x, context=context,
                                    nonce=bytes(11) + bytes([x])))
    return out


def secagg_shares_reply() -> bytes:
    sealed = _sealed_bundles()
    tensors = {"sealed": torch.stack([_u8(b) for b in sealed])}
    return _upload(Message("stage", 2, DEVICE, tensors, {"to": ["client-1", "client-2"], "width": len(sealed[0]),
                                                          "stage": "secagg-shares"}, message_id=ident(0x504)), 2)


def secagg_download() -> bytes:
    sealed = _sealed_bundles()  # as if client-1 and client-2 had sealed these for client-0
    message = Message("class_logits", 2, "server", {"logits": torch.tensor([[1.5, -0.5], [-1.0, 2.0]]),
                                                     "mask": torch.tensor([True, True]),
                                                     ".secagg/shares": torch.stack([_u8(b) for b in sealed])},
                      {"filter.secagg": {"from": ["client-1", "client-2"], "widths": [len(b) for b in sealed]}},
                      message_id=ident(0x1505))
    return pack(Envelope("download", FED, 2, "server", encode(message), ident(0x505), model_version=2, codec="safetensors",
                         extra={"info": {"run": RUN}}))


def secagg_masked_upload() -> bytes:
    layout = {"kind": "class_logits", "entries": [["logits", [2, 2], "F32"], ["__present", [2], "F64"]]}
    from edgefl.filters.secagg import pack_values

    values = np.array([9_127_312_845, 3_518_004_112, 17_003_223_951, 611_839_204, 12_446_980_013, 5_099_871_326], dtype=np.uint64)
    masked = torch.from_numpy(pack_values(values, 34))  # 34-bit values: 5 little-endian bytes each
    meta = {"num_samples": 1, "train_loss": 0.5, "filter.secagg": {"layout": layout, "modulus_bits": 34}}
    return _upload(Message("class_logits", 2, DEVICE, {".secagg/masked": masked}, meta, message_id=ident(0x506)), 2)


def secagg_unmask_request() -> bytes:
    meta = {"survivors": ["client-1"], "dropped": ["client-2"]}
    return _stage_request("secagg-unmask", 0x507, Message("stage", 2, "server", {}, meta, message_id=ident(0x1507)))


def secagg_unmask_reply() -> bytes:
    from edgefl.secagg import shamir

    fixed = iter(range(11, 1000))
    draw = lambda n: next(fixed) % n  # noqa: E731
    b_share = shamir.split(bytes(range(1, 33)), 2, [1, 2], draw)[1]  # client-1's self-mask seed, the share client-0 holds
    s_share = shamir.split(_secagg_key("s2").private_bytes(), 2, [1, 3], draw)[1]  # client-2's mask key, client-0's share
    tensors = {"b_shares": _u8(b_share).unsqueeze(0), "s_shares": _u8(s_share).unsqueeze(0)}
    return _upload(Message("stage", 2, DEVICE, tensors, {"survivors": ["client-1"], "dropped": ["client-2"],
                                                          "stage": "secagg-unmask"}, message_id=ident(0x508)), 2)


EXAMPLES: dict[str, Callable[[], str]] = {
    "secagg-keys-request": lambda: envelope_text(f"stage on {DOWN}: round 2's secagg-keys", secagg_keys_request()),
    "secagg-keys-reply": lambda: envelope_text(f"upload on {UP}: client-0's two public keys", secagg_keys_reply()),
    "secagg-shares-request": lambda: envelope_text(f"stage on {DOWN}: secagg-shares, client-0's neighbours and their keys",
                                                   secagg_shares_request()),
    "secagg-shares-reply": lambda: envelope_text(f"upload on {UP}: client-0's sealed share bundles, one per neighbour",
                                                 secagg_shares_reply()),
    "secagg-download": lambda: envelope_text(f"download on {DOWN}: FedHe's round-2 download with the bundles sealed for client-0",
                                             secagg_download()),
    "secagg-masked-upload": lambda: envelope_text(f"upload on {UP}: client-0's masked FedHe upload (C = 2)", secagg_masked_upload()),
    "secagg-unmask-request": lambda: envelope_text(f"stage on {DOWN}: secagg-unmask (client-1 uploaded, client-2 dropped)",
                                                   secagg_unmask_request()),
    "secagg-unmask-reply": lambda: envelope_text(f"upload on {UP}: client-0's share of client-1's seed and of client-2's key",
                                                 secagg_unmask_reply()),
    "stage-request": lambda: envelope_text(f"stage on {DOWN}: round 2's stage 'ping' asks for an echo", stage_request()),
    "upload-stage": lambda: envelope_text(f"upload on {UP} answering it", stage_upload()),
    "signed-ack": signed_text,
    "join-hello": lambda: envelope_text(f"join on {UP}: a device that holds its own data asks for its task", join_hello()),
    "task": lambda: envelope_text(f"task on {DOWN} answering it (a three-class task, for brevity)", task_message()),
    "join-ready": lambda: envelope_text(f"join on {UP}: the device read its data against the task", join_ready()),
    "join-decline": lambda: envelope_text(f"join on {UP}: a device whose data does not fit declines", join_decline()),
    "round": lambda: envelope_text(f"round announcement on {ROUND} (retained)", round_announcement()),
    "download-none": lambda: envelope_text(f"download on {DOWN}, a method that sends nothing (local-only), evaluation asked",
                                           download_none()),
    "upload-status": lambda: envelope_text(f"upload on {UP}: local-only's status report answering it", status_upload()),
    "ack": lambda: envelope_text(f"ack on {DOWN} of the upload above", ack()),
    "download-fedhe-first": lambda: envelope_text(f"download on {DOWN}: FedHe, round 1 (the server knows no class yet)",
                                                  download_fedhe_first()),
    "upload-class-logits": lambda: envelope_text(f"upload on {UP}: FedHe, C = 3, the device saw classes 0 and 2",
                                                 class_logits_upload()),
    "download-fedhe": lambda: envelope_text(f"download on {DOWN}: FedHe, round 2, C = 3, nobody reported class 1",
                                            download_fedhe()),
    "evaluate": lambda: envelope_text(f"evaluate on {DOWN} after round 2: a global model (a 2-feature linear classifier, C = 3)",
                                      evaluate_request()),
    "upload-evaluation": lambda: envelope_text(f"upload on {UP} answering it", evaluation_upload()),
    "ack-late": lambda: envelope_text(f"ack on {DOWN}: a synchronous method's upload for a round that has closed", ack_late()),
    "nack": lambda: envelope_text(f"nack on {DOWN}: an upload refused", nack()),
    "nack-unreadable": lambda: envelope_text(f"nack on {DOWN}: a message whose envelope header could not be read", nack_unreadable()),
    "nack-field-rule": lambda: envelope_text(f"nack on {DOWN}: an upload whose header broke a field rule", nack_field_rule()),
    "chunk": chunk_text,
    "nack-missing": lambda: envelope_text(f"nack on {DOWN}: the chunked upload above went stale without chunk 0", nack_missing()),
    "done": lambda: envelope_text(f"the last round announcement on {ROUND} (retained): the run is over", done_announcement()),
    "presence": presence_text,
}

BLOCK = re.compile(r"(<!-- example: ([a-z0-9-]+) -->\n```text\n)(.*?)(```)", re.S)


def test_the_doc_shows_every_example_exactly_as_the_code_builds_it():
    doc = PROTOCOL.read_text()
    found = [m.group(2) for m in BLOCK.finditer(doc)]
    assert sorted(found) == sorted(EXAMPLES), "every example once, and no marker without an example"
    if WRITE:
        PROTOCOL.write_text(BLOCK.sub(lambda m: m.group(1) + EXAMPLES[m.group(2)]() + "\n" + m.group(4), doc))
        return
    stale = [m.group(2) for m in BLOCK.finditer(doc) if m.group(3) != EXAMPLES[m.group(2)]() + "\n"]
    assert not stale, f"docs/PROTOCOL.md examples differ from the code: {stale} (EDGEFL_WRITE_DOCS=1 rewrites them)"


# --- the examples are what a receiver accepts -----------------------------------------------------
ENVELOPES = {"round": round_announcement, "done": done_announcement, "download-none": download_none,
             "download-fedhe-first": download_fedhe_first, "download-fedhe": download_fedhe, "evaluate": evaluate_request,
             "upload-status": status_upload, "upload-class-logits": class_logits_upload, "upload-evaluation": evaluation_upload,
             "ack": ack, "ack-late": ack_late, "nack": nack, "nack-unreadable": nack_unreadable, "nack-missing": nack_missing,
             "nack-field-rule": nack_field_rule,
             "chunk": last_chunk}


@pytest.mark.parametrize("name", sorted(ENVELOPES))
def test_every_example_envelope_unpacks_and_its_body_decodes(name):
    data = ENVELOPES[name]()
    assert len(data) <= 1000, "examples stay small"
    env = unpack(data, 1 << 20)
    assert header_problem(env.header()) is None and pack(env) == data
    assert (env.reply_to is None) == (env.type not in ("ack", "nack") or name == "nack-unreadable")
    if env.codec == "safetensors":
        message = decode(env.body)
        assert message.sender == env.sender
        if env.type == "upload":
            assert message.message_id == env.message_id and message.round == env.round == env.model_version
            assert env.extra["tensors"] == tensor_manifest(message.tensors)


def test_the_chunk_example_reassembles_into_its_upload():
    inner, chunks = chunked_upload()
    assert len(chunks) == 2 and all(len(c) < 8192 for c in chunks)
    assert len(chunks[-1]) <= 1000, "the last chunk is the one the doc shows in full"
    reassembler = Reassembler(1 << 20)
    assert reassembler.add(unpack(chunks[1], 1 << 20)) is None
    assert reassembler.missing(DEVICE, CHUNK_INNER_ID) == [0]  # what the example nack lists
    assert reassembler.add(unpack(chunks[0], 1 << 20)) == inner
    upload = unpack(inner, 1 << 20)
    assert upload.message_id == CHUNK_INNER_ID == unpack(nack_missing(), 1 << 20).reply_to
    assert decode(upload.body).tensors["head.weight"].shape == (10, 85)


# --- the doc's tables are the registries ------------------------------------------------------------
def _rows(text: str) -> dict[str, list[str]]:
    """First cell (without backticks) -> the other cells, of every markdown table row."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def _kinds(cell: str) -> set[str]:
    return set(re.findall(r"`([a-z_]+)`", cell))


def test_the_doc_lists_what_every_method_uploads_and_downloads():
    from edgefl.methods import METHODS

    rows = _rows(PROTOCOL.read_text().split("<!-- methods-table -->")[1].split("\n\n")[1])
    assert set(rows) == set(METHODS)
    for name, spec in METHODS.items():
        assert _kinds(rows[name][0]) == set(spec.uploads), name
        assert _kinds(rows[name][1]) == set(spec.downloads), name


def test_the_doc_describes_every_message_kind():
    doc = PROTOCOL.read_text()
    for kind in MESSAGE_KINDS:
        assert f"#### `{kind}`" in doc, kind


def test_the_doc_lists_every_header_field_and_whether_it_is_required():
    rows = _rows(PROTOCOL.read_text().split("<!-- header-fields -->")[1].split("\n\n")[1])
    assert set(rows) == set(HEADER_FIELDS)
    for name, (_, required) in HEADER_FIELDS.items():
        assert rows[name][1].startswith("always") == required, name


def test_config_md_documents_every_network_setting_with_its_default():
    from edgefl.config import NetworkSettings

    text = CONFIG.read_text()
    section = text.split("\n[network]")[1].split("\n[")[0].split("```")[0]
    values = tomllib.loads(section)
    commented = set(re.findall(r"^# ?([a-z_]+) = ", section, re.M))
    assert set(values) | commented == set(NetworkSettings.model_fields)
    for name, value in values.items():
        assert value == NetworkSettings.model_fields[name].default, name
    NetworkSettings.model_validate(values)


# --- the server does what the doc says ----------------------------------------------------------------
@pytest.fixture(scope="module")
def served():
    """A real server (local-only on digits, federation "demo") after round 1, its announcements recorded."""
    from edgefl.config import validate_config
    from edgefl.sim import Simulation
    from tests.conftest import digits_config

    sim = Simulation(validate_config(digits_config("local", rounds=2, network={"federation": FED})), show_progress=False)
    announced: list[Envelope] = []
    real = sim.network.announce
    sim.network.announce = lambda data: (announced.append(unpack(data, 1 << 20)), real(data))[-1]
    sim.run_round(1)
    yield sim, announced
    sim.close()


def _server_answer(sim, payload: bytes) -> Envelope:
    from edgefl.transport.base import Delivery

    inbox = sim.network._inbox[DEVICE]
    inbox.clear()
    sim.session.endpoint.handle(Delivery("message", DEVICE, payload))
    (reply,) = [unpack(d.payload, 1 << 20) for d in inbox if d.channel == "message"]
    inbox.clear()
    return reply


def test_the_announcements_carry_the_fields_section_6_1_lists(served):
    _, announced = served
    table = set(_rows(PROTOCOL.read_text().split("### 6.1 The announcement")[1].split("### 6.2")[0])) - {"info` field"}
    start, first = announced[0], announced[1]
    assert set(first.extra["info"]) == set(table), "the round announcement's info is the table"
    assert set(start.extra["info"]) == set(table), "so is the one before round 1"
    assert start.round == 0 and {k: start.extra["info"][k] for k in ("selected", "selected_count", "target", "done")} == \
        {"selected": [], "selected_count": 0, "target": 0, "done": False}


def test_the_server_answers_a_header_that_broke_a_field_rule_as_the_example_shows(served):
    sim, _ = served
    reply = _server_answer(sim, field_rule_upload())
    expected = unpack(nack_field_rule(), 1 << 20)
    assert {**reply.header(), "message_id": "-"} == {**expected.header(), "message_id": "-"}


@pytest.mark.parametrize("change, reply_to, round_no", [
    ({"status": None}, ident(0x105), 1),  # a null optional field
    ({"model_version": "1"}, ident(0x105), 1),  # a wrong type
    ({"round": "7"}, ident(0x105), None),  # a wrong type where the round is: the server's current round instead
    ({"message_id": 105}, None, 1),  # no usable id: nothing to answer
])
def test_every_header_that_parsed_is_answered_with_its_id_when_it_has_one(served, change, reply_to, round_no):
    sim, _ = served
    message = Message("status", 1, DEVICE, {}, {"num_samples": 386}, message_id=ident(0x105))
    env = Envelope("upload", FED, 1, DEVICE, encode(message), message.message_id, model_version=1, codec="safetensors")
    header = {**env.header(), **change}
    text = json.dumps(header).encode()
    reply = _server_answer(sim, struct.pack("<4sBI", b"EDFL", 1, len(text)) + text + env.body)
    assert reply.type == "nack" and reply.reply_to == reply_to, reply.extra["reason"]
    assert reply.round == (round_no if round_no is not None else sim.session.endpoint.model_version)


@pytest.mark.parametrize("field, inside, outside", [("round", 2, 1), ("message_id", ident(0x107), ident(0x106)),
                                                    ("sender", "client-1", DEVICE)])
def test_a_message_that_disagrees_with_its_envelope_is_refused_naming_the_field_and_both_values(served, field, inside, outside):
    sim, _ = served
    values = {"round": 1, "message_id": ident(0x106), "sender": DEVICE, field: inside}
    message = Message("status", values["round"], values["sender"], {}, {"num_samples": 386}, message_id=values["message_id"])
    env = Envelope("upload", FED, 1, DEVICE, encode(message), ident(0x106), model_version=1, codec="safetensors")
    reply = _server_answer(sim, pack(env))
    assert reply.type == "nack" and reply.reply_to == ident(0x106)
    assert reply.extra["reason"] == f"the message inside disagrees with its envelope: {field} {inside!r} inside, {outside!r} in the envelope"


def test_the_doc_points_to_the_method_options_and_says_late_uploads_stay_unanswered():
    doc = PROTOCOL.read_text()
    assert "[methods.md](methods.md)" in doc and (DOCS / "methods.md").is_file()
    assert "stays unanswered for good" in doc.split("### 6.5")[1].split("### 6.6")[0]


def test_the_signed_example_verifies_with_the_documented_public_key_and_nothing_else():
    from edgefl.errors import PayloadError
    from edgefl.transport.signing import Signer, Verifier, signed_header

    data = signed_ack()
    public = Signer.from_seed(SIGNING_SEED).public_hex()
    assert public in PROTOCOL.read_text()
    verifier = Verifier.from_hex(public)
    verifier.check(data, signed_header(data), DEVICE)
    assert unpack(data, 1 << 20).extra["status"] == "accepted"
    for bad, why in [(data[:-1] + bytes([data[-1] ^ 1]), "does not verify"), (data.replace(b"accepted", b"accepteD"), "does not verify"),
                     (ack(), "unsigned")]:
        with pytest.raises(PayloadError, match=why):
            verifier.check(bad, signed_header(bad), DEVICE)
    with pytest.raises(PayloadError, match="addressed to"):
        verifier.check(data, signed_header(data), "client-1")
    with pytest.raises(PayloadError, match="does not verify"):
        Verifier.from_hex(Signer.from_seed(bytes(32)).public_hex()).check(data, signed_header(data), DEVICE)


def test_the_task_example_is_a_task_a_device_accepts():
    from edgefl.task import parse_task

    env = unpack(task_message(), 1 << 20)
    assert parse_task(env.extra["info"]["task"]).device == DEVICE
