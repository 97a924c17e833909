"""``memory://NAME``: an in-process message bus, so a server and device loops that are threads of
one process run a fleet without a broker (``edgefl fleet --broker memory://NAME``, tests, a
notebook).

It keeps what a broker with persistent sessions keeps, per federation: a queue per device and one
for the server (messages wait for an endpoint that is not connected yet or any more), each
device's presence (the server is told every known device's presence when it connects, as MQTT's
retained presence does) and the last round announcement (retained: a device that connects later
gets it). Unlike :mod:`edgefl.sim.network` nothing is stepped: every endpoint blocks on its own
queue and ``now()`` is the wall clock, so the loops run exactly as over MQTT. Bytes are handed
over as they are, never pickled or copied into objects.

A device offline when a round is announced gets only the latest announcement when it connects
(MQTT would also queue the ones it missed; the device loop reads the latest either way).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

from edgefl.errors import EdgeflError
from edgefl.transport.base import Delivery, DeviceTransport, ServerTransport
from edgefl.transport.registry import BrokerAddress, register_transport
from edgefl.transport.topics import Topics


@dataclass
class _Federation:
    """One federation on a hub: what a broker's sessions and retained store would hold."""

    server_inbox: queue.Queue[Delivery] = field(default_factory=queue.Queue)
    server_connected: bool = False
    inboxes: dict[str, queue.Queue[Delivery]] = field(default_factory=dict)
    connected: set[str] = field(default_factory=set)
    presence: dict[str, bool] = field(default_factory=dict)
    announcement: bytes | None = None


class MemoryHub:
    """One ``memory://NAME`` bus. Every change happens under one lock, so what the server is
    told on connecting (the devices' presence) and what happens meanwhile keep their order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._federations: dict[str, _Federation] = {}

    def _federation(self, topics: Topics) -> _Federation:
        return self._federations.setdefault(topics.federation, _Federation())

    def _inbox(self, fed: _Federation, device: str) -> queue.Queue[Delivery]:
        return fed.inboxes.setdefault(device, queue.Queue())

    # --- the server's side -----------------------------------------------------------------------
    def attach_server(self, topics: Topics) -> queue.Queue[Delivery]:
        with self._lock:
            fed = self._federation(topics)
            if fed.server_connected:
                raise EdgeflError(f"memory://{self.name} already has a server for federation {topics.federation!r}",
                                  hint="one server per federation; close the other first")
            fed.server_connected = True
            for device, online in fed.presence.items():
                fed.server_inbox.put(Delivery("presence", device, online=online, where=topics.presence(device)))
            return fed.server_inbox

    def detach_server(self, topics: Topics) -> None:
        with self._lock:
            self._federation(topics).server_connected = False

    def to_device(self, topics: Topics, device: str, data: bytes) -> None:
        with self._lock:
            self._inbox(self._federation(topics), device).put(Delivery("message", "server", data, where=topics.down(device)))

    def announce(self, topics: Topics, data: bytes) -> None:
        with self._lock:
            fed = self._federation(topics)
            fed.announcement = data
            for device in fed.connected:
                fed.inboxes[device].put(Delivery("announcement", "server", data, where=topics.rounds))

    # --- a device's side -------------------------------------------------------------------------
    def attach_device(self, topics: Topics, device: str) -> queue.Queue[Delivery]:
        with self._lock:
            fed = self._federation(topics)
            if device in fed.connected:
                raise EdgeflError(f"{device} is already connected to memory://{self.name} (federation {topics.federation!r})",
                                  hint="every device of a federation needs its own id")
            fed.connected.add(device)
            inbox = self._inbox(fed, device)
            if fed.announcement is not None:
                inbox.put(Delivery("announcement", "server", fed.announcement, where=topics.rounds))
            self._presence(topics, fed, device, True)
            return inbox

    def detach_device(self, topics: Topics, device: str) -> None:
        with self._lock:
            fed = self._federation(topics)
            fed.connected.discard(device)
            self._presence(topics, fed, device, False)

    def to_server(self, topics: Topics, device: str, data: bytes) -> None:
        with self._lock:
            self._federation(topics).server_inbox.put(Delivery("message", device, data, where=topics.up(device)))

    def _presence(self, topics: Topics, fed: _Federation, device: str, online: bool) -> None:
        fed.presence[device] = online
        if fed.server_connected:  # else it is told when it connects (attach_server), once
            fed.server_inbox.put(Delivery("presence", device, online=online, where=topics.presence(device)))


_HUBS: dict[str, MemoryHub] = {}
_HUBS_LOCK = threading.Lock()


def hub(name: str) -> MemoryHub:
    """The hub ``memory://NAME`` names in this process (made on first use; it lives as long as
    the process, like a broker's retained store: a new run takes a new name or federation)."""
    with _HUBS_LOCK:
        if name not in _HUBS:
            _HUBS[name] = MemoryHub(name)
        return _HUBS[name]


