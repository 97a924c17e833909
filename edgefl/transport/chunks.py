"""Chunked transfers: a large packed envelope travels as ``chunk`` envelopes and is rebuilt.

The chunks carry slices of the *packed* inner envelope, so the rebuilt bytes go through the same
checks as a message that travelled whole. Duplicates and out-of-order chunks are harmless. A
partial upload that stops receiving chunks for ``stale_s`` is *kept* and reported with its
missing chunks (the server nacks them, the device resends exactly those); after
:data:`STALE_STRIKES` such reports without progress it is dropped and reported as missing every
chunk, so "resend what the nack lists" always completes an upload (docs/PROTOCOL.md section 5).
Memory is bounded by a cap on the whole body and on partial uploads per sender.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

from edgefl.errors import PayloadError
from edgefl.transport.envelope import Envelope, new_id, pack

CHUNK_THRESHOLD = 512 << 10  # bodies above this travel in chunks
CHUNK_BYTES = 1 << 20  # measured on loopback: 1 MiB chunks move 50 MB fastest (docs/PROTOCOL.md)
STALE_STRIKES = 3  # stale reports without progress before a partial upload is dropped
MAX_MISSING = 1000  # chunk numbers named in one report (a nack's header stays far below 64 KiB)


def split(env: Envelope, chunk_bytes: int = CHUNK_BYTES, threshold: int = CHUNK_THRESHOLD) -> list[bytes]:
    """The packed envelope, whole when small, else as packed ``chunk`` envelopes."""
    whole = pack(env)
    if len(whole) <= threshold:
        return [whole]
    digest = hashlib.sha256(whole).hexdigest()
    count = -(-len(whole) // chunk_bytes)
    out = []
    for seq in range(count):
        piece = whole[seq * chunk_bytes : (seq + 1) * chunk_bytes]
        chunk = Envelope("chunk", env.federation, env.round, env.sender, piece, new_id(), env.reply_to, env.model_version, "none",
                         {"chunk": {"upload_id": env.message_id, "seq": seq, "count": count, "total_length": len(whole),
                                    "total_sha256": digest}})
        out.append(pack(chunk))
    return out


@dataclass
class _Partial:
    count: int
    total_length: int
    total_sha256: str
    pieces: dict[int, bytes] = field(default_factory=dict)
    touched: float = field(default_factory=time.monotonic)
    strikes: int = 0  # stale reports since the last new chunk
    size: int = 0  # bytes held

    def missing(self) -> list[int]:
        return [i for i in range(self.count) if i not in self.pieces][:MAX_MISSING]


class Reassembler:
    """Collects chunks per (sender, upload id); :meth:`add` returns the whole packed envelope once
    every chunk has arrived and its SHA-256 matches, else None."""

    def __init__(self, max_total_bytes: int, stale_s: float = 120.0, max_partial_per_sender: int = 4) -> None:
        self.max_total_bytes = max_total_bytes
        self.stale_s = stale_s
        self.max_partial_per_sender = max_partial_per_sender
        self.partial: dict[tuple[str, str], _Partial] = {}
        self.completed: set[tuple[str, str]] = set()  # so a late duplicate chunk does not restart an upload

    def add(self, chunk: Envelope) -> bytes | None:
        c = chunk.extra["chunk"]
        key = (chunk.sender, c["upload_id"])
        if key in self.completed:
            return None
        if c["total_length"] > self.max_total_bytes:
            raise PayloadError(f"upload of {c['total_length']} bytes exceeds the {self.max_total_bytes}-byte limit")
        part = self.partial.get(key)
        if part is None:
            mine = [k for k in self.partial if k[0] == chunk.sender]
            if len(mine) >= self.max_partial_per_sender:
                raise PayloadError(f"{chunk.sender} has {len(mine)} unfinished uploads (limit {self.max_partial_per_sender})")
            part = self.partial[key] = _Partial(c["count"], c["total_length"], c["total_sha256"])
        elif (part.count, part.total_length, part.total_sha256) != (c["count"], c["total_length"], c["total_sha256"]):
            raise PayloadError(f"chunk {c['seq']} of upload {c['upload_id']} disagrees with its earlier chunks")
        if c["seq"] not in part.pieces:  # a duplicate keeps the first copy
            part.pieces[c["seq"]] = chunk.body
            part.size += len(chunk.body)
            part.strikes = 0
        part.touched = time.monotonic()
        if part.size > part.total_length:
            del self.partial[key]
            raise PayloadError(f"upload {c['upload_id']}: chunks add up to more than its {part.total_length} bytes")
        if len(part.pieces) < part.count:
            return None
        whole = b"".join(part.pieces[i] for i in range(part.count))
        del self.partial[key]
        if len(whole) != part.total_length or hashlib.sha256(whole).hexdigest() != part.total_sha256:
            raise PayloadError(f"upload {c['upload_id']}: reassembled body does not match its length and SHA-256")
        self.completed.add(key)
        return whole

    def missing(self, sender: str, upload_id: str) -> list[int]:
        part = self.partial.get((sender, upload_id))
        return [] if part is None else part.missing()

    def collect_stale(self, now: float | None = None) -> list[tuple[str, str, list[int], bool]]:
        """Partial uploads idle for ``stale_s``: (sender, upload id, chunks to resend, dropped).
        A partial is kept (and reported again after another ``stale_s``) until it has been
        reported :data:`STALE_STRIKES` times without a new chunk; then it is dropped and every
        chunk is to be resent."""
        now = time.monotonic() if now is None else now
        out = []
        for key, part in list(self.partial.items()):
            if now - part.touched <= self.stale_s:
                continue
            part.strikes += 1
            part.touched = now
            if part.strikes > STALE_STRIKES:
                del self.partial[key]
                out.append((key[0], key[1], list(range(min(part.count, MAX_MISSING))), True))
            else:
                out.append((key[0], key[1], part.missing(), False))
        return out

    def forget(self, sender: str) -> None:
        """Drop a sender's partial uploads (a device the server no longer waits for)."""
        for key in [k for k in self.partial if k[0] == sender]:
            del self.partial[key]
