"""The server's protocol endpoint: everything between the transport and a round policy.

It owns what every policy needs the same way and nothing a policy decides:

* every delivery checked cheapest first (size, envelope, header, sender = channel, federation,
  reassembly of chunks with bounded memory, decode without pickle with a size cap, the kinds the
  method's spec declares, the server-side filters, then method-independent sanity checks) and
  refused with a ``nack`` that names the reason; nothing a device sends can raise out of it;
* presence (who is online), joins of devices that bring their own data, devices outside the
  federation (answered at a bounded rate);
* sending: downloads (through the server-side filters), replies, announcements, and
  *exchanges*: a request sent to a set of devices whose replies are collected until all have
  answered or a deadline passes (evaluate requests, and the stages of
  :mod:`edgefl.stages`).

A round policy (:mod:`edgefl.server.rounds`, :mod:`edgefl.server.asynchronous`) sits on top: it
installs itself as the endpoint's :class:`Listener` and gets every checked upload and every
presence change; it calls :meth:`ServerEndpoint.pump` to wait for the next delivery. The
endpoint imports no policy.
"""

from __future__ import annotations

import logging
import math
import re
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from edgefl.errors import PayloadError
from edgefl.filters import Filter
from edgefl.messages import RUNNER_KINDS, Message, decode, encode
from edgefl.methods import MethodSpec
from edgefl.config import NetworkSettings
from edgefl.safetext import printable
from edgefl.server.enrolment import Enrolment
from edgefl.server.rejections import Rejections
from edgefl.server.upload_checks import upload_problem
from edgefl.transport.base import Delivery, ServerTransport
from edgefl.transport.chunks import Reassembler, split
from edgefl.transport.envelope import Envelope, answerable_id, pack, tensor_manifest, unpack
from edgefl.transport.link import started_later
from edgefl.transport.topics import is_safe_name

log = logging.getLogger("edgefl.server")

#: a presence's process as edgefl's link writes it: "<unix start time>-<random hex>"
INSTANCE_FORMAT = re.compile(r"\d{1,12}(\.\d{1,9})?-[0-9a-f]{1,32}")
STRANGER_NACK_EVERY_S = 10.0  # at most one nack per unknown device id in this many seconds
MAX_STRANGERS = 1000  # unknown ids remembered for that rate limit

EventSink = Callable[[str, dict[str, Any]], None]


def shown(value: Any, limit: int = 64) -> str:
    """A value a device sent, for a reason or a log line: repr escapes what is not printable, and
    at most ``limit`` characters of it are shown."""
    if not isinstance(value, str):
        return repr(value)[:limit]
    return repr(value[:limit]) + ("..." if len(value) > limit else "")


def all_offline_past(waiting: Iterable[str], offline_since: dict[str, float], now: float, grace_s: float) -> bool:
    """Whether there is someone to wait for and every one of them has been offline (since
    ``offline_since``) for at least ``grace_s``: a round or a request need not wait any longer."""
    waiting = list(waiting)
    return bool(waiting) and all(now - offline_since.get(d, math.inf) >= grace_s for d in waiting)


class Listener(Protocol):
    """What a round policy hears from the endpoint."""

    def on_upload(self, device: str, env: Envelope, message: Message, size: int, facts: dict[str, Any]) -> None:
        """A checked, decoded upload of one of the method's kinds (filters applied)."""
        ...

    def on_presence(self, device: str, online: bool, was: bool) -> None:
        """``device`` came online or went offline (``was``: its state before)."""
        ...

    def rejections_now(self) -> Rejections | None:
        """Where refusals of this moment count (the round's or the window's), besides the run's."""
        ...


@dataclass
class Exchange:
    """A request sent to ``asked``, collecting one reply each (an evaluate request, a stage)."""

    name: str  # "evaluate", or the stage's name
    round: int
    asked: frozenset[str]
    #: checks a reply's message (None: usable) before it is counted
    check: Callable[[str, Message], str | None] = lambda device, message: None
    answers: dict[str, Message] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.answers) >= len(self.asked)


