"""Chunked transfers: a large packed envelope travels as ``chunk`` envelopes and is rebuilt.

The chunks carry slices of the *packed* inner envelope, so the rebuilt bytes go through the same
checks as a message that travelled whole. Duplicates and out-of-order chunks are harmless. A
partial upload that stops receiving chunks for ``stale_s`` is *kept* and reported with its
missing chunks (the server nacks them, the device resends exactly those); after
:data:`STALE_STRIKES` such reports without progress it is dropped and reported as missing every
chunk, so "resend what the nack lists" always completes an upload (docs/PROTOCOL.md section 5).

Memory is bounded whatever a sender does: a cap on the whole body, at most
``max_partial_per_sender`` partial uploads and ``max_sender_bytes`` held per sender, at most
``max_partial_bytes`` held in all, every slice but the last at least
:data:`~edgefl.transport.envelope.MIN_CHUNK_BYTES` (so tiny slices cannot multiply the
per-piece overhead), a partial older than ``max_age_s`` dropped however its chunks trickle in,
and at most ``max_completed`` finished upload ids remembered.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from edgefl.errors import PayloadError
from edgefl.safejson import loads
from edgefl.transport.envelope import MAGIC, MAX_HEADER_BYTES, MIN_CHUNK_BYTES, PREFIX, VERSION, Envelope, new_id, pack

CHUNK_THRESHOLD = 512 << 10  # bodies above this travel in chunks
CHUNK_BYTES = 1 << 20  # measured on loopback: 1 MiB chunks move 50 MB fastest (docs/PROTOCOL.md)
STALE_STRIKES = 3  # stale reports without progress before a partial upload is dropped
MAX_MISSING = 1000  # chunk numbers named in one report (a nack's header stays far below 64 KiB)
MAX_COMPLETED = 4096  # finished upload ids remembered (oldest forgotten first): enough for the duplicates of recent uploads


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
    started: float = field(default_factory=time.monotonic)  # the first chunk: the hard age limit counts from here

    def missing(self) -> list[int]:
        return [i for i in range(self.count) if i not in self.pieces][:MAX_MISSING]


def inner_message_id(whole: bytes) -> str | None:
    """The ``message_id`` in the header of a reassembled envelope, or None when the header does not
    parse (the ordinary checks of the whole envelope then refuse it with their own reason)."""
    if len(whole) < PREFIX.size:
        return None
    magic, version, header_len = PREFIX.unpack_from(whole)
    if magic != MAGIC or version != VERSION or header_len > MAX_HEADER_BYTES or PREFIX.size + header_len > len(whole):
        return None
    try:
        header = loads(whole[PREFIX.size : PREFIX.size + header_len], "header")
    except PayloadError:
        return None
    value = header.get("message_id") if isinstance(header, dict) else None
    return value if isinstance(value, str) else None


class Reassembler:
    """Collects chunks per (sender, upload id); :meth:`add` returns the whole packed envelope once
    every chunk has arrived, its SHA-256 matches and its inner ``message_id`` is the upload id,
    else None. Budgets (bytes of slices held): ``max_sender_bytes`` per sender (default twice
    ``max_total_bytes``: an upload and its resend), ``max_partial_bytes`` in all (default four
    times); a chunk that would pass one is refused with the reason. :meth:`collect_stale`, called
    periodically, reports idle partials and drops those older than ``max_age_s`` (None: no age
    limit; the server passes ``network.partial_max_age_s``)."""

    def __init__(self, max_total_bytes: int, stale_s: float = 120.0, max_partial_per_sender: int = 4, *,
                 max_sender_bytes: int | None = None, max_partial_bytes: int | None = None, max_age_s: float | None = None,
                 max_completed: int = MAX_COMPLETED) -> None:
        self.max_total_bytes = max_total_bytes
        self.stale_s = stale_s
        self.max_partial_per_sender = max_partial_per_sender
        self.max_sender_bytes = max_sender_bytes if max_sender_bytes is not None else 2 * max_total_bytes
        self.max_partial_bytes = max_partial_bytes if max_partial_bytes is not None else 4 * max_total_bytes
        self.max_age_s = max_age_s
        self.max_completed = max_completed
        self.partial: dict[tuple[str, str], _Partial] = {}
        # so a late duplicate chunk does not restart an upload; bounded, oldest forgotten first
        self.completed: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.held_bytes = 0  # slices held in all partial uploads
        self._sender_bytes: dict[str, int] = {}
        self._sender_partials: dict[str, int] = {}

    def held_by(self, sender: str) -> int:
        """Bytes of slices held for ``sender``'s partial uploads."""
        return self._sender_bytes.get(sender, 0)

    def add(self, chunk: Envelope) -> bytes | None:
        c = chunk.extra["chunk"]
        sender, upload_id, seq = chunk.sender, c["upload_id"], c["seq"]
        key = (sender, upload_id)
        if key in self.completed:
            return None
        if c["total_length"] > self.max_total_bytes:
            raise PayloadError(f"upload of {c['total_length']} bytes exceeds the {self.max_total_bytes}-byte limit")
        size = len(chunk.body)
        if seq < c["count"] - 1 and size < MIN_CHUNK_BYTES:
            raise PayloadError(f"chunk {seq} of {c['count']} of upload {upload_id} carries {size} bytes: every chunk but the "
                               f"last carries at least {MIN_CHUNK_BYTES} (docs/PROTOCOL.md section 5)")
        part = self.partial.get(key)
        if part is None:
            mine = self._sender_partials.get(sender, 0)
            if mine >= self.max_partial_per_sender:
                raise PayloadError(f"{sender} has {mine} unfinished uploads (limit {self.max_partial_per_sender})")
        elif (part.count, part.total_length, part.total_sha256) != (c["count"], c["total_length"], c["total_sha256"]):
            raise PayloadError(f"chunk {seq} of upload {upload_id} disagrees with its earlier chunks")
        if part is not None and seq in part.pieces:  # a duplicate keeps the first copy
            part.touched = time.monotonic()
            return None
        if part is not None and part.size + size > part.total_length:
            self._drop(key)
            raise PayloadError(f"upload {upload_id}: chunks add up to more than its {part.total_length} bytes")
        held = self.held_by(sender) + size
        if held > self.max_sender_bytes:
            raise PayloadError(f"chunk {seq} of upload {upload_id}: {sender}'s unfinished uploads would hold {held} bytes, over its "
                               f"budget of {self.max_sender_bytes} (twice the largest message); complete or abandon an upload first")
        if self.held_bytes + size > self.max_partial_bytes:
            raise PayloadError(f"chunk {seq} of upload {upload_id}: unfinished uploads would hold {self.held_bytes + size} bytes in "
                               f"all, over the budget of {self.max_partial_bytes} (network.max_partial_bytes_total); "
                               "resend it when the missing chunks are asked for")
        now = time.monotonic()
        if part is None:
            part = self.partial[key] = _Partial(c["count"], c["total_length"], c["total_sha256"], touched=now, started=now)
            self._sender_partials[sender] = self._sender_partials.get(sender, 0) + 1
        part.pieces[seq] = chunk.body
        part.size += size
        part.strikes = 0
        part.touched = now
        self.held_bytes += size
        self._sender_bytes[sender] = self._sender_bytes.get(sender, 0) + size
        if len(part.pieces) < part.count:
            return None
        whole = b"".join(part.pieces[i] for i in range(part.count))
        self._drop(key)
        if len(whole) != part.total_length or hashlib.sha256(whole).hexdigest() != part.total_sha256:
            raise PayloadError(f"upload {upload_id}: reassembled body does not match its length and SHA-256")
        inner = inner_message_id(whole)
        if inner is not None and inner != upload_id:
            # else one chunk could carry any message under another id (acks, nacks and duplicates follow the upload id)
            raise PayloadError(f"upload {upload_id}: the envelope inside has message_id {inner[:64]!r}; a chunked upload's "
                               "upload_id is its inner envelope's message_id (docs/PROTOCOL.md section 5)")
        self.completed[key] = None
        if len(self.completed) > self.max_completed:
            self.completed.popitem(last=False)
        return whole

    def _drop(self, key: tuple[str, str]) -> None:
        part = self.partial.pop(key)
        sender = key[0]
        self.held_bytes -= part.size
        left = self._sender_bytes.get(sender, 0) - part.size
        count = self._sender_partials.get(sender, 0) - 1
        if count <= 0:  # no entry per sender without a partial: these maps stay as small as the partials
            self._sender_bytes.pop(sender, None)
            self._sender_partials.pop(sender, None)
        else:
            self._sender_bytes[sender] = left
            self._sender_partials[sender] = count

    def missing(self, sender: str, upload_id: str) -> list[int]:
        part = self.partial.get((sender, upload_id))
        return [] if part is None else part.missing()

    def collect_stale(self, now: float | None = None) -> list[tuple[str, str, list[int], bool]]:
        """Partial uploads idle for ``stale_s``, or older than ``max_age_s``: (sender, upload id,
        chunks to resend, dropped). A partial is kept (and reported again after another
        ``stale_s``) until it has been reported :data:`STALE_STRIKES` times without a new chunk;
        then it is dropped and every chunk is to be resent. One whose first chunk came more than
        ``max_age_s`` ago is dropped the same way however its chunks trickle in (a partial fed one
        chunk before each stale report would otherwise be held for ever)."""
        now = time.monotonic() if now is None else now
        out = []
        for key, part in list(self.partial.items()):
            if self.max_age_s is not None and now - part.started > self.max_age_s:
                self._drop(key)
                out.append((key[0], key[1], list(range(min(part.count, MAX_MISSING))), True))
                continue
            if now - part.touched <= self.stale_s:
                continue
            part.strikes += 1
            part.touched = now
            if part.strikes > STALE_STRIKES:
                self._drop(key)
                out.append((key[0], key[1], list(range(min(part.count, MAX_MISSING))), True))
            else:
                out.append((key[0], key[1], part.missing(), False))
        return out

    def forget(self, sender: str) -> None:
        """Drop a sender's partial uploads (a device the server no longer waits for)."""
        for key in [k for k in self.partial if k[0] == sender]:
            self._drop(key)