def _get(inbox: queue.Queue[Delivery], timeout_s: float) -> Delivery | None:
    try:
        return inbox.get(timeout=max(timeout_s, 0.0))
    except queue.Empty:
        return None


class _Connection:
    """What both sides share: the hub, the federation, a size limit like a broker's, closing."""

    def __init__(self, hub_: MemoryHub, topics: Topics, max_packet_bytes: int | None) -> None:
        self.hub = hub_
        self.topics = topics
        self.max_packet_bytes = max_packet_bytes
        self.closed = False

    def _check(self, data: bytes) -> None:
        if self.closed:
            raise EdgeflError(f"this connection to memory://{self.hub.name} is closed")
        # refused like Link.publish does: a run that passes here would also pass a broker's limit
        if self.max_packet_bytes is not None and len(data) > self.max_packet_bytes:
            raise EdgeflError(f"refusing to send {len(data)} bytes: the limit is {self.max_packet_bytes}",
                              hint="lower the chunk size")


class MemoryServerTransport(_Connection, ServerTransport):
    def __init__(self, hub_: MemoryHub, topics: Topics, max_packet_bytes: int | None = None) -> None:
        super().__init__(hub_, topics, max_packet_bytes)
        self.inbox = hub_.attach_server(topics)

    def send(self, device: str, data: bytes) -> None:
        self._check(data)
        self.hub.to_device(self.topics, device, data)

    def announce(self, data: bytes) -> None:
        self._check(data)
        self.hub.announce(self.topics, data)

    def receive(self, timeout_s: float) -> Delivery | None:
        return _get(self.inbox, timeout_s)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.hub.detach_server(self.topics)


class MemoryDeviceTransport(_Connection, DeviceTransport):
    def __init__(self, hub_: MemoryHub, topics: Topics, device: str, max_packet_bytes: int | None = None) -> None:
        super().__init__(hub_, topics, max_packet_bytes)
        self.device = device
        self.inbox = hub_.attach_device(topics, device)

    def send(self, data: bytes) -> None:
        self._check(data)
        self.hub.to_server(self.topics, self.device, data)

    def receive(self, timeout_s: float) -> Delivery | None:
        return _get(self.inbox, timeout_s)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.hub.detach_device(self.topics, self.device)


# The factories take the launcher's connection options; all but the size limit are MQTT's
# (keep-alive, protocol version, credentials, TLS): nothing to tune or protect inside one process.
def _server(url: str, topics: Topics, *, max_packet_bytes: int | None = None, **_mqtt: object) -> MemoryServerTransport:
    return MemoryServerTransport(hub(BrokerAddress.parse(url).host), topics, max_packet_bytes)


def _device(url: str, topics: Topics, device: str, *, max_packet_bytes: int | None = None, **_mqtt: object) -> MemoryDeviceTransport:
    return MemoryDeviceTransport(hub(BrokerAddress.parse(url).host), topics, device, max_packet_bytes)


register_transport("memory", _server, _device, example="memory://NAME", in_process=True)