class ServerEndpoint:
    """The protocol engine over one transport (see the module docstring).

    ``model_version`` is the policy's to keep current (a round number, or an asynchronous run's
    server version): replies and refusals carry it."""

    def __init__(self, network: NetworkSettings, spec: MethodSpec, transport: ServerTransport | None, device_ids: list[str],
                 federation: str, *, num_classes: int | None, max_epochs: int, partial_max_age_s: float,
                 filters: list[Filter] | None = None, on_event: EventSink | None = None,
                 enrolment: Enrolment | None = None) -> None:
        self.net = network
        self.spec = spec
        self.transport: ServerTransport = transport  # type: ignore[assignment]  (None until connect())
        self.device_ids = list(device_ids)
        self.known = frozenset(device_ids)
        self.federation = federation
        self.num_classes = num_classes
        self.max_epochs = max_epochs
        self.filters = list(filters or [])
        self.on_event = on_event or (lambda kind, info: None)
        self.enrolment = enrolment  # devices that bring their own data join through it; None: the config assigns data
        self.reassembler = Reassembler(network.max_message_bytes, network.stale_upload_s, max_partial_bytes=network.max_partial_bytes_total,
                                       max_age_s=partial_max_age_s)
        self.online: dict[str, bool] = {}
        self.online_count = 0  # devices whose presence is online (kept with self.online: no scans per message)
        self.offline_since: dict[str, float] = {}  # devices last seen going offline, since when (the transport's clock)
        # the latest process each device came online as (MQTT 5 presence), and the older processes
        # already said to share its id: one that comes online after a newer one is a second process
        self.instances: dict[str, str] = {}
        self._twins_said: set[tuple[str, str]] = set()
        self.rejections = Rejections()  # the whole run's, bounded
        self.listener: Listener | None = None
        self.model_version = 0
        # names this run in announcements and downloads (info.run): a device's saved state is used
        # only in the run that saved it, not in a later run of the same config (kept on resume)
        self.run_id = uuid.uuid4().hex[:16]
        self.exchange: Exchange | None = None  # the request whose replies are being collected
        self._strangers: dict[str, float] = {}  # unknown device id -> when it was last nacked
        self._first_upload: dict[str, int] = {}  # device -> the round of its first upload this server saw
        self._connects_seen = transport.connects if transport is not None else 0

    def connect(self, transport: ServerTransport) -> None:
        """Run over ``transport`` (a server that restores its state first connects afterwards)."""
        self.transport = transport
        self._connects_seen = transport.connects

    # --- who is there -----------------------------------------------------------------------------
    def is_online(self, device: str) -> bool:
        return bool(self.online.get(device))

    def mark_absent(self, devices: Iterable[str], since: float) -> None:
        """Devices never heard from while the server waited for them (from ``since``, the
        transport's clock) count as offline since then: a round or request waits for them at most
        what is left of ``offline_grace_s``, not its whole deadline, until they come online."""
        for device in devices:
            if device not in self.online:
                self.online[device] = False
                self.offline_since.setdefault(device, since)

    def can_take_part(self, device: str) -> bool:
        """Online and, when devices bring their own data, ready."""
        return bool(self.online.get(device)) and (self.enrolment is None or self.enrolment.is_ready(device))

    def joined(self) -> int:
        """Devices nobody needs to wait for before round 1: online ones, or with device-held data
        those online and ready, and those that declined (a resumed run restores who was ready, and
        they are waited for until they are back online)."""
        if self.enrolment is None:
            return self.online_count
        return len(self.ready_online()) + len(self.enrolment.declined())

    def ready_online(self) -> list[str]:
        """With device-held data: the ready devices that are online now, in the fleet's order."""
        return [d for d in self.enrolment.ready() if self.is_online(d)] if self.enrolment is not None else []

    def pool(self) -> list[str]:
        """The devices a policy may give work: every device, or with device-held data those ready."""
        return self.device_ids if self.enrolment is None else self.enrolment.ready()

    # --- sending ----------------------------------------------------------------------------------
    def send(self, device: str, env: Envelope) -> int:
        """Send ``env`` to one device, in chunks when large; the bytes sent."""
        pieces = split(env, self.net.chunk_bytes, self.net.chunk_threshold)
        for p in pieces:
            self.transport.send(device, p)
        return sum(len(p) for p in pieces)

    def outgoing(self, device: str, message: Message | None, filtered: bool = True) -> tuple[bytes, str]:
        """A message for ``device`` through the server-side filters (unless ``filtered`` is
        False: a stage request is its owner's own message), encoded: (body, codec)."""
        if message is None:
            return b"", "none"
        for f in self.filters if filtered else ():
            message = f.download_out(device, message)
        return encode(message), "safetensors"

    def send_download(self, device: str, number: int, message: Message | None, extra: dict[str, Any]) -> tuple[Envelope, int | None, int]:
        """Send ``device`` a download numbered ``number`` (a round, or an asynchronous run's
        download count) carrying ``message`` (None: the method sends nothing): (the envelope,
        its body's bytes or None, the bytes sent)."""
        body, codec = self.outgoing(device, message)
        env = Envelope("download", self.federation, number, "server", body, model_version=number, codec=codec, extra=extra)
        return env, (len(body) if message is not None else None), self.send(device, env)

    def reply(self, device: str, to: Envelope, kind: str, **extra: Any) -> None:
        """An ``ack`` (or another answer) to ``to``."""
        env = Envelope(kind, self.federation, to.round, "server", reply_to=to.message_id, model_version=self.model_version, extra=extra)
        self.transport.send(device, pack(env))

    def announce(self, round_no: int, info: dict[str, Any]) -> None:
        env = Envelope("round", self.federation, round_no, "server", model_version=round_no,
                       extra={"info": {**info, "run": self.run_id, "classes": self.num_classes}})
        self.transport.announce(pack(env))

    def request(self, exchange: Exchange, kind: str, messages: dict[str, Message | None], extra: dict[str, Any],
                deadline_s: float, until: Callable[[], bool] = lambda: False) -> dict[str, Message]:
        """Send each device of ``exchange.asked`` its request (envelope type ``kind``: evaluate,
        stage) and collect the replies until every device answered, ``deadline_s`` of the
        transport's clock passed, or ``until()``; the replies by device."""
        self.exchange = exchange
        try:
            for device in sorted(exchange.asked):
                body, codec = self.outgoing(device, messages.get(device), filtered=kind != "stage")
                self.send(device, Envelope(kind, self.federation, exchange.round, "server", body, model_version=exchange.round,
                                           codec=codec, extra={"info": {"run": self.run_id, **extra}}))
            deadline = self.transport.now() + deadline_s
            while not exchange.complete and self.transport.now() < deadline and not until() and not self._all_gone(exchange):
                self.pump(min(deadline - self.transport.now(), 1.0))
            return dict(exchange.answers)
        finally:
            self.exchange = None

    def _all_gone(self, exchange: Exchange) -> bool:
        """Every device still to answer has been offline for ``offline_grace_s``: nobody is left to wait for."""
        return all_offline_past(exchange.asked - exchange.answers.keys(), self.offline_since, self.transport.now(),
                                self.net.offline_grace_s)

    # --- receiving --------------------------------------------------------------------------------
    def pump(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for one delivery and act on it; drop or re-ask for partial
        uploads that stopped arriving."""
        item = self.transport.receive(timeout_s)
        self._check_reconnect()
        if item is not None:
            self.handle(item)
        for device, upload_id, missing, dropped in self.reassembler.collect_stale():
            tag = printable(upload_id, 64)  # the device chose this id: "[/]" or a newline must not reach the console as such
            reason = ((f"partial upload {tag} dropped (no progress after repeated stale nacks, or not complete within "
                       f"network.partial_max_age_s); resend every chunk") if dropped
                      else f"partial upload {tag} went stale; resend the missing chunks")
            self.count(device, reason)
            env = Envelope("nack", self.federation, self.model_version, "server", reply_to=upload_id,
                           model_version=self.model_version, extra={"reason": reason, "missing": missing})
            self.transport.send(device, pack(env))

    def drain(self, quiet_s: float = 0.5, max_s: float = 5.0) -> None:
        """Answer what is still arriving until the network has been quiet for ``quiet_s`` (at most
        ``max_s``), so no upload that reached the server goes unanswered."""
        end = time.monotonic() + max_s
        while time.monotonic() < end:
            item = self.transport.receive(quiet_s)
            if item is None:
                return
            self.handle(item)

    def handle(self, item: Delivery) -> None:
        """One delivery from the transport. Never raises: every problem, the unforeseen included,
        becomes a nack (when there is someone to answer) and a bounded log line."""
        try:
            self._handle(item)
        except Exception as exc:  # a bug or a case no check foresaw: refuse the message, keep serving
            log.exception("unexpected failure handling a message from %s", printable(item.peer, 64))
            try:
                self.refuse(item.peer or "?", None, f"the server could not handle this message ({type(exc).__name__})")
            except Exception:
                log.exception("could not even refuse it")

    def _handle(self, item: Delivery) -> None:
        device = item.peer
        if item.channel == "unknown" or device is None:
            self.refuse(str(item.where or device)[:64], None, "message on a topic that belongs to no device")
            return
        if device not in self.known:
            self._stranger(device)
            return
        if item.retained and item.channel == "message":
            # a retained upload is replayed to every (re)subscribing server: never act on one
            self.count(device, "retained message on a device topic; discarded (devices publish with retain = false)")
            return
        if item.channel == "presence":
            self._presence(device, bool(item.online), item.instance)
            return
        env = self._checked(device, item.payload, None)
        if env is None:
            return
        if env.type == "chunk":
            try:
                whole = self.reassembler.add(env)
            except PayloadError as exc:
                self.refuse(device, env, str(exc))
                return
            if whole is None:
                return
            env = self._checked(device, whole, env)  # the reassembled upload goes through the same checks
            if env is None:
                return
        if env.type == "join":
            self._join(device, env)
            return
        if env.type != "upload":
            self.refuse(device, env, f"devices send uploads, chunks and joins, not {env.type!r}")
            return
        message = self._decoded(device, env)
        if message is None:
            return
        if message.kind in RUNNER_KINDS:
            self._exchange_reply(device, env, message)
            return
        if self.listener is None:
            self.reply(device, env, "ack", status="late", reason="the server is not taking uploads yet; not used")
            return
        self._note_start(device, message)
        self.listener.on_upload(device, env, message, len(item.payload), item.facts)

    def _note_start(self, device: str, message: Message) -> None:
        """Say when a device that trained earlier in this run restarted from scratch (its first upload's
        ``meta.started_from``, PROTOCOL.md 4.3): what it kept between rounds starts over, and the
        accuracy it reports drops with no other sign in the server's log."""
        first = self._first_upload.setdefault(device, message.round)
        if message.meta.get("started_from") != "scratch" or message.round <= first:
            return
        lost = message.meta.get("state_lost")
        why = (f"its saved state could not be used: {printable(lost, 250)}" if isinstance(lost, str) and lost
               else "it had no saved state (started with --no-state, or with a new --state-dir)")
        self._warn(device, f"restarted from scratch in round {message.round} after taking part from round {first} ({why}): "
                           "the state it keeps between rounds starts over, and its accuracy may drop until it catches up")

    def _warn(self, device: str, text: str) -> None:
        """A device's message was accepted but is worth an operator's look: logged, and sent as a "warning" event."""
        # marked as the echo of the event: a console that prints the event drops this line
        log.warning("%s %s", printable(device, 64), text, extra={"edgefl_event": "warning"})
        self.on_event("warning", {"device": device, "reason": text})

    def _join(self, device: str, env: Envelope) -> None:
        """A device that brings its own data asks for its task, says it is ready, or declines
        (:mod:`edgefl.server.enrolment`)."""
        if self.enrolment is None:
            self.refuse(device, env, "this run's devices train on the share the server's config assigns (data.partition is not "
                                     "\"devices\"): start edgefl client with the run's --config")
            return
        info = env.extra.get("info") if isinstance(env.extra.get("info"), dict) else {}
        stage = info.get("stage")
        if stage == "hello":
            task, problem = self.enrolment.hello(device, info, self.run_id)
            if task is None:
                self.refuse(device, env, problem)
                self.on_event("declined", {"device": device, "reason": problem})
                return
            reply = Envelope("task", self.federation, self.model_version, "server", reply_to=env.message_id,
                             model_version=self.model_version, extra={"info": {"run": self.run_id, "task": task.to_info()}})
            self.transport.send(device, pack(reply))
        elif stage == "ready":
            problem, changed = self.enrolment.ready_report(device, info)
            if problem:
                self.refuse(device, env, problem)
                return
            self.reply(device, env, "ack", status="accepted")
            if changed:
                self._warn(device, f"enrolled again with other data ({changed}): a restart with new data, or a second process "
                                   "with the same --device-id (each device needs its own)")
            self.on_event("enrolled", {"device": device, **self.enrolment.devices[device].to_dict()})
            if self.listener is not None:
                # a device that restarted mid-round joins again before it listens for rounds, so the
                # download resent when it came online was not for its device loop: send it now
                self.listener.on_presence(device, True, False)
        elif stage == "decline":
            reason, kept = self.enrolment.decline(device, info)
            if kept:  # a ready device is not evicted by a decline: a second process with its id may have sent it
                self.refuse(device, env, f"declined ({reason}), but {device} is enrolled and ready: its registration stays "
                                         "(a second process with the same --device-id? each device needs its own)")
                return
            self.count(device, f"declined: {reason}", announce=False)  # the "declined" event below says it once
            self.reply(device, env, "ack", status="accepted", reason="declined: recorded")
            self.on_event("declined", {"device": device, "reason": reason})
        else:
            self.refuse(device, env, "a join's info.stage is hello, ready or decline")

    def _exchange_reply(self, device: str, env: Envelope, message: Message) -> None:
        """A reply to an evaluate request or a stage: counted in the open exchange, if it is for it."""
        ex = self.exchange
        name = "evaluate" if message.kind == "evaluation" else message.meta.get("stage")
        if ex is None or ex.name != name or device not in ex.asked or message.round != ex.round:
            what = "evaluation" if message.kind == "evaluation" else f"stage {shown(name)}"
            self.reply(device, env, "ack", status="late", reason=f"no {what} is being collected (round {message.round}); not used")
            return
        problem = ex.check(device, message)
        if problem:
            self.refuse(device, env, problem)
            return
        self.reply(device, env, "ack", status="duplicate" if device in ex.answers else "accepted")
        ex.answers.setdefault(device, message)

    def _stranger(self, device: str) -> None:
        """A message from a device id outside the config: refused, and answered on its own down
        topic (rate-limited: a stranger cannot make the server flood)."""
        reason = f"device {device[:64]!r} is not in this federation's config"
        self.count(device, reason)
        if not is_safe_name(device):
            return  # not a usable topic name: nobody to answer
        now = self.transport.now()
        if now - self._strangers.get(device, -math.inf) < STRANGER_NACK_EVERY_S:
            return
        if len(self._strangers) >= MAX_STRANGERS:
            self._strangers.clear()
        self._strangers[device] = now
        nack = Envelope("nack", self.federation, self.model_version, "server", model_version=self.model_version,
                        extra={"reason": reason})
        self.transport.send(device, pack(nack))

    def _presence(self, device: str, online: bool, instance: str | None = None) -> None:
        if online and instance:
            self._check_twins(device, instance)
        was = self.online.get(device, False)
        self.online[device] = online
        if online:
            self.offline_since.pop(device, None)
        elif was or device not in self.offline_since:
            self.offline_since[device] = self.transport.now()
        if online != was:
            self.online_count += 1 if online else -1
            self.on_event("presence", {"device": device, "online": online})
        if self.listener is not None:
            self.listener.on_presence(device, online, was)

    def _check_twins(self, device: str, instance: str) -> None:
        """A device restarting comes back as a newer process; one that comes online after a newer
        process of its id is another process running with the same --device-id (the two take the
        broker connection from each other until the older sees the newer and stops): said once."""
        if not INSTANCE_FORMAT.fullmatch(instance):  # (from the network: a presence is not trusted either)
            return
        latest = self.instances.get(device)
        if latest is None or latest == instance or not started_later(latest, instance):
            self.instances[device] = instance
            return
        if (device, instance) not in self._twins_said and len(self._twins_said) < 4 * len(self.known) + 16:
            self._twins_said.add((device, instance))
            self.on_event("twins", {"device": device, "older": instance, "newer": latest})

    def _check_reconnect(self) -> None:
        """After the server's own reconnect (a broker restart) presence is unknown again: the next
        "online" of a device re-sends what it waits for (the broker may have lost it)."""
        if self.transport.connects != self._connects_seen:
            self._connects_seen = self.transport.connects
            self.online = {}
            self.online_count = 0
            self.offline_since = {}
            self.on_event("reconnected", {"connects": self._connects_seen})

    # --- checks -----------------------------------------------------------------------------------
    def _checked(self, device: str, data: bytes, carrier: Envelope | None) -> Envelope | None:
        """Unpack and check an envelope's identity; on failure nack (answering ``carrier``, the
        last chunk, when the data came in chunks) and return None."""
        try:
            env = unpack(data, self.net.max_message_bytes)
        except PayloadError as exc:
            self.refuse(device, carrier, str(exc), reply_to=exc.message_id, round_no=exc.round_no)
            return None
        if env.sender != device:
            self.refuse(device, env, f"sender {env.sender!r} in the header is not the topic's device {device!r}")
            return None
        if env.federation != self.federation:
            self.refuse(device, env, f"federation {env.federation!r} is not {self.federation!r}")
            return None
        return env

    def _decoded(self, device: str, env: Envelope) -> Message | None:
        if env.codec != "safetensors":
            self.refuse(device, env, f"an upload's codec must be safetensors, not {env.codec!r}")
            return None
        try:
            message = decode(env.body, self.net.max_message_bytes)
        except PayloadError as exc:
            self.refuse(device, env, str(exc))
            return None
        differs = [(name, inside, outside) for name, inside, outside in
                   (("sender", message.sender, env.sender), ("round", message.round, env.round), ("message_id", message.message_id, env.message_id))
                   if inside != outside]
        if differs:
            # the first field that differs, both values printable and bounded (they come from the device)
            name, inside, outside = differs[0]
            self.refuse(device, env, f"the message inside disagrees with its envelope: {name} {shown(inside)} inside, "
                                     f"{shown(outside)} in the envelope")
            return None
        declared = env.extra.get("tensors")
        if declared is not None and declared != tensor_manifest(message.tensors):
            self.refuse(device, env, "the body's tensors (dtype or shape) differ from the header's 'tensors' manifest")
            return None
        if message.kind not in self.spec.uploads and message.kind not in RUNNER_KINDS:
            self.refuse(device, env, f"{self.spec.name} devices upload {' or '.join(self.spec.uploads)}, not {message.kind!r}")
            return None
        if message.kind not in RUNNER_KINDS:
            try:
                for f in reversed(self.filters):  # the device applied them in order: undo in reverse
                    message = f.upload_in(message)
            except PayloadError as exc:
                self.refuse(device, env, str(exc))
                return None
        problem = self._sanity(message, env)
        if problem:
            self.refuse(device, env, problem)
            return None
        return message

    def _sanity(self, message: Message, env: Envelope) -> str | None:
        """Method-independent checks of a decoded upload (:mod:`edgefl.server.upload_checks`)."""
        if env.model_version != message.round:
            return f"model version {env.model_version} does not match round {message.round}"
        if message.kind == "stage":  # a stage's reply carries what its stage defines: the stage checks it
            name = message.meta.get("stage")
            return None if isinstance(name, str) and is_safe_name(name) else "a stage reply names its stage in meta.stage"
        return upload_problem(message, self.num_classes, self.net.max_abs_value, self.max_epochs)

    # --- refusing ---------------------------------------------------------------------------------
    def count(self, device: str, reason: str, announce: bool = True) -> bool:
        """Count a refusal in the policy's and the run's bounded summaries; True when it is to be
        logged in full (the first few of a round, then a sample). ``announce=False``: counted only
        (the caller has its own event for it, as a decline has)."""
        bucket = self.listener.rejections_now() if self.listener is not None else None
        loud = bucket.add(device, reason) if bucket is not None else True
        self.rejections.add(device, reason)
        if loud and announce:
            # ids and reasons quote the network: no fake log lines, no markup that breaks the console printer
            who, why = printable(device, 64), printable(reason, 300)
            # marked as the echo of the "rejected" event: a console that prints the event drops this line
            log.warning("rejected from %s: %s", who, why, extra={"edgefl_event": "rejected"})
            self.on_event("rejected", {"device": who, "reason": why})
        return loud

    def refuse(self, device: str, env: Envelope | None, reason: str, reply_to: str | None = None,
               round_no: int | None = None) -> None:
        """Refuse: counted, logged (bounded) and, to a device of this federation, a nack that
        answers the message's id (and names its round) whenever its header parsed."""
        self.count(device, reason)
        if device not in self.known:
            return
        extra: dict[str, Any] = {"reason": reason[:500]}
        if env is not None:
            reply_to, round_no = answerable_id(env.header()), env.round
            if env.type == "chunk":
                missing = self.reassembler.missing(device, env.extra["chunk"]["upload_id"])
                if missing:
                    extra["missing"] = missing
        nack = Envelope("nack", self.federation, round_no if round_no is not None else self.model_version, "server",
                        reply_to=reply_to, model_version=self.model_version, extra=extra)
        self.transport.send(device, pack(nack))
