"""The transport interface over MQTT: one :class:`~edgefl.transport.link.Link` and the topic
layout of docs/PROTOCOL.md (``dev/<id>/up``, ``dev/<id>/down``, retained ``round`` and
``presence/<id>``). Registered for ``mqtt://``, ``mqtts://`` and ``tcp://`` broker URLs
(:mod:`edgefl.transport.registry`); the connection options (``max_packet_bytes``, ``keepalive_s``,
``protocol``, ``username``, ``password``, ``ca_file``) are this module's alone."""

from __future__ import annotations

import logging

from edgefl.errors import EdgeflError
from edgefl.transport.base import Delivery, DeviceTransport, ServerTransport
from edgefl.transport.link import MQTT_SCHEMES, BrokerAddress, Link, open_broker_warning
from edgefl.transport.registry import register_transport
from edgefl.transport.topics import Topics

log = logging.getLogger("edgefl.transport")


def _warn_if_open(address: BrokerAddress, username: str | None) -> BrokerAddress:
    warning = open_broker_warning(address, username)
    if warning:
        log.warning("warning: %s", warning)
    return address


class MqttServerTransport(ServerTransport):
    def __init__(self, link: Link, topics: Topics) -> None:
        self.link = link
        self.topics = topics
        link.taken_over_error = EdgeflError(
            f"another server process, started after this one, connected to the broker as the server of federation "
            f"{topics.federation!r}: two servers cannot share one federation's devices",
            hint="stop one of the two, or give each run its own network.federation; this server stops here (its "
                 "rounds so far are saved: continue them later with edgefl server ... --resume --out RUN_DIR)")

    @classmethod
    def connect(cls, broker: str, topics: Topics, *, max_packet_bytes: int, keepalive_s: int, protocol: str = "5",
                username: str | None = None, password: str | None = None, ca_file: str | None = None) -> MqttServerTransport:
        link = Link(_warn_if_open(BrokerAddress.parse(broker), username), f"edgefl-{topics.federation}-server", [topics.all_up, topics.all_presence],
                    topics.presence("server"), username=username, password=password, ca_file=ca_file, protocol=protocol,
                    max_packet_bytes=max_packet_bytes, keepalive_s=keepalive_s,
                    # two servers of one federation share a client id: the older yields (MQTT 5) instead of flapping
                    yield_session=True).start()
        return cls(link, topics)

    def send(self, device: str, data: bytes) -> None:
        self.link.publish(self.topics.down(device), data)

    def announce(self, data: bytes) -> None:
        self.link.publish(self.topics.rounds, data, retain=True)

    def receive(self, timeout_s: float) -> Delivery | None:
        item = self.link.get(timeout_s)
        if item is None:
            return None
        if item.topic == self.topics.presence("server"):
            return None  # our own retained presence
        device = self.topics.device_of(item.topic)
        if device is None:
            return Delivery("unknown", None, item.payload, where=item.topic)
        if item.topic == self.topics.presence(device):
            return Delivery("presence", device, online=item.payload == b"online", where=item.topic, instance=item.instance)
        return Delivery("message", device, item.payload, where=item.topic, retained=item.retained)

    @property
    def connects(self) -> int:
        return self.link.connect_count

    def close(self) -> None:
        self.link.stop()


class MqttDeviceTransport(DeviceTransport):
    def __init__(self, link: Link, topics: Topics, device: str) -> None:
        self.link = link
        self.topics = topics
        self.device = device
        link.taken_over_error = EdgeflError(
            f"another process, started after this one, connected to the broker as device {device!r} of federation "
            f"{topics.federation!r}: two devices run with one --device-id",
            hint="give every device its own --device-id; this one stops so that the two do not keep closing each "
                 "other's connection")

    @staticmethod
    def device_link(address: BrokerAddress, topics: Topics, device: str, *, max_packet_bytes: int, keepalive_s: int,
                    protocol: str = "5", username: str | None = None, password: str | None = None,
                    ca_file: str | None = None, yield_session: bool = True) -> Link:
        """A device's connection as docs/PROTOCOL.md sets it up (client id, its down topic and the
        round announcements, retained presence and last will), not opened yet; ``yield_session``:
        stay closed when another client takes the device's id over (the load generator says so itself)."""
        return Link(address, f"edgefl-{topics.federation}-{device}", [topics.down(device), topics.rounds],
                    topics.presence(device), username=username, password=password, ca_file=ca_file, protocol=protocol,
                    max_packet_bytes=max_packet_bytes, keepalive_s=keepalive_s, yield_session=yield_session,
                    fresh_session=True)

    @classmethod
    def connect(cls, broker: str, topics: Topics, device: str, *, max_packet_bytes: int, keepalive_s: int,
                protocol: str = "5", username: str | None = None, password: str | None = None,
                ca_file: str | None = None) -> MqttDeviceTransport:
        link = cls.device_link(_warn_if_open(BrokerAddress.parse(broker), username), topics, device, max_packet_bytes=max_packet_bytes, keepalive_s=keepalive_s,
                               protocol=protocol, username=username, password=password, ca_file=ca_file).start()
        return cls(link, topics, device)

    def send(self, data: bytes) -> None:
        self.link.publish(self.topics.up(self.device), data)

    def receive(self, timeout_s: float) -> Delivery | None:
        item = self.link.get(timeout_s)
        if item is None:
            return None
        channel = "announcement" if item.topic == self.topics.rounds else "message"
        return Delivery(channel, "server", item.payload, where=item.topic)

    def close(self) -> None:
        self.link.stop()


for _scheme, _port in MQTT_SCHEMES.items():
    # tcp:// is an alias: the URL shape it is answered with is mqtt://'s
    register_transport(_scheme, MqttServerTransport.connect, MqttDeviceTransport.connect,
                       example=f"{'mqtt' if _scheme == 'tcp' else _scheme}://HOST:PORT",
                       default_port=_port, tls=_scheme == "mqtts")
