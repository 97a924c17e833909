"""A fleet device: the method's client half behind an MQTT link (what a Pi runs).

The device acts on downloads: a ``download`` for round r means "you are selected in round r,
here is what the server sends you". It trains, uploads (in chunks when large) and resends the
same upload, with growing back-off, until the server answers with an ``ack`` or a ``nack``; a
nack that lists missing chunks gets only those chunks again. It stops when the retained round
announcement says the run is done and nothing is left to send.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from edgefl.algorithms import ClientHalf
from edgefl.config import RunConfig
from edgefl.errors import PayloadError
from edgefl.messages import decode, encode
from edgefl.transport.chunks import Reassembler, split
from edgefl.transport.envelope import Envelope, tensor_manifest, unpack
from edgefl.transport.link import Incoming, Link
from edgefl.transport.topics import Topics

log = logging.getLogger("edgefl.device")


class DeviceRunner:
    def __init__(self, cfg: RunConfig, client: ClientHalf, link: Link, x_test=None, y_test=None) -> None:
        self.cfg = cfg
        self.net = cfg.network
        self.client = client
        self.device = client.client_id
        self.link = link
        self.topics = Topics(self.net.federation or cfg.name)
        self.x_test, self.y_test = x_test, y_test
        self.reassembler = Reassembler(self.net.max_message_bytes, self.net.stale_upload_s)
        self.downloads: dict[int, Envelope] = {}
        self.replies: dict[str, Envelope] = {}  # reply_to -> ack/nack
        self.done_rounds: list[int] = []
        self.served: dict[int, Envelope] = {}  # round -> the upload sent for it (the last two rounds)
        self.handled_downloads: set[str] = set()
        self.latest_round = 0
        self.finished = False
        self.results: dict[int, dict[str, Any]] = {}

    # --- incoming -----------------------------------------------------------------------------
    def handle(self, item: Incoming) -> None:
        try:
            env = unpack(item.payload, self.net.max_message_bytes)
        except PayloadError as exc:
            log.warning("%s: ignoring a malformed message on %s: %s", self.device, item.topic, exc)
            return
        if env.sender != "server":
            log.warning("%s: ignoring a message from %r on %s", self.device, env.sender, item.topic)
            return
        if item.topic == self.topics.rounds:
            self.latest_round = max(self.latest_round, env.round)
            self.finished = bool(env.extra.get("info", {}).get("done"))
            return
        if env.type == "chunk":
            try:
                whole = self.reassembler.add(env)
            except PayloadError as exc:
                log.warning("%s: dropping a bad chunked download: %s", self.device, exc)
                return
            if whole is None:
                return
            env = unpack(whole, self.net.max_message_bytes)
        if env.type == "download":
            # a second copy of a download already handled is ignored; a *new* download for a round
            # already served (a restarted server reopening it) is answered with the same upload
            if env.message_id not in self.handled_downloads:
                self.downloads[env.round] = env
        elif env.type in ("ack", "nack") and env.reply_to:
            self.replies[env.reply_to] = env

    def pump(self, timeout_s: float) -> None:
        item = self.link.get(timeout_s)
        while item is not None:
            self.handle(item)
            item = self.link.get(0)

    # --- one round ----------------------------------------------------------------------------
    def train(self, env: Envelope) -> Envelope:
        down = decode(env.body, self.net.max_message_bytes) if env.codec == "safetensors" else None
        message = self.client.fit(down, env.round)
        if message is None:
            raise RuntimeError(f"{self.device}: the method's client half produced nothing to send")
        r = env.round
        if self.x_test is not None and self.client.judged and (r % self.cfg.eval.every == 0 or r == self.cfg.rounds):
            message.meta["eval_accuracy"] = self.client.evaluate(self.x_test, self.y_test, self.cfg.eval.batch_size)
        return Envelope("upload", self.topics.federation, r, self.device, encode(message), message.message_id,
                        model_version=env.model_version, codec="safetensors",
                        extra={"tensors": tensor_manifest(message.tensors)})

    def deliver(self, env: Envelope, max_wait_s: float | None = None) -> Envelope | None:
        """Publish until answered; returns the ack/nack, or None when the run moved on or ended."""
        pieces = split(env, self.net.chunk_bytes, self.net.chunk_threshold)
        waiting = self.net.ack_timeout_s
        started = time.monotonic()
        to_send = list(range(len(pieces)))
        while True:
            for i in to_send:
                self.link.publish(self.topics.up(self.device), pieces[i])
            sent_at = time.monotonic()
            while time.monotonic() - sent_at < waiting:
                self.pump(0.2)
                reply = self.replies.pop(env.message_id, None)
                if reply is None and len(pieces) > 1:
                    reply = self._chunk_nack(pieces)
                if reply is not None:
                    if reply.type == "nack" and reply.extra.get("missing"):
                        to_send = [i for i in reply.extra["missing"] if 0 <= i < len(pieces)]
                        break
                    return reply
                if self.finished and self.latest_round >= self.cfg.rounds and env.round < self.latest_round:
                    return None
            else:
                to_send = list(range(len(pieces)))
                waiting = min(waiting * 2, 120.0)  # no answer: the server or broker may be busy; back off
            if max_wait_s is not None and time.monotonic() - started > max_wait_s:
                return None

    def _chunk_nack(self, pieces: list[bytes]) -> Envelope | None:
        """A nack answering one of the chunks (missing chunks, or a reason)."""
        for reply_to, reply in list(self.replies.items()):
            if reply.type == "nack":
                del self.replies[reply_to]
                return reply
        return None

    def run(self, timeout_s: float | None = None) -> dict[int, dict[str, Any]]:
        """Serve rounds until the server says the run is done (or ``timeout_s`` passes)."""
        started = time.monotonic()
        while True:
            self.pump(0.5)
            for r in sorted(self.downloads):
                env = self.downloads.pop(r)
                self.handled_downloads.add(env.message_id)
                if r in self.served:
                    upload = self.served[r]  # trained already: the same upload, same id (a duplicate is harmless)
                else:
                    upload = self.served[r] = self.train(env)
                    for old in [k for k in self.served if k < r - 1]:
                        del self.served[old]
                reply = self.deliver(upload)
                if r not in self.done_rounds:
                    self.done_rounds.append(r)
                self.results[r] = {"reply": None if reply is None else reply.type,
                                   "status": None if reply is None else reply.extra.get("status") or reply.extra.get("reason")}
                if reply is not None and reply.type == "nack":
                    log.warning("%s: round %d upload refused: %s", self.device, r, reply.extra.get("reason"))
            if self.finished and not self.downloads:
                return self.results
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                return self.results
