"""The fleet server: runs a method's server half over MQTT, round by round, and never hangs.

A round: announce it (retained), send every selected device its download, then take uploads
until every selected device has reported, or until the deadline when a quorum has reported. A
round that misses its quorum is extended once by ``grace_s`` when configured, else closed as
failed (its uploads discarded) and reported. Every upload is checked cheapest first (size,
envelope, header, topic = sender, federation, round, body hash, decode without pickle with a size
cap, then the method's own checks) and answered: ``ack`` (accepted, duplicate or late) or
``nack`` with the reason. Nothing a device sends can stop the loop.

Evaluation mirrors the simulation: global models are judged here on the shared test set; a
method without global models is judged by the accuracies the devices measure on the same test
set after training and report in their upload's ``meta.eval_accuracy``.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from edgefl.algorithms.training import evaluate_accuracy
from edgefl.config import RunConfig
from edgefl.errors import PayloadError
from edgefl.messages import decode, encode
from edgefl.sim.setup import sample_clients
from edgefl.transport.chunks import Reassembler, split
from edgefl.transport.envelope import Envelope, pack, tensor_manifest, unpack
from edgefl.transport.link import Link
from edgefl.transport.topics import Topics

log = logging.getLogger("edgefl.server")
MAX_SAMPLES = 10**9


@dataclass
class RoundState:
    round: int
    selected: list[str]
    deadline: float  # monotonic
    deadline_unix: float
    reported: dict[str, str] = field(default_factory=dict)  # device -> receipt status
    rejected: dict[str, list[str]] = field(default_factory=dict)
    late: list[str] = field(default_factory=list)
    extended: bool = False
    bytes_up: dict[str, int] = field(default_factory=dict)
    bytes_down: dict[str, int] = field(default_factory=dict)
    downloads: dict[str, Envelope] = field(default_factory=dict)
    accepted_ids: dict[str, str] = field(default_factory=dict)
    train_loss: dict[str, float] = field(default_factory=dict)


class FleetServer:
    """``run()`` plays ``cfg.rounds`` rounds over ``link`` and returns the history."""

    def __init__(self, cfg: RunConfig, server, device_ids: list[str], link: Link, x_test=None, y_test=None,
                 on_event: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        self.cfg = cfg
        self.net = cfg.network
        self.server = server
        self.device_ids = device_ids
        self.link = link
        self.topics = Topics(self.net.federation or cfg.name)
        self.x_test, self.y_test = x_test, y_test
        self.reassembler = Reassembler(self.net.max_message_bytes, self.net.stale_upload_s)
        self.online: dict[str, bool] = {}
        self.device_accuracy: dict[str, float] = {}
        self.history: list[dict[str, Any]] = []
        self.state: RoundState | None = None
        self.on_event = on_event or (lambda kind, info: None)
        self.rejections: list[tuple[str, str]] = []  # (device, reason), every one
        self.early: dict[str, tuple[Envelope, int]] = {}
        self.last_round = 0  # the last round closed (restored on resume)
        self._connects_seen = link.connect_count

    # --- sending ------------------------------------------------------------------------------
    def _send(self, device: str, env: Envelope) -> int:
        pieces = split(env, self.net.chunk_bytes, self.net.chunk_threshold)
        for p in pieces:
            self.link.publish(self.topics.down(device), p)
        return sum(len(p) for p in pieces)

    def _reply(self, device: str, to: Envelope, kind: str, **extra: Any) -> None:
        env = Envelope(kind, self.topics.federation, to.round, "server", reply_to=to.message_id,
                       model_version=self._model_version(), extra=extra)
        self.link.publish(self.topics.down(device), pack(env))

    def _model_version(self) -> int:
        return self.state.round if self.state else 0

    def announce(self, round_no: int, info: dict[str, Any]) -> None:
        env = Envelope("round", self.topics.federation, round_no, "server", model_version=round_no, extra={"info": info})
        self.link.publish(self.topics.rounds, pack(env), retain=True)

    # --- receiving ----------------------------------------------------------------------------
    def handle(self, topic: str, payload: bytes) -> None:
        """One incoming MQTT message. Never raises: every problem becomes a logged nack."""
        device = self.topics.device_of(topic)
        if topic == self.topics.presence("server"):
            return  # our own retained presence
        if device is None or device not in self.device_ids:
            self._reject(device or topic, None, f"message on an unknown topic or from an unknown device ({topic})")
            return
        if topic == self.topics.presence(device):
            was = self.online.get(device, False)
            self.online[device] = payload == b"online"
            if self.online[device] != was:
                self.on_event("presence", {"device": device, "online": self.online[device]})
            st = self.state
            if self.online[device] and not was and st is not None and device in st.selected and device not in st.reported:
                # a device that (re)joined mid-round may have missed its download: send it again
                # (the device ignores a second copy of a round it has served)
                self._send(device, st.downloads[device])
            return
        env = self._checked(device, payload, None)
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
        if env.type != "upload":
            self._reject(device, env, f"devices send uploads and chunks, not {env.type!r}")
            return
        self._upload(device, env, len(payload))

    def _checked(self, device: str, data: bytes, carrier: Envelope | None) -> Envelope | None:
        """Unpack and check an envelope's identity; on failure nack (answering ``carrier``, the
        last chunk, when the data came in chunks) and return None."""
        try:
            env = unpack(data, self.net.max_message_bytes)
        except PayloadError as exc:
            self._reject(device, carrier, str(exc))
            return None
        if env.sender != device:
            self._reject(device, env, f"sender {env.sender!r} in the header is not the topic's device {device!r}")
            return None
        if env.federation != self.topics.federation:
            self._reject(device, env, f"federation {env.federation!r} is not {self.topics.federation!r}")
            return None
        return env

    def _upload(self, device: str, env: Envelope, size: int) -> None:
        st = self.state
        if env.codec != "safetensors":
            self._reject(device, env, f"an upload's codec must be safetensors, not {env.codec!r}")
            return
        try:
            message = decode(env.body, self.net.max_message_bytes)
        except PayloadError as exc:
            self._reject(device, env, str(exc))
            return
        if message.sender != device or message.round != env.round or message.message_id != env.message_id:
            self._reject(device, env, "the message inside disagrees with its envelope (sender, round or id)")
            return
        declared = env.extra.get("tensors")
        if declared is not None and declared != tensor_manifest(message.tensors):
            self._reject(device, env, "the body's tensors (dtype or shape) differ from the header's 'tensors' manifest")
            return
        problem = self._sanity(message, env)
        if problem:
            self._reject(device, env, problem)
            return
        current = st.round if st else self.last_round
        if message.round > current:
            if message.round <= self.cfg.rounds and message.round == current + 1:
                # early: after a server restart, uploads queued in the broker can arrive before the
                # round reopens; hold one per device and use it when the round starts
                self.early[device] = (env, size)
                return
            self._reject(device, env, f"round {message.round} has not started (current {current})")
            return
        if message.round < 1:
            self._reject(device, env, "rounds start at 1")
            return
        if st is None and not self.server.asynchronous:
            # between rounds a synchronous server must not hold anything: it would count in the next round
            self._reply(device, env, "ack", status="late", reason=f"round {message.round} is closed; not used")
            self.on_event("late", {"device": device, "round": message.round, "status": "late"})
            return
        if st is not None and message.round == current and device not in st.selected:
            self._reject(device, env, f"{device} is not selected in round {current}")
            return
        if st is not None and message.round == current and st.reported.get(device) == "accepted" \
                and message.message_id != st.accepted_ids.get(device):
            self._reject(device, env, f"one accepted update per device per round: {device} already has one in round {current}")
            return
        try:
            receipt = self.server.receive(message)
        except Exception as exc:  # a method's check that raised instead of answering: still a nack
            log.exception("server half raised on %s's upload", device)
            receipt = None
            reason = f"server could not use the upload: {type(exc).__name__}: {exc}"
        if receipt is None or not receipt.ok:
            self._reject(device, env, receipt.reason if receipt is not None else reason)
            return
        self._reply(device, env, "ack", status=receipt.status, **({"reason": receipt.reason} if receipt.reason else {}))
        if st is None:
            return
        if message.round < current or receipt.status == "late":
            st.late.append(device)
            self.on_event("late", {"device": device, "round": message.round, "status": receipt.status})
            return
        if receipt.status == "accepted" or device not in st.reported:
            st.reported[device] = receipt.status
            if receipt.status == "accepted":
                st.accepted_ids[device] = message.message_id
            st.bytes_up[device] = st.bytes_up.get(device, 0) + size
            if message.meta.get("train_loss") is not None:
                st.train_loss[device] = float(message.meta["train_loss"])
            if isinstance(message.meta.get("eval_accuracy"), float):
                self.device_accuracy[device] = message.meta["eval_accuracy"]
            self.on_event("upload", {"device": device, "round": current, "status": receipt.status})

    def _sanity(self, message, env: Envelope) -> str | None:
        """Method-independent checks of a decoded upload: model version, sample count, values."""
        if env.model_version != message.round:
            return f"model version {env.model_version} does not match round {message.round}"
        n = message.meta.get("num_samples")
        if not isinstance(n, int) or isinstance(n, bool) or not 0 < n <= MAX_SAMPLES:
            return f"num_samples must be an integer in 1..{MAX_SAMPLES}, got {n!r}"
        for name, t in message.tensors.items():
            if t.is_floating_point() and t.numel():
                if not bool(torch.isfinite(t).all()):
                    return f"{name} holds NaN or Inf"
                if float(t.abs().max()) > self.net.max_abs_value:
                    return f"{name} holds values beyond +-{self.net.max_abs_value:g}"
        return None

    def _reject(self, device: str, env: Envelope | None, reason: str) -> None:
        log.warning("rejected from %s: %s", device, reason)
        self.rejections.append((device, reason))
        if self.state is not None:
            self.state.rejected.setdefault(device, []).append(reason)
        self.on_event("rejected", {"device": device, "reason": reason})
        if device not in self.device_ids:
            return
        if env is None:
            # nothing to reply to (the envelope did not parse): the nack still tells the device why
            nack = Envelope("nack", self.topics.federation, self.state.round if self.state else 0, "server",
                            model_version=self._model_version(), extra={"reason": reason[:500]})
            self.link.publish(self.topics.down(device), pack(nack))
            return
        missing = []
        if env.type == "chunk":
            missing = self.reassembler.missing(device, env.extra["chunk"]["upload_id"])
        self._reply(device, env, "nack", reason=reason[:500], **({"missing": missing} if missing else {}))

    def _check_reconnect(self) -> None:
        """After the server's own reconnect (a broker restart) presence is unknown again: the next
        "online" of a selected device that has not reported re-sends its download (the broker may
        have lost it)."""
        if self.link.connect_count != self._connects_seen:
            self._connects_seen = self.link.connect_count
            self.online = {}
            self.on_event("reconnected", {"connects": self._connects_seen})

    # --- rounds -------------------------------------------------------------------------------
    def wait_for_devices(self, timeout_s: float) -> list[str]:
        """Before the first round: wait until every device is online (its subscription exists, so
        its downloads are queued for it from now on) or the timeout passes; returns who is missing."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end and not all(self.online.get(d) for d in self.device_ids):
            item = self.link.get(min(end - time.monotonic(), 0.5))
            if item is not None:
                self.handle(item.topic, item.payload)
        missing = [d for d in self.device_ids if not self.online.get(d)]
        self.on_event("joined", {"online": len(self.device_ids) - len(missing), "missing": missing})
        return missing

    def run_round(self, r: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        selected = sample_clients(self.cfg, self.device_ids, r)
        self.server.begin_round(r)
        now = time.time()
        st = self.state = RoundState(r, selected, time.monotonic() + self.net.round_deadline_s, now + self.net.round_deadline_s)
        self.announce(r, {"selected": selected, "deadline_unix": st.deadline_unix, "rounds": self.cfg.rounds, "done": False})
        for device in selected:
            down = self.server.downlink(r, device)
            body, codec = (encode(down), "safetensors") if down is not None else (b"", "none")
            env = st.downloads[device] = Envelope("download", self.topics.federation, r, "server", body, model_version=r, codec=codec)
            st.bytes_down[device] = self._send(device, env)
        self.on_event("round", {"round": r, "selected": selected})
        for device, (early, size) in sorted(self.early.items()):
            if early.round == r:
                self._upload(device, early, size)
        self.early = {}
        outcome = self._collect(st)
        if outcome == "failed":
            self.server.discard_round(r)
            server_record: dict[str, Any] = {"failed": True}
        else:
            server_record = self.server.close_round(r)
        record = self._record(st, outcome, server_record, time.perf_counter() - t0)
        self.history.append(record)
        self.on_event("closed", record)
        self.state = None
        self.last_round = r
        return record

    def _collect(self, st: RoundState) -> str:
        quorum = self.net.quorum_count(len(st.selected))
        while True:
            if all(d in st.reported for d in st.selected):
                return "complete"
            remaining = st.deadline - time.monotonic()
            if remaining <= 0:
                if len(st.reported) >= quorum:
                    return "deadline"
                if self.net.grace_s > 0 and not st.extended:
                    st.extended = True
                    st.deadline += self.net.grace_s
                    self.on_event("extended", {"round": st.round, "reported": len(st.reported), "quorum": quorum})
                    continue
                return "failed"
            item = self.link.get(min(remaining, 1.0))
            self._check_reconnect()
            if item is not None:
                self.handle(item.topic, item.payload)
            for device, upload_id, missing in self.reassembler.collect_stale():
                reason = f"partial upload {upload_id} went stale; missing chunks {missing[:10]}"
                self._reject(device, None, reason)
                env = Envelope("nack", self.topics.federation, st.round, "server", reply_to=upload_id,
                               extra={"reason": reason, "missing": missing})
                self.link.publish(self.topics.down(device), pack(env))

    def _record(self, st: RoundState, outcome: str, server_record: dict[str, Any], wall: float) -> dict[str, Any]:
        evaluate = outcome != "failed" and (st.round % self.cfg.eval.every == 0 or st.round == self.cfg.rounds)
        return {
            "round": st.round,
            "outcome": outcome,
            "selected": st.selected,
            "reported": sorted(st.reported),
            "missing": sorted(set(st.selected) - set(st.reported)),
            "late": st.late,
            "rejected": st.rejected,
            "extended": st.extended,
            "bytes_up": sum(st.bytes_up.values()),
            "bytes_down": sum(st.bytes_down.values()),
            "train_loss": st.train_loss,
            "server": server_record,
            "accuracy": self.evaluate() if evaluate else None,
            "round_time_s": round(wall, 4),
        }

    def evaluate(self) -> dict[str, Any] | None:
        """Global models judged here; otherwise the devices' own reported accuracies."""
        globals_ = self.server.global_models()
        per_arch: dict[str, float] = {}
        per_client: dict[str, float] = {}
        if globals_ and self.x_test is not None:
            for arch, state in globals_.items():
                model = self.server.build_global(arch)
                model.load_state_dict(state)
                per_arch[arch] = evaluate_accuracy(model, self.x_test, self.y_test, self.cfg.eval.batch_size)
            for device in self.device_ids:
                arch = self.server.clients[device].arch
                if arch in per_arch:
                    per_client[device] = per_arch[arch]
        elif self.device_accuracy:
            per_client = dict(sorted(self.device_accuracy.items()))
            groups: dict[str, list[float]] = {}
            for device, acc in per_client.items():
                groups.setdefault(self.server.clients[device].arch, []).append(acc)
            per_arch = {a: statistics.fmean(v) for a, v in groups.items()}
        else:
            return None
        scores = list(per_client.values()) or list(per_arch.values())
        return {"overall": statistics.fmean(scores), "per_arch": per_arch, "per_client": per_client}

    def run(self) -> list[dict[str, Any]]:
        for r in range(1, self.cfg.rounds + 1):
            self.run_round(r)
        self.announce(self.cfg.rounds, {"done": True, "rounds": self.cfg.rounds})
        return self.history

