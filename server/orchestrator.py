"""The round loop, written once: a method's server half over any transport.

A simulation runs it over :class:`edgefl.sim.network.InMemoryNetwork` (the device loops in this
process, a virtual clock); ``edgefl server`` runs it over MQTT. Everything else is the same code:

* a round: select devices, announce the round, send every selected device its download, then
  take uploads until every selected device has reported, or until the deadline when a quorum
  has reported. A round that misses its quorum is extended once by ``grace_s`` when configured,
  else closed as failed (its uploads discarded);
* every upload is checked cheapest first (size, envelope, header, sender = channel, federation,
  round, body hash, decode without pickle with a size cap, the kinds the method's spec declares,
  then the method's own checks) and answered: ``ack`` (accepted, duplicate or late) or ``nack``
  with the reason. Nothing a device sends can stop the loop;
* evaluation (:mod:`edgefl.server.evaluation`), one metrics record per round, the server half's
  state saved after every round (``--resume`` continues from it), the run's summary.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgefl.config import RunConfig
from edgefl.errors import PayloadError
from edgefl.messages import RUNNER_KINDS, Message, decode, encode
from edgefl.methods import MethodSpec
from edgefl.safetext import printable
from edgefl.seeding import derive_seed
from edgefl.server.asynchronous import AsyncLoop, traffic_fields
from edgefl.server.enrolment import Enrolment
from edgefl.server.evaluation import Evaluator
from edgefl.server.rejections import Rejections
from edgefl.server.upload_checks import upload_problem
from edgefl.transport.base import Delivery, ServerTransport
from edgefl.transport.chunks import Reassembler, split
from edgefl.transport.envelope import Envelope, answerable_id, pack, tensor_manifest, unpack
from edgefl.transport.topics import is_safe_name

log = logging.getLogger("edgefl.server")
STRANGER_NACK_EVERY_S = 10.0  # at most one nack per unknown device id in this many seconds
MAX_STRANGERS = 1000  # unknown ids remembered for that rate limit

EventSink = Callable[[str, dict[str, Any]], None]


ANNOUNCE_SELECTED_MAX = 100  # larger selections are announced as a count: every device receives the announcement


def _shown(value: Any, limit: int = 64) -> str:
    """A value a device sent, for a reason or a log line: repr escapes what is not printable, and
    at most ``limit`` characters of it are shown."""
    if not isinstance(value, str):
        return repr(value)[:limit]
    return repr(value[:limit]) + ("..." if len(value) > limit else "")


def select_devices(cfg: RunConfig, device_ids: list[str], round_no: int) -> list[str]:
    """This round's participants from ``device_ids`` (the pool): ceil(ratio x pool), or
    per_round x (1 + over_select), drawn from (seed, round)."""
    if not device_ids:
        return []
    k = cfg.fleet.selection_size(len(device_ids))
    if k >= len(device_ids):
        return list(device_ids)
    rng = np.random.default_rng(derive_seed(cfg.seed, "sample", round_no))
    return sorted(rng.choice(device_ids, k, replace=False).tolist())


@dataclass
class RoundState:
    round: int
    selected: list[str]
    started: float  # transport clock
    deadline: float  # transport clock
    reported: dict[str, str] = field(default_factory=dict)  # device -> receipt status
    receipts: dict[str, str] = field(default_factory=dict)  # device -> "status[: reason]"
    rejected: Rejections = field(default_factory=Rejections)
    offline_since: dict[str, float] = field(default_factory=dict)  # selected, unreported devices gone offline
    late: list[str] = field(default_factory=list)
    extended: bool = False
    bytes_up: dict[str, int] = field(default_factory=dict)
    bytes_down: dict[str, int] = field(default_factory=dict)
    bytes_control: int = 0
    downloads: dict[str, Envelope] = field(default_factory=dict)
    accepted_ids: dict[str, str] = field(default_factory=dict)
    train_loss: dict[str, float] = field(default_factory=dict)
    work_s: dict[str, float | None] = field(default_factory=dict)  # virtual seconds of work (simulation)
    target: int = 0  # accepted updates that close the round (0: every selected device)
    accepted: int = 0
    closed_unix: float | None = None  # wall clock when the round stopped taking uploads
    last_accepted_unix: float | None = None  # wall clock of the last upload it counted

    def __post_init__(self) -> None:
        self.chosen = frozenset(self.selected)  # membership tests stay O(1) with thousands selected
        self.target = self.target or len(self.selected)

    @property
    def full(self) -> bool:
        """The round has its target of accepted updates: later uploads are late."""
        return self.accepted >= self.target


class Orchestrator:
    """Plays a config's rounds with ``server`` over ``transport``.

    ``deadline_s`` is in the transport's seconds (virtual in a simulation). ``profiles`` maps
    device ids to their device class, for the virtual clock's per-class summary."""

    def __init__(self, cfg: RunConfig, spec: MethodSpec, server, transport: ServerTransport | None, device_ids: list[str],
                 federation: str, evaluator: Evaluator, *, deadline_s: float, profiles: dict[str, str] | None = None,
                 on_event: EventSink | None = None, enrolment: Enrolment | None = None) -> None:
        self.cfg = cfg
        self.net = cfg.network
        self.spec = spec
        self.server = server
        self.transport: ServerTransport = transport  # type: ignore[assignment]  (None until connect())
        self.device_ids = list(device_ids)
        self._known = set(device_ids)
        self.federation = federation
        self.evaluator = evaluator
        self.deadline_s = deadline_s
        self.profiles = profiles or {}
        self.on_event = on_event or (lambda kind, info: None)
        # a partial upload that is not complete by its round's deadline cannot count in that round: dropped then (without
        # rounds, an asynchronous run keeps it as long as the stale nacks would); network.partial_max_age_s overrides both
        age = self.net.partial_max_age_s or (max(deadline_s, self.net.stale_upload_s) if cfg.mode == "sync" else self.net.partial_age_limit_s())
        self.reassembler = Reassembler(self.net.max_message_bytes, self.net.stale_upload_s, max_partial_bytes=self.net.max_partial_bytes_total,
                                       max_age_s=age)
        self.online: dict[str, bool] = {}
        self.history: list[dict[str, Any]] = []
        self.state: RoundState | None = None
        self.rejections = Rejections()  # the whole run's, bounded
        self.early: dict[str, tuple[Envelope, int]] = {}
        # uploads for the next round are held only just after a restart (the broker delivers what
        # devices queued while the server was down); otherwise an upload for a round that has not
        # started is refused, so nobody can fill a device's slot in advance
        self.accept_early = False
        self._strangers: dict[str, float] = {}  # unknown device id -> when it was last nacked
        # names this run in announcements and downloads (info.run): a device's saved state is used
        # only in the run that saved it, not in a later run of the same config (kept on resume)
        self.run_id = uuid.uuid4().hex[:16]
        self.last_round = 0  # the last round closed (restored on resume)
        self._connects_seen = transport.connects if transport is not None else 0
        self._evaluation: dict[str, float] | None = None  # answers to evaluate requests, while collected
        self._asked: set[str] = set()  # devices sent an evaluate request that is being collected
        self._online_count = 0  # devices whose presence is online (kept with self.online: no scans per message)
        self.async_loop: AsyncLoop | None = AsyncLoop(self) if cfg.mode == "async" else None
        self.stopped_early = False  # should_stop ended the run before its end
        #: devices that bring their own data (data.partition = "devices") join through it; None: the config assigns data
        self.enrolment = enrolment

    def connect(self, transport: ServerTransport) -> None:
        """Run over ``transport`` (a server that restores its state first connects afterwards)."""
        self.transport = transport
        self._connects_seen = transport.connects

    # --- sending ------------------------------------------------------------------------------
    def _send(self, device: str, env: Envelope) -> int:
        pieces = split(env, self.net.chunk_bytes, self.net.chunk_threshold)
        for p in pieces:
            self.transport.send(device, p)
        return sum(len(p) for p in pieces)

    def send_download(self, device: str, number: int, extra: dict[str, Any]) -> tuple[Envelope, int | None, int]:
        """Send ``device`` the server half's download numbered ``number`` (a round, or an
        asynchronous run's download count): (the envelope, its body's bytes or None when the
        method sends nothing, the bytes sent)."""
        down = self.server.downlink(number, device)
        body, codec = (encode(down), "safetensors") if down is not None else (b"", "none")
        env = Envelope("download", self.federation, number, "server", body, model_version=number, codec=codec, extra=extra)
        return env, (len(body) if down is not None else None), self._send(device, env)

    def _reply(self, device: str, to: Envelope, kind: str, **extra: Any) -> None:
        env = Envelope(kind, self.federation, to.round, "server", reply_to=to.message_id,
                       model_version=self._model_version(), extra=extra)
        self.transport.send(device, pack(env))

    def _model_version(self) -> int:
        if self.async_loop is not None:
            return self.async_loop.version
        return self.state.round if self.state else self.last_round

    def announce(self, round_no: int, info: dict[str, Any]) -> None:
        env = Envelope("round", self.federation, round_no, "server", model_version=round_no,
                       extra={"info": {**info, "run": self.run_id, "classes": getattr(self.server, "num_classes", None)}})
        self.transport.announce(pack(env))

    # --- receiving ----------------------------------------------------------------------------
    def handle(self, item: Delivery) -> None:
        """One delivery from the transport. Never raises: every problem, the unforeseen included,
        becomes a nack (when there is someone to answer) and a bounded log line."""
        try:
            self._handle(item)
        except Exception as exc:  # a bug or a case no check foresaw: refuse the message, keep serving
            log.exception("unexpected failure handling a message from %s", printable(item.peer, 64))
            try:
                self._reject(item.peer or "?", None, f"the server could not handle this message ({type(exc).__name__})")
            except Exception:
                log.exception("could not even refuse it")

    def _handle(self, item: Delivery) -> None:
        device = item.peer
        if item.channel == "unknown" or device is None:
            self._reject(str(item.where or device)[:64], None, "message on a topic that belongs to no device")
            return
        if device not in self._known:
            self._stranger(device)
            return
        if item.retained and item.channel == "message":
            # a retained upload is replayed to every (re)subscribing server: never act on one
            self._count(device, "retained message on a device topic; discarded (devices publish with retain = false)")
            return
        if item.channel == "presence":
            self._presence(device, bool(item.online))
            return
        env = self._checked(device, item.payload, None)
        if env is None:
            return
        if env.type == "chunk":
            try:
                whole = self.reassembler.add(env)
            except PayloadError as exc:
                self._reject(device, env, str(exc))
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
            self._reject(device, env, f"devices send uploads, chunks and joins, not {env.type!r}")
            return
        self._upload(device, env, len(item.payload), item.facts)

    def _join(self, device: str, env: Envelope) -> None:
        """A device that brings its own data asks for its task, says it is ready, or declines
        (:mod:`edgefl.server.enrolment`)."""
        if self.enrolment is None:
            self._reject(device, env, "this run's devices train on the share the server's config assigns (data.partition is not "
                                      "\"devices\"): start edgefl client with the run's --config")
            return
        info = env.extra.get("info") if isinstance(env.extra.get("info"), dict) else {}
        stage = info.get("stage")
        if stage == "hello":
            task, problem = self.enrolment.hello(device, info, self.run_id)
            if task is None:
                self._reject(device, env, problem)
                self.on_event("declined", {"device": device, "reason": problem})
                return
            reply = Envelope("task", self.federation, self._model_version(), "server", reply_to=env.message_id,
                             model_version=self._model_version(), extra={"info": {"run": self.run_id, "task": task.to_info()}})
            self.transport.send(device, pack(reply))
        elif stage == "ready":
            problem = self.enrolment.ready_report(device, info)
            if problem:
                self._reject(device, env, problem)
                return
            self._reply(device, env, "ack", status="accepted")
            self.on_event("enrolled", {"device": device, **self.enrolment.devices[device].to_dict()})
        elif stage == "decline":
            reason = self.enrolment.decline(device, info)
            self._count(device, f"declined: {reason}")
            self._reply(device, env, "ack", status="accepted", reason="declined: recorded")
            self.on_event("declined", {"device": device, "reason": reason})
        else:
            self._reject(device, env, "a join's info.stage is hello, ready or decline")

    def _stranger(self, device: str) -> None:
        """A message from a device id outside the config: refused, and answered on its own down
        topic (rate-limited: a stranger cannot make the server flood)."""
        reason = f"device {device[:64]!r} is not in this federation's config"
        self._count(device, reason)
        if not is_safe_name(device):
            return  # not a usable topic name: nobody to answer
        now = self.transport.now()
        if now - self._strangers.get(device, -math.inf) < STRANGER_NACK_EVERY_S:
            return
        if len(self._strangers) >= MAX_STRANGERS:
            self._strangers.clear()
        self._strangers[device] = now
        nack = Envelope("nack", self.federation, self._model_version(), "server", model_version=self._model_version(),
                        extra={"reason": reason})
        self.transport.send(device, pack(nack))

    def _presence(self, device: str, online: bool) -> None:
        was = self.online.get(device, False)
        self.online[device] = online
        if online != was:
            self._online_count += 1 if online else -1
            self.on_event("presence", {"device": device, "online": online})
        if self.async_loop is not None:
            self.async_loop.presence(device, online, was)
            return
        st = self.state
        if st is not None and device in st.chosen and device not in st.reported:
            if online:
                st.offline_since.pop(device, None)
            else:
                st.offline_since.setdefault(device, self.transport.now())
        if online and not was and st is not None and device in st.chosen and device not in st.reported and not st.full:
            # a device that (re)joined mid-round may have missed its download: send it again
            # (the device ignores a second copy of a round it has served)
            self._send(device, st.downloads[device])

    def _checked(self, device: str, data: bytes, carrier: Envelope | None) -> Envelope | None:
        """Unpack and check an envelope's identity; on failure nack (answering ``carrier``, the
        last chunk, when the data came in chunks) and return None."""
        try:
            env = unpack(data, self.net.max_message_bytes)
        except PayloadError as exc:
            self._reject(device, carrier, str(exc), reply_to=exc.message_id, round_no=exc.round_no)
            return None
        if env.sender != device:
            self._reject(device, env, f"sender {env.sender!r} in the header is not the topic's device {device!r}")
            return None
        if env.federation != self.federation:
            self._reject(device, env, f"federation {env.federation!r} is not {self.federation!r}")
            return None
        return env

    def _decoded(self, device: str, env: Envelope) -> Message | None:
        if env.codec != "safetensors":
            self._reject(device, env, f"an upload's codec must be safetensors, not {env.codec!r}")
            return None
        try:
            message = decode(env.body, self.net.max_message_bytes)
        except PayloadError as exc:
            self._reject(device, env, str(exc))
            return None
        differs = [(name, inside, outside) for name, inside, outside in
                   (("sender", message.sender, env.sender), ("round", message.round, env.round), ("message_id", message.message_id, env.message_id))
                   if inside != outside]
        if differs:
            # the first field that differs, both values printable and bounded (they come from the device)
            name, inside, outside = differs[0]
            self._reject(device, env, f"the message inside disagrees with its envelope: {name} {_shown(inside)} inside, "
                                      f"{_shown(outside)} in the envelope")
            return None
        declared = env.extra.get("tensors")
        if declared is not None and declared != tensor_manifest(message.tensors):
            self._reject(device, env, "the body's tensors (dtype or shape) differ from the header's 'tensors' manifest")
            return None
        if message.kind not in self.spec.uploads and message.kind not in RUNNER_KINDS:
            self._reject(device, env, f"{self.spec.name} devices upload {' or '.join(self.spec.uploads)}, not {message.kind!r}")
            return None
        problem = self._sanity(message, env)
        if problem:
            self._reject(device, env, problem)
            return None
        return message

    def _upload(self, device: str, env: Envelope, size: int, facts: dict[str, Any]) -> None:
        message = self._decoded(device, env)
        if message is None:
            return
        if message.kind == "evaluation":
            self._evaluation_answer(device, env, message)
            return
        if self.async_loop is not None:
            self.async_loop.upload(device, env, message, size, facts)
            return
        st = self.state
        current = st.round if st else self.last_round
        if message.round > current:
            if self.accept_early and message.round <= self.cfg.rounds and message.round == current + 1:
                # early: after a server restart, uploads queued in the broker can arrive before the
                # round reopens; hold one per device and use it when the round starts
                self.early[device] = (env, size)
                return
            self._reject(device, env, f"round {message.round} has not started (current {current})")
            return
        if message.round < 1:
            self._reject(device, env, "rounds start at 1")
            return
        closed = st is None or st.full
        if not self.spec.asynchronous and (st is None or (st.full and message.round == current)):
            # between rounds (or once the round has its target) a synchronous server must not hold
            # anything: it would count in the next round
            why = "is closed" if st is None else f"closed with its target of {st.target} updates"
            self._reply(device, env, "ack", status="late", reason=f"round {message.round} {why}; not used")
            if st is not None:
                st.late.append(device)
                st.receipts.setdefault(device, "late: after the round reached its target")
            self.on_event("late", {"device": device, "round": message.round, "status": "late"})
            return
        if st is not None and message.round == current and device not in st.chosen:
            self._reject(device, env, f"{device} is not selected in round {current}")
            return
        if st is not None and message.round == current and st.reported.get(device) == "accepted" \
                and message.message_id != st.accepted_ids.get(device):
            self._reject(device, env, f"one accepted update per device per round: {device} already has one in round {current}")
            return
        receipt_status, reason = self._server_receipt(device, message)
        if receipt_status == "rejected":
            self._reject(device, env, reason)
            return
        if receipt_status == "accepted" and closed and message.round == current:
            # an asynchronous method keeps knowledge that comes after its round closed, but the
            # round's count does not change: the device hears "late"
            receipt_status, reason = "late", f"round {message.round} closed; kept for the next rounds"
        self._reply(device, env, "ack", status=receipt_status, **({"reason": reason} if reason else {}))
        if message.meta.get("eval_accuracy") is not None and receipt_status != "duplicate":
            self.evaluator.device_reported(device, message.meta["eval_accuracy"])
        if st is None:
            return
        if receipt_status == "duplicate" and message.round < current:
            return  # a replay of an upload already counted in its own round
        if message.round < current or receipt_status == "late" or closed:
            st.late.append(device)
            if message.round == current:
                st.receipts.setdefault(device, f"late: {reason}" if reason else "late")
            self.on_event("late", {"device": device, "round": message.round, "status": receipt_status})
            return
        if receipt_status == "accepted" or device not in st.reported:
            st.reported[device] = receipt_status
            st.receipts[device] = receipt_status if not reason else f"{receipt_status}: {reason}"
            if receipt_status == "accepted":
                st.accepted_ids[device] = message.message_id
                st.accepted += 1
                st.last_accepted_unix = time.time()
            if not message.tensors:  # a report with nothing to share (local-only's status) is control traffic
                st.bytes_control += size
            else:
                st.bytes_up[device] = st.bytes_up.get(device, 0) + len(env.body)
            if message.meta.get("train_loss") is not None:
                st.train_loss[device] = round(float(message.meta["train_loss"]), 6)
            if "work_s" in facts:
                st.work_s[device] = facts["work_s"]
            self.on_event("upload", {"device": device, "round": current, "status": receipt_status})

    def _server_receipt(self, device: str, message: Message) -> tuple[str, str]:
        try:
            receipt = self.server.receive(message)
        except Exception as exc:  # a method's check that raised instead of answering: still a nack
            log.exception("server half raised on %s's upload", device)
            return "rejected", f"server could not use the upload: {type(exc).__name__}: {exc}"
        return receipt.status, receipt.reason

    def _sanity(self, message: Message, env: Envelope) -> str | None:
        """Method-independent checks of a decoded upload (:mod:`edgefl.server.upload_checks`)."""
        if env.model_version != message.round:
            return f"model version {env.model_version} does not match round {message.round}"
        return upload_problem(message, getattr(self.server, "num_classes", None), self.net.max_abs_value, self.cfg.max_epochs())

    def _count(self, device: str, reason: str) -> bool:
        """Count a refusal in the round's and the run's bounded summaries; True when it is to be
        logged in full (the first few of a round, then a sample)."""
        bucket = self.state.rejected if self.state is not None else (self.async_loop.window.rejected if self.async_loop else None)
        loud = bucket.add(device, reason) if bucket is not None else True
        self.rejections.add(device, reason)
        if loud:
            # ids and reasons quote the network: no fake log lines, no markup that breaks the console printer
            who, why = printable(device, 64), printable(reason, 300)
            log.warning("rejected from %s: %s", who, why)
            self.on_event("rejected", {"device": who, "reason": why})
        return loud

    def _reject(self, device: str, env: Envelope | None, reason: str, reply_to: str | None = None,
                round_no: int | None = None) -> None:
        """Refuse: counted, logged (bounded) and, to a device of this federation, a nack that
        answers the message's id (and names its round) whenever its header parsed."""
        self._count(device, reason)
        if device not in self._known:
            return
        extra: dict[str, Any] = {"reason": reason[:500]}
        if env is not None:
            reply_to, round_no = answerable_id(env.header()), env.round
            if env.type == "chunk":
                missing = self.reassembler.missing(device, env.extra["chunk"]["upload_id"])
                if missing:
                    extra["missing"] = missing
        nack = Envelope("nack", self.federation, round_no if round_no is not None else self._model_version(), "server",
                        reply_to=reply_to, model_version=self._model_version(), extra=extra)
        self.transport.send(device, pack(nack))

    def _check_reconnect(self) -> None:
        """After the server's own reconnect (a broker restart) presence is unknown again: the next
        "online" of a selected device that has not reported re-sends its download (the broker may
        have lost it)."""
        if self.transport.connects != self._connects_seen:
            self._connects_seen = self.transport.connects
            self.online = {}
            self._online_count = 0
            self.on_event("reconnected", {"connects": self._connects_seen})

    def _pump(self, timeout_s: float) -> None:
        item = self.transport.receive(timeout_s)
        self._check_reconnect()
        if item is not None:
            self.handle(item)
        for device, upload_id, missing, dropped in self.reassembler.collect_stale():
            shown = printable(upload_id, 64)  # the device chose this id: "[/]" or a newline must not reach the console as such
            reason = ((f"partial upload {shown} dropped (no progress after repeated stale nacks, or not complete within "
                       f"network.partial_max_age_s); resend every chunk") if dropped
                      else f"partial upload {shown} went stale; resend the missing chunks")
            self._count(device, reason)
            env = Envelope("nack", self.federation, self._model_version(), "server", reply_to=upload_id,
                           model_version=self._model_version(), extra={"reason": reason, "missing": missing})
            self.transport.send(device, pack(env))

    # --- rounds -------------------------------------------------------------------------------
    def wait_for_devices(self, timeout_s: float, should_stop: Callable[[], bool] = lambda: False) -> list[str]:
        """Before the first round: announce this run (replacing the retained end of an earlier
        run of the same federation, which devices would otherwise read as "done"), then wait until
        every device is online (its subscription exists, so its downloads are queued for it from
        now on) or the timeout passes; returns who is missing."""
        self.announce(self.last_round, {"selected": [], "selected_count": 0, "target": 0, "deadline_unix": time.time(),
                                        "rounds": self.cfg.rounds, "done": False,
                                        **({"mode": "async"} if self.async_loop is not None else {})})  # section 6.1, 6.8
        end = self.transport.now() + timeout_s
        # an asynchronous run starts with the first device: the others join when they come
        enough = 1 if self.async_loop is not None else len(self.device_ids)
        while self.transport.now() < end and self._joined() < enough and not should_stop():
            item = self.transport.receive(min(end - self.transport.now(), 0.5))
            if item is not None:
                self.handle(item)
        if self.enrolment is not None:
            ready = set(self.enrolment.ready())
            missing = [d for d in self.device_ids if d not in ready]
            declined = self.enrolment.declined()
            self.on_event("joined", {"online": len(ready), "missing": [d for d in missing if d not in declined], "declined": declined})
            return missing
        missing = [d for d in self.device_ids if not self.online.get(d)]
        self.on_event("joined", {"online": len(self.device_ids) - len(missing), "missing": missing})
        return missing

    def can_take_part(self, device: str) -> bool:
        """Online and, when devices bring their own data, ready."""
        return bool(self.online.get(device)) and (self.enrolment is None or self.enrolment.is_ready(device))

    def _joined(self) -> int:
        """Devices nobody needs to wait for before round 1: online ones, or with device-held data
        those that are ready or declined."""
        return self._online_count if self.enrolment is None else self.enrolment.settled()

    def is_eval_round(self, r: int) -> bool:
        return r % self.cfg.eval.every == 0 or r == self.cfg.rounds

    def run_round(self, r: int) -> dict[str, Any]:
        wall0 = time.perf_counter()
        selected = select_devices(self.cfg, self._pool(), r)
        self.server.begin_round(r)
        now = self.transport.now()
        evaluate = self.is_eval_round(r)
        st = self.state = RoundState(r, selected, now, now + self.deadline_s, target=self.cfg.fleet.target(len(selected)))
        # every device receives the announcement: thousands of ids would multiply into megabytes
        # per round, so a large selection is announced as a count (each device learns from its download)
        listed = {"selected": selected} if len(selected) <= ANNOUNCE_SELECTED_MAX else {}
        self.announce(r, {**listed, "selected_count": len(selected), "target": st.target,
                          "deadline_unix": time.time() + self.deadline_s, "rounds": self.cfg.rounds, "done": False})
        # devices judge their own models only when no global model will judge them
        info = {"info": {"run": self.run_id, **({"evaluate": True} if evaluate and self.evaluator.devices_report(self.server) else {})}}
        for device in selected:
            st.downloads[device], body_bytes, sent = self.send_download(device, r, info)
            if body_bytes is not None:
                st.bytes_down[device] = body_bytes
            else:
                st.bytes_control += sent
        self.on_event("round", {"round": r, "selected": selected, "deadline_unix": time.time() + self.deadline_s})
        for device, (early, size) in sorted(self.early.items()):
            if early.round == r:
                self._upload(device, early, size, {})
        self.early = {}
        self.accept_early = False
        outcome = self._collect(st)
        st.closed_unix = time.time()
        if outcome == "failed":
            self.server.discard_round(r)
            server_record: dict[str, Any] = {"failed": True}
        else:
            server_record = self.server.close_round(r)
        closed = self.transport.now()
        train_time = time.perf_counter() - wall0
        self._note_stragglers(st)
        self.state = None
        self.last_round = r
        accuracy, eval_time = None, 0.0
        if outcome != "failed" and evaluate:
            self.on_event("evaluating", {"round": r})
            t1 = time.perf_counter()
            accuracy = self.evaluate(r)
            eval_time = time.perf_counter() - t1
        record = self._record(st, outcome, server_record, accuracy, closed - st.started, train_time, eval_time,
                              time.perf_counter() - wall0)
        self.history.append(record)
        self.on_event("closed", record)
        return record

    def _pool(self) -> list[str]:
        """Who a round selects from: every device, or with ``fleet.per_round`` those online (all
        of them when none is: downloads wait in the broker for devices with a session)."""
        pool = self.device_ids if self.enrolment is None else self.enrolment.ready()  # devices with their own data: once ready
        if self.cfg.fleet.per_round is None:
            return pool
        online = [d for d in pool if self.online.get(d)]
        return online or pool

    def _collect(self, st: RoundState) -> str:
        if not st.selected:  # no device can take part (with device-held data: none is ready)
            return "failed"
        quorum = self.net.quorum_count(st.target)
        for device in st.selected:  # offline when the round starts: the grace counts from now
            if self.online.get(device) is False:
                st.offline_since[device] = self.transport.now()
        while True:
            if st.full or len(st.reported) >= len(st.selected):
                return "complete"
            remaining = st.deadline - self.transport.now()
            if self._all_gone(st):
                remaining = 0
                self.on_event("all_offline", {"round": st.round, "offline": sorted(st.offline_since)})
                st.extended = True  # no grace either: nobody is left to report
            if remaining <= 0:
                if len(st.reported) >= quorum:
                    return "deadline"
                if self.net.grace_s > 0 and not st.extended:
                    st.extended = True
                    st.deadline += self.net.grace_s
                    self.on_event("extended", {"round": st.round, "reported": len(st.reported), "quorum": quorum})
                    continue
                return "failed"
            self._pump(min(remaining, 1.0))

    def _all_gone(self, st: RoundState) -> bool:
        """Every selected device that has not reported has been offline for ``offline_grace_s``:
        nobody is left to wait for. (A refused upload does not count: the device may send a good
        one, and a forged refusal must not end a device's round.)"""
        if len(st.offline_since) < len(st.selected) - len(st.reported):
            return False  # someone who has not reported is online: no need to look (O(1) per message)
        waiting = [d for d in st.selected if d not in st.reported]
        now = self.transport.now()
        return len(st.reported) < len(st.selected) and all(
            now - st.offline_since.get(d, math.inf) >= self.net.offline_grace_s for d in waiting)

    def _note_stragglers(self, st: RoundState) -> None:
        """Selected devices whose work is known to be still under way when the round closed (only
        a simulated network knows): stragglers, with their virtual time."""
        for device, (round_no, work_s) in self.transport.in_flight().items():
            if round_no == st.round and device in st.chosen and device not in st.reported:
                st.work_s[device] = work_s
                over = f"{work_s:.1f} s > {self.deadline_s:g} s deadline" if work_s is not None else "after the deadline"
                st.receipts[device] = f"dropped: straggler ({over})"

    # --- evaluation ---------------------------------------------------------------------------
    def evaluate(self, r: int) -> dict[str, Any] | None:
        """Accuracy after round ``r``: global models judged here where the server can; devices
        asked to judge the global model on their own data where it cannot (their own test split
        or feature space); otherwise the accuracies devices reported with their uploads."""
        targets = self.evaluator.personal_targets(self.server)
        if self.enrolment is not None:  # only devices that are ready can answer
            ready = set(self.enrolment.ready())
            targets = [t for t in targets if t in ready]
        answers: dict[str, float] = {}
        if targets:
            answers = self._ask_devices(r, targets)
        return self.evaluator.evaluate(self.server, answers)

    def _ask_devices(self, r: int, targets: list[str], with_model: bool = True) -> dict[str, float]:
        """Send ``targets`` an evaluate request (carrying what a download of round r + 1 would,
        or nothing: judge the model you hold) and collect their accuracies until the deadline."""
        self._evaluation = {}
        self._asked = set(targets)
        for device in targets:
            down = self.server.downlink(r + 1, device) if with_model else None
            body, codec = (encode(down), "safetensors") if down is not None else (b"", "none")
            self._send(device, Envelope("evaluate", self.federation, r, "server", body, model_version=r, codec=codec,
                                        extra={"info": {"run": self.run_id}}))
        deadline = self.transport.now() + self.deadline_s
        while set(self._evaluation) < set(targets) and self.transport.now() < deadline:
            self._pump(min(deadline - self.transport.now(), 1.0))
        answers, self._evaluation = self._evaluation, None
        return answers

    def _evaluation_answer(self, device: str, env: Envelope, message: Message) -> None:
        if self._evaluation is None or device not in self._asked:
            self._reply(device, env, "ack", status="late", reason="no evaluation is being collected; not used")
            return
        accuracy = message.meta.get("eval_accuracy")
        if accuracy is None:
            self._reject(device, env, "an evaluation carries meta.eval_accuracy")
            return
        self._reply(device, env, "ack", status="accepted")
        self._evaluation[device] = float(accuracy)

    # --- records ------------------------------------------------------------------------------
    def _record(self, st: RoundState, outcome: str, server_record: dict[str, Any], accuracy: dict[str, Any] | None,
                clock_s: float, train_s: float, eval_s: float, wall_s: float) -> dict[str, Any]:
        missing = sorted(set(st.selected) - set(st.reported))
        unheard = "missing: the round reached its target first" if st.full else "missing: no upload by the deadline"
        receipts = {d: st.receipts.get(d, unheard) for d in st.selected}
        record: dict[str, Any] = {
            "round": st.round,
            "outcome": outcome,
            "selected": st.selected,
            "target": st.target,
            "accepted": st.accepted,
            "closed_unix": st.closed_unix,
            "last_accepted_unix": st.last_accepted_unix,
            "reported": sorted(st.reported),
            "missing": missing,
            "late": st.late,
            "rejected": st.rejected.summary(),
            "extended": st.extended,
            "receipts": receipts,
            **traffic_fields(st.bytes_up, st.bytes_down, st.bytes_control, st.train_loss),
            "accuracy": accuracy,
            "server": server_record,
            "round_time_s": round(wall_s, 4),
            "train_time_s": round(train_s, 4),
            "eval_time_s": round(eval_s, 4),
        }
        if self.transport.virtual_clock and any(d in self.profiles for d in st.selected):
            self._clock_record(record, st, clock_s)
        return record

    def _clock_record(self, record: dict[str, Any], st: RoundState, clock_s: float) -> None:
        times = {d: (None if st.work_s.get(d) is None else round(st.work_s[d], 4)) for d in st.selected if d in self.profiles}
        stragglers = sorted(d for d in st.selected if d not in st.reported and d in st.work_s)
        by_profile: dict[str, list[float]] = {}
        for device, t in times.items():
            if t is not None:
                by_profile.setdefault(self.profiles[device], []).append(t)
        finished = [t for d, t in times.items() if t is not None and d not in stragglers]
        record.update({
            "virtual_time_s": times,
            "virtual_time_by_profile": {k: round(statistics.fmean(v), 4) for k, v in sorted(by_profile.items())},
            "stragglers": stragglers,
            "round_virtual_s": round(clock_s, 4) if stragglers else (max(finished) if finished else None),
        })

    def _drain(self, quiet_s: float = 0.5, max_s: float = 5.0) -> None:
        """Before announcing the end: answer what is still arriving (late), until the network has
        been quiet for ``quiet_s`` (at most ``max_s``), so no upload that reached the server goes
        unanswered; over-selected devices of the last round report after it closed."""
        if self.transport.virtual_clock:
            return  # the simulation's devices have nothing in flight that is not already queued
        end = time.monotonic() + max_s
        while time.monotonic() < end:
            item = self.transport.receive(quiet_s)
            if item is None:
                return
            self.handle(item)

    # --- the whole run ------------------------------------------------------------------------
    def run(self, first_round: int = 1, after_round: Callable[[dict[str, Any]], None] | None = None,
            should_stop: Callable[[], bool] = lambda: False) -> list[dict[str, Any]]:
        """Play rounds ``first_round`` .. ``cfg.rounds`` (``after_round``: called with each record,
        to write it and save the state), then announce that the run is done. ``should_stop`` is
        asked between rounds: a stopped run is not announced as done (it can be resumed).
        With ``mode = "async"`` the run is :class:`~edgefl.server.asynchronous.AsyncLoop`'s."""
        if self.async_loop is not None:
            if not self.async_loop.run(after_round, should_stop):
                self.stopped_early = True
                return self.history
            self._drain()
            self.announce(self.last_round, {"done": True, "rounds": self.cfg.rounds, "mode": "async"})
            return self.history
        for r in range(first_round, self.cfg.rounds + 1):
            if should_stop():
                self.on_event("stopped", {"after_round": r - 1})
                self.stopped_early = True
                return self.history
            record = self.run_round(r)
            if after_round is not None:
                after_round(record)
        self._drain()
        self.announce(self.cfg.rounds, {"done": True, "rounds": self.cfg.rounds})
        return self.history
