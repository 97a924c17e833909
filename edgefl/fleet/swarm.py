"""Thousands of protocol-level devices in one process: the load generator (``edgefl loadgen``).

Every device is the real device loop (:class:`edgefl.device.DeviceLoop`) over its own MQTT
connection (:class:`edgefl.transport.link.Link`: client id, persistent session, retained
presence, last will), speaking docs/PROTOCOL.md with real envelopes, chunks, acks and resends.
What it does not do is train: :mod:`edgefl.fleet.templates` supplies a real upload of its
architecture, and the device holds it back for its compute delay before publishing.

``edgefl client`` gives each connection paho's network thread; ten thousand threads would not
fit on a small machine, so here one selector loop drives every socket through paho's
external-loop API (``loop_read`` / ``loop_write`` / ``loop_misc`` and the socket callbacks).

Faults a fleet meets, drawn per device from the seed:

* compute delay: lognormal around ``compute_s`` (a slow device holds its upload longer);
* drop-out: a selected device goes offline mid-round (its last will says so), never reports that
  round, and comes back after ``rejoin_s``;
* churn: devices disconnect at random (``churn_per_min``) and reconnect with jittered back-off.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import random
import selectors
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from edgefl.config import RunConfig
from edgefl.device import DeviceLoop
from edgefl.filters import build_chain
from edgefl.errors import EdgeflError
from edgefl.fleet.templates import TemplateClient, UploadTemplates
from edgefl.transport.link import BrokerAddress, Link
from edgefl.transport.mqtt import MqttDeviceTransport
from edgefl.transport.topics import Topics

log = logging.getLogger("edgefl.loadgen")


@dataclass(frozen=True)
class LoadSettings:
    compute_s: float = 1.0  # median seconds between a download and its upload
    compute_spread: float = 0.5  # sigma of the lognormal around it
    dropout: float = 0.0  # chance that a selected device drops out of its round
    rejoin_s: float = 30.0  # how long a dropped device stays offline
    churn_per_min: float = 0.0  # random disconnects per device per minute (each reconnects)
    connect_per_s: float = 2000.0  # connection rate at start (a broker accepts so many per second)
    seed: int = 0

    def __post_init__(self) -> None:
        checks = {"compute_s": self.compute_s >= 0, "compute_spread": self.compute_spread >= 0, "dropout": 0 <= self.dropout <= 1,
                  "rejoin_s": self.rejoin_s >= 0, "churn_per_min": self.churn_per_min >= 0, "connect_per_s": self.connect_per_s > 0}
        bad = [k for k, ok in checks.items() if not ok]
        if bad:
            raise EdgeflError(f"load settings out of range: {', '.join(bad)}",
                              hint="delays and rates are >= 0 (connect_per_s > 0), dropout is a probability")


class _HeldTransport(MqttDeviceTransport):
    """The device's sends wait until its compute delay has passed (a resend of the same bytes
    while held is not queued twice); a dropping device's sends are lost, as on a dead link."""

    def __init__(self, link: Link, topics: Topics, device: str) -> None:
        super().__init__(link, topics, device)
        self.hold_until = 0.0  # when the work under way is done (a device computes one round at a time)
        self.held: list[tuple[int, float, bytes]] = []  # (round, when it may go, the bytes)
        self.dropping = False
        self.round = 0  # the round of the upload under way
        self.published: dict[int, float] = {}  # round -> wall clock when its upload first went out

    def send(self, data: bytes) -> None:
        if self.dropping:
            return
        if time.monotonic() < self.hold_until:
            if not any(h is data for _, _, h in self.held):
                self.held.append((self.round, self.hold_until, data))
            return
        self._publish(self.round, data)

    def _publish(self, round_no: int, data: bytes) -> None:
        self.published.setdefault(round_no, time.time())
        self.link.publish(self.topics.up(self.device), data)

    def release(self, now: float) -> None:
        """Send what is due; a later round's upload keeps waiting for its own compute time."""
        due = [h for h in self.held if h[1] <= now]
        self.held = [h for h in self.held if h[1] > now]
        for round_no, _, data in due:
            self._publish(round_no, data)


@dataclass
class _Device:
    id: str
    link: Link
    transport: _HeldTransport
    loop: DeviceLoop
    rng: random.Random
    away: bool = False  # deliberately offline (drop-out or churn): no automatic reconnect
    dropped: list[int] = field(default_factory=list)


class Swarm:
    """Many devices of one config, each on its own MQTT connection, driven by one loop."""

    def __init__(self, cfg: RunConfig, broker: str, device_ids: list[str], settings: LoadSettings, parts, *,
                 federation: str, username: str | None = None, password: str | None = None, ca_file: str | None = None,
                 max_packet_bytes: int = 256 << 20) -> None:
        self.cfg = cfg
        self.settings = settings
        self.address = BrokerAddress.parse(broker)
        self.topics = Topics(federation)
        self.selector = selectors.DefaultSelector()
        self.templates = UploadTemplates(parts)
        self._timers: list[tuple[float, int, Any]] = []
        self._seq = itertools.count()
        self.devices: dict[str, _Device] = {}
        self.connects = 0
        self.disconnects = 0
        self.connect_failures = 0  # connection attempts the broker did not take (retried)
        self._warned_takeover = False
        self._credentials = (username, password, ca_file)
        self._max_packet = max_packet_bytes
        for device_id in device_ids:
            self.devices[device_id] = self._device(device_id)

    # --- building ----------------------------------------------------------------------------
    def _device(self, device_id: str) -> _Device:
        username, password, ca_file = self._credentials
        link = MqttDeviceTransport.device_link(self.address, self.topics, device_id, max_packet_bytes=self._max_packet,
                                               keepalive_s=self.cfg.network.keepalive_s, protocol=self.cfg.network.protocol,
                                               username=username, password=password, ca_file=ca_file, yield_session=False)
        client = link.client
        client.on_socket_open = lambda c, u, sock: self.selector.register(sock, selectors.EVENT_READ, device_id)
        client.on_socket_close = lambda c, u, sock: self._closed(device_id, sock)
        client.on_socket_register_write = lambda c, u, sock: self._interest(sock, device_id, write=True)
        client.on_socket_unregister_write = lambda c, u, sock: self._interest(sock, device_id, write=False)
        link.on_connected = self._count_connect
        transport = _HeldTransport(link, self.topics, device_id)
        template = TemplateClient(device_id, self.templates)
        # the run's filter chain runs in every protocol-level device too (secure aggregation's stages, compression)
        loop = DeviceLoop(template, transport, self.topics.federation, self.cfg.network,  # type: ignore[arg-type]
                          filters=build_chain(self.cfg.filter_chain(), "device", self.cfg.seed, device_id))
        dev = _Device(device_id, link, transport, loop, random.Random(f"{self.settings.seed}:{device_id}"))
        template.on_fit = lambda round_no: self._trained(dev, round_no)
        return dev

    def _count_connect(self) -> None:
        self.connects += 1

    # --- socket bookkeeping ----------------------------------------------------------------------
    def _interest(self, sock, device_id: str, write: bool) -> None:
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if write else 0)
        try:
            self.selector.modify(sock, events, device_id)
        except (KeyError, ValueError):
            pass  # already closed

    def _closed(self, device_id: str, sock) -> None:
        try:
            self.selector.unregister(sock)
        except (KeyError, ValueError):
            pass
        dev = self.devices[device_id]
        self.disconnects += 1
        if not dev.away:  # lost, not left: come back like a device does, after a jittered back-off
            self._at(time.monotonic() + 1 + dev.rng.random() * 2, ("reconnect", device_id))

    # --- timers ------------------------------------------------------------------------------------
    def _at(self, when: float, action: tuple[str, str]) -> None:
        heapq.heappush(self._timers, (when, next(self._seq), action))

    def _fire(self, now: float) -> None:
        while self._timers and self._timers[0][0] <= now:
            _, _, (what, device_id) = heapq.heappop(self._timers)
            dev = self.devices[device_id]
            if what == "release":
                if dev.away and not dev.transport.dropping:
                    self._at(now + 0.5, ("release", device_id))  # offline for a moment (churn): send when back
                elif not dev.transport.dropping:
                    dev.transport.release(now)
            elif what == "drop":
                self._leave(dev, lose_work=True)
                self._at(now + self.settings.rejoin_s, ("reconnect", device_id))
            elif what == "churn":
                if not dev.away and dev.link.connected.is_set():
                    self._leave(dev)
                    self._at(now + 1 + dev.rng.random() * 4, ("reconnect", device_id))
                self._schedule_churn(dev, now)
            elif what == "reconnect":
                self._rejoin(dev)

    def _schedule_churn(self, dev: _Device, now: float) -> None:
        if self.settings.churn_per_min > 0:
            self._at(now + dev.rng.expovariate(self.settings.churn_per_min / 60.0), ("churn", dev.id))

    def _trained(self, dev: _Device, round_no: int) -> None:
        """The device loop made an upload: hold it for the compute delay, or drop out."""
        s = self.settings
        delay = s.compute_s * math.exp(dev.rng.gauss(0.0, s.compute_spread)) if s.compute_s > 0 else 0.0
        now = time.monotonic()
        # a device selected again while still computing the last round starts this one after it
        start = max(now, dev.transport.hold_until)
        dev.transport.round = round_no
        dev.transport.hold_until = start + delay
        if dev.rng.random() < s.dropout:
            dev.transport.dropping = True
            dev.dropped.append(round_no)
            self._at(start + delay / 2, ("drop", dev.id))
        else:
            self._at(start + delay, ("release", dev.id))

    def _leave(self, dev: _Device, lose_work: bool = False) -> None:
        """Go offline without a clean goodbye: the broker publishes the last will (offline). A
        device that drops out loses the round's work; one that only lost its connection (churn)
        keeps its upload and its wait for the answer, as the device loop does across reconnects."""
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.reasoncodes import ReasonCode

        dev.away = True
        if lose_work:
            dev.transport.held = []
            dev.loop.pending.clear()
        if dev.link.v5:
            dev.link.client.disconnect(reasoncode=ReasonCode(PacketTypes.DISCONNECT, "Disconnect with will message"))
        else:
            sock = dev.link.client.socket()
            if sock is not None:  # MQTT 3.1.1 has no such reason code: a connection that dies triggers the will
                sock.shutdown(socket.SHUT_RDWR)

    def _rejoin(self, dev: _Device) -> None:
        # paho closes the socket before it reports why: by now the reason is known
        if "taken over" in str(dev.link.last_disconnect or "").lower() and not self._warned_takeover:
            self._warned_takeover = True
            log.error("%s was disconnected because another client connected with its id: do two load generators (or a "
                      "device) play the same devices? Give each process its own --devices range", dev.id)
        dev.away = False
        dev.transport.dropping = False
        try:
            dev.link.client.reconnect()
        except OSError as exc:
            log.debug("%s: reconnect failed (%s); trying again", dev.id, exc)
            self.connect_failures += 1
            self._at(time.monotonic() + 2 + dev.rng.random() * 3, ("reconnect", dev.id))

    # --- running -----------------------------------------------------------------------------------
    def _pump(self, timeout_s: float) -> None:
        for key, events in self.selector.select(timeout_s):
            dev = self.devices[key.data]
            client = dev.link.client
            if events & selectors.EVENT_READ:
                client.loop_read(16)
            if events & selectors.EVENT_WRITE:
                client.loop_write()
            item = dev.transport.receive(0)
            while item is not None:
                dev.loop.handle(item)
                item = dev.transport.receive(0)

    def connect_all(self, timeout_s: float = 300.0) -> float:
        """Connect every device (at ``connect_per_s``); the seconds it took until all were accepted."""
        t0 = next_misc = time.monotonic()
        gap = 1.0 / self.settings.connect_per_s
        for i, dev in enumerate(self.devices.values()):
            try:
                dev.link.open()
            except EdgeflError as exc:  # a broker whose accept queue overflowed: try again, as a device would
                log.debug("%s: %s; retrying", dev.id, exc.message)
                self.connect_failures += 1
                self._at(time.monotonic() + 1 + dev.rng.random() * 4, ("reconnect", dev.id))
            self._schedule_churn(dev, t0)
            self._pump(max(0.0, t0 + i * gap - time.monotonic()))
        while (connected := self.connected_count()) < len(self.devices):
            waited = time.monotonic() - t0
            if self.connects == 0 and self.connect_failures >= len(self.devices) and waited > 10:
                raise EdgeflError(f"cannot reach the broker at {self.address}: every connection attempt failed",
                                  hint="start one or check --broker")
            if waited > timeout_s:
                raise EdgeflError(f"only {connected} of {len(self.devices)} devices connected within {timeout_s:g} s",
                                  hint="the broker may refuse more connections or accept them too slowly: raise its and this "
                                       "process's open-file limits (ulimit -n), or lower --connect-per-s")
            self._pump(0.05)
            self._fire(time.monotonic())
            now = time.monotonic()
            if now >= next_misc:
                next_misc = now + 1.0
                self._housekeeping(now)
        return time.monotonic() - t0

    def _housekeeping(self, now: float) -> int:
        """Once a second for every device here: paho's timers (keep-alive pings; a CONNECT the
        broker never answered times out and is retried) and resends of uploads left unanswered
        past their compute time. Returns how many devices have heard the end of the run."""
        finished = 0
        for dev in self.devices.values():
            if not dev.away:
                dev.link.client.loop_misc()
                if dev.loop.pending and dev.link.connected.is_set() and now >= dev.transport.hold_until:
                    dev.loop.tick()
            finished += dev.loop.finished
        return finished

    def connected_count(self) -> int:
        return sum(dev.link.connected.is_set() for dev in self.devices.values())

    def run(self, timeout_s: float) -> None:
        """Serve until every device has heard that the run is done, or ``timeout_s`` passes."""
        end = time.monotonic() + timeout_s
        next_misc = 0.0
        while time.monotonic() < end:
            wait = 0.2 if not self._timers else min(0.2, max(0.0, self._timers[0][0] - time.monotonic()))
            self._pump(wait)
            now = time.monotonic()
            self._fire(now)
            if now >= next_misc:
                next_misc = now + 1.0
                if self._housekeeping(now) == len(self.devices):
                    return

    def close(self) -> None:
        for dev in self.devices.values():
            try:
                if dev.link.connected.is_set():
                    dev.link.client.publish(dev.link.presence_topic, b"offline", qos=1, retain=True)
                    dev.link.client.disconnect()
                    dev.link.client.loop_write()
            except Exception:  # closing: nothing left to save
                pass
        self.selector.close()

    # --- what happened -----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Per round: uploads published and how the server answered them (``unanswered``: published
        and never answered, the candidates for a lost update)."""
        rounds: dict[int, dict[str, Any]] = {}

        def row_of(r: int) -> dict[str, Any]:
            return rounds.setdefault(r, {"published": 0, "accepted": 0, "duplicate": 0, "late": 0, "refused": 0, "unanswered": 0,
                                         "last_accepted_publish_unix": None, "accepted_devices": []})

        for dev in self.devices.values():
            for r, t in dev.transport.published.items():
                row = row_of(r)
                row["published"] += 1
                result = dev.loop.results.get(r)
                if result is None:
                    row["unanswered"] += 1
                    row.setdefault("unanswered_published_unix", []).append(t)
                elif result["reply"] == "nack":
                    row["refused"] += 1
                else:
                    status = result["status"] if result["status"] in ("accepted", "duplicate", "late") else "late"
                    row[status] += 1
                    if status == "accepted":
                        row["accepted_devices"].append(dev.id)
                        last = row["last_accepted_publish_unix"]
                        row["last_accepted_publish_unix"] = t if last is None else max(last, t)
            for r in dev.dropped:
                row = row_of(r)
                row["dropped"] = row.get("dropped", 0) + 1
        return {"devices": len(self.devices), "connects": self.connects, "disconnects": self.disconnects,
                "connect_failures": self.connect_failures,
                "finished": sum(d.loop.finished for d in self.devices.values()), "template_fits": self.templates.fits,
                "rounds": {r: rounds[r] for r in sorted(rounds)}}


def raise_open_files(needed: int) -> int:
    """Lift this process's open-file limit to ``needed`` (the soft limit up to the hard one; root
    may raise the hard one too); returns the limit in force. Each connection is one descriptor."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed:
        return soft
    if hard == resource.RLIM_INFINITY or hard >= needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    else:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (needed, needed))  # root only
        except (ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def run_load(cfg: RunConfig, broker: str, device_ids: list[str], settings: LoadSettings, *, timeout_s: float,
             username: str | None = None, password: str | None = None, ca_file: str | None = None,
             on_connected=None) -> dict[str, Any]:
    """Connect ``device_ids`` as protocol-level devices of ``cfg`` and serve the server's run until
    it is done (or ``timeout_s``); returns :meth:`Swarm.stats` with the connect time."""
    from edgefl.build import build_run
    from edgefl.fleet.launcher import federation, packet_limit

    limit = raise_open_files(len(device_ids) + 256)
    if limit < len(device_ids) + 64:
        raise EdgeflError(f"{len(device_ids)} connections need as many open files; this process may open {limit}",
                          hint="split the devices over processes (--devices A:B) or raise the limit (ulimit -n)")
    parts = build_run(cfg, check=False, raw_pixels=True)  # as edgefl client: 8-bit images until a device takes its samples
    swarm = Swarm(cfg, broker, device_ids, settings, parts, federation=federation(cfg), username=username, password=password,
                  ca_file=ca_file, max_packet_bytes=packet_limit(cfg))
    try:
        t0 = time.monotonic()
        connect_s = None
        try:
            connect_s = swarm.connect_all()
            if on_connected is not None:
                on_connected(connect_s)
            swarm.run(max(1.0, timeout_s - (time.monotonic() - t0)))
        except KeyboardInterrupt:  # what the devices saw so far is still worth keeping
            return {**swarm.stats(), "connect_s": connect_s, "interrupted": True}
        return {**swarm.stats(), "connect_s": round(connect_s, 3), "interrupted": False}
    finally:
        swarm.close()
