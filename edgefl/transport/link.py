"""One MQTT connection of a fleet member (paho-mqtt 2.x), with the habits docs/PROTOCOL.md asks for.

* persistent session: a stable client id, clean start off and a session expiry (MQTT 5) or
  ``clean_session = False`` (MQTT 3.1.1), so QoS 1 messages wait for a device that is offline;
  a device's link (``fresh_session``, MQTT 5) starts its process with a clean session and keeps it
  over reconnects: what the broker queued for an earlier process of the same device id belongs to
  a run, or rounds, that process no longer takes part in (the server re-sends the current
  download when a device comes online). MQTT 3.1.1 fixes clean_session for a client's life, so
  there a restarted device still gets what was queued;
* presence: retained ``online`` on connect, ``offline`` as the last will;
* reconnect with exponential back-off whose floor is jittered per client, so a fleet does not
  reconnect in lockstep after a broker restart;
* callbacks only enqueue: an exception or a long block inside a paho callback would kill or stall
  the network thread, so all work happens in the caller's thread via :meth:`Link.get`;
* publishes larger than the broker's packet limit are refused here (the broker would disconnect
  the client and paho would resend forever).
"""

from __future__ import annotations

import ipaddress
import logging
import math
import queue
import random
import secrets
import threading
import time
from dataclasses import dataclass

from edgefl.errors import BrokerUnreachable, EdgeflError, SubscriptionsUnconfirmed
from edgefl.transport.registry import BrokerAddress

log = logging.getLogger("edgefl.transport")

#: the URL schemes this connection speaks (edgefl.transport.mqtt registers them); ``tcp`` is
#: paho's name for plain MQTT, accepted as it always was
MQTT_SCHEMES = {"mqtt": 1883, "mqtts": 8883, "tcp": 1883}


def is_loopback(host: str) -> bool:
    """``host`` names this machine (by address or as localhost): nobody else can reach it."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host.lower().rstrip(".") == "localhost" or host.lower().rstrip(".").endswith(".localhost")


def open_broker_warning(address: BrokerAddress, username: str | None) -> str | None:
    """The warning a server or device prints before it connects without a username and without TLS
    to a broker another machine can reach (None when there is nothing to warn about): such a
    broker lets anyone who reaches it read every upload and forge every message."""
    if address.tls or username or is_loopback(address.host):
        return None
    return (f"the broker at {address} is plain MQTT (no TLS) and this connection is anonymous (no username): anyone who can reach "
            "the broker can read every upload and forge messages to and from devices; use TLS and credentials "
            "(edgefl broker-config, docs/deploy.md)")


@dataclass
class Incoming:
    topic: str
    payload: bytes
    retained: bool = False  # delivered from the broker's retained store (on subscribe), not live
    instance: str | None = None  # a presence's INSTANCE_PROPERTY: which process of a client id said it


INSTANCE_PROPERTY = "edgefl-instance"  # on a device's retained presence: "<unix start time>-<random>"


def started_later(other: str, mine: str) -> bool:
    """Whether the process behind instance ``other`` started after this one (ties broken by the
    random part, so exactly one of two yields); an unreadable one is not."""
    def key(instance: str) -> tuple[float, str]:
        start, _, nonce = instance[:64].partition("-")
        return float(start), nonce

    try:
        theirs = key(other)
    except ValueError:
        return False
    return math.isfinite(theirs[0]) and theirs > key(mine)


class Link:
    """A connected MQTT client whose incoming messages wait in a queue."""

    def __init__(
        self,
        address: BrokerAddress,
        client_id: str,
        subscriptions: list[str],
        presence_topic: str | None = None,
        *,
        username: str | None = None,
        password: str | None = None,
        ca_file: str | None = None,
        protocol: str = "5",
        max_packet_bytes: int = 256 << 20,
        session_expiry_s: int = 3600,
        keepalive_s: int = 30,
        yield_session: bool = False,
        fresh_session: bool = False,
    ) -> None:
        if address.scheme not in MQTT_SCHEMES or address.port is None:  # memory://NAME parses too: not a broker to dial
            raise EdgeflError(f"{address} is not an MQTT broker", hint="this connection needs mqtt://HOST:PORT or mqtts://HOST:PORT")
        import paho.mqtt.client as mqtt

        self._mqtt = mqtt
        self.address = address
        self.client_id = client_id
        self.subscriptions = subscriptions
        self.presence_topic = presence_topic
        self.max_packet_bytes = max_packet_bytes
        self.v5 = protocol == "5"
        self.inbox: queue.Queue[Incoming] = queue.Queue()
        self.connected = threading.Event()
        #: the broker acknowledged every subscription of the latest connection (SUBACK): before it,
        #: a message published to a subscribed topic may not reach this link
        self.subscribed = threading.Event()
        self._pending_subscriptions: dict[int, str] = {}  # SUBSCRIBE packet id -> topic, until its SUBACK
        #: the subscriptions the broker refused on the latest connection (a SUBACK failure code; brokers
        #: that enforce read ACLs that way, EMQX or HiveMQ, do; mosquitto grants and drops instead),
        #: each "topic (reason)"
        self.subscriptions_refused: list[str] = []
        self._started = False  # start() returned: a refusal after a reconnect can only be logged
        self.on_connected = None  # called (in paho's callback) after each accepted connection: the load generator counts them
        self.connect_count = 0
        self.last_disconnect: str | None = None
        #: another process uses this client id (two devices started with one id): each connection
        #: closes the other's, forever. A link that yields its session (a device's, over MQTT 5)
        #: marks its retained presence with when it started (a user property) and watches that
        #: topic; the older of two stays closed and says so (taken_over), the newer goes on
        self.yield_session = yield_session and self.v5 and presence_topic is not None
        self.instance = f"{time.time():.6f}-{secrets.token_hex(4)}"
        self.taken_over = threading.Event()
        #: raised by :meth:`get` once taken over and nothing is left to read (the transport says who it was)
        self.taken_over_error: Exception | None = None
        self.client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id=client_id,
            protocol=mqtt.MQTTv5 if self.v5 else mqtt.MQTTv311,
            **({} if self.v5 else {"clean_session": False}),
        )
        if username:
            self.client.username_pw_set(username, password)
        if address.tls:
            self.client.tls_set(ca_certs=ca_file)
        if presence_topic:
            self.client.will_set(presence_topic, b"offline", qos=1, retain=True)
        self.client.max_queued_messages_set(0)
        # jittered back-off floor: 1-3 s (fixed per client id), doubling to at most 30 s
        self.client.reconnect_delay_set(min_delay=1 + random.Random(client_id).random() * 2, max_delay=30)
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_subscribe = self._on_subscribe
        self.client.on_message = self._on_message
        self._session_expiry_s = session_expiry_s
        self._keepalive_s = keepalive_s
        self._fresh_session = fresh_session

    # --- paho callbacks: enqueue only ---------------------------------------------------------
    def _on_connect(self, client, userdata, flags, reason_code, properties=None) -> None:
        if getattr(reason_code, "is_failure", False):
            self.last_disconnect = f"connect refused: {reason_code}"
            return
        self.connect_count += 1
        self.subscribed.clear()
        self.subscriptions_refused = []
        # (paho runs this and on_subscribe on one thread: no SUBACK is handled before the ids are kept)
        pending: dict[int, str] = {}
        for topic in self.subscriptions:
            rc, mid = client.subscribe(topic, qos=1)
            if rc == self._mqtt.MQTT_ERR_SUCCESS:
                pending[mid] = topic
        if self.yield_session:
            from paho.mqtt.packettypes import PacketTypes
            from paho.mqtt.properties import Properties

            rc, mid = client.subscribe(self.presence_topic, qos=1)  # before the publish: the retained one is another's, if any
            if rc == self._mqtt.MQTT_ERR_SUCCESS:
                pending[mid] = self.presence_topic
            props = Properties(PacketTypes.PUBLISH)
            props.UserProperty = (INSTANCE_PROPERTY, self.instance)
            client.publish(self.presence_topic, b"online", qos=1, retain=True, properties=props)
        elif self.presence_topic:
            client.publish(self.presence_topic, b"online", qos=1, retain=True)
        self._pending_subscriptions = pending
        if not pending:
            self.subscribed.set()
        self.connected.set()
        if self.on_connected is not None:
            self.on_connected()

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties=None) -> None:
        topic = self._pending_subscriptions.pop(mid, None)
        refused = [str(code) for code in reason_codes or () if getattr(code, "is_failure", False)]
        if refused and topic is not None:
            self.subscriptions_refused.append(f"{topic} ({', '.join(refused)})")
            if self._started:  # a reconnect mid-run: nobody to raise to, and nothing will arrive on it
                log.error("the broker at %s refused %s's subscription to %s (%s) on reconnecting: its ACL must let "
                          "this client read that topic", self.address, self.client_id, topic, ", ".join(refused))
        if not self._pending_subscriptions:
            self.subscribed.set()

    def _on_disconnect(self, client, userdata, flags, reason_code, properties=None) -> None:
        self.connected.clear()
        self.last_disconnect = str(reason_code)

    def _on_message(self, client, userdata, msg) -> None:
        if self.yield_session and msg.topic == self.presence_topic:
            other = dict(getattr(msg.properties, "UserProperty", None) or []).get(INSTANCE_PROPERTY)
            if isinstance(other, str) and other != self.instance and started_later(other, self.instance):
                self.taken_over.set()
                client.disconnect()  # no reconnect: paho's loop stops retrying once a disconnect was asked for
            return
        if not any(self._mqtt.topic_matches_sub(sub, msg.topic) for sub in self.subscriptions):
            # a session resumed from an earlier process of this client id keeps that one's
            # subscriptions (MQTT 3.1.1 always resumes): what they bring is not this link's
            log.debug("%s: dropped a message on %s, a topic it did not subscribe to", self.client_id, msg.topic)
            return
        instance = dict(getattr(msg.properties, "UserProperty", None) or []).get(INSTANCE_PROPERTY)
        self.inbox.put(Incoming(msg.topic, bytes(msg.payload), bool(msg.retain),
                                instance[:64] if isinstance(instance, str) else None))

    # --- use ----------------------------------------------------------------------------------
    def open(self) -> None:
        """Open the connection and queue CONNECT, without a network thread: :meth:`start` adds
        paho's thread; the load generator (:mod:`edgefl.fleet.swarm`) drives thousands of links
        from one selector loop instead."""
        kwargs = {}
        if self.v5:
            from paho.mqtt.packettypes import PacketTypes
            from paho.mqtt.properties import Properties

            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = self._session_expiry_s
            # a fresh session: clean at this process's first connection only, kept over its reconnects
            first = self._mqtt.MQTT_CLEAN_START_FIRST_ONLY if self._fresh_session else False
            kwargs = {"clean_start": first, "properties": props}
        try:
            self.client.connect(self.address.host, self.address.port, keepalive=self._keepalive_s, **kwargs)
        except OSError as exc:
            raise BrokerUnreachable(f"cannot reach the broker at {self.address}: {exc}",
                              hint="start one (edgefl fleet starts its own) or check --broker") from None

    def start(self, timeout_s: float = 15.0) -> Link:
        """Connect and return once the broker has accepted the connection and acknowledged its
        subscriptions: a message published after this reaches the link (returning at CONNACK
        lost one sent in the moment before the broker had the subscription, on a loaded machine)."""
        self.open()
        self.client.loop_start()
        deadline = time.monotonic() + timeout_s
        if not self.connected.wait(timeout_s) or not self.subscribed.wait(max(0.0, deadline - time.monotonic())):
            # (read before stop(): its own disconnect clears `connected` and sets last_disconnect)
            accepted = self.connected.is_set()
            why, waiting = self.last_disconnect, sorted(self._pending_subscriptions.values())
            self.stop()
            if accepted:
                raise SubscriptionsUnconfirmed(
                    f"the broker at {self.address} accepted {self.client_id} but did not acknowledge its subscription(s) to "
                    f"{', '.join(waiting)} within {timeout_s:g} s",
                    hint="the broker is up but does not confirm subscriptions: check its log and its ACL "
                         "(an overloaded broker answers late; a device's --broker-wait tries again)")
            raise BrokerUnreachable(f"the broker at {self.address} did not accept {self.client_id} within {timeout_s:g} s"
                                    + (f" ({why})" if why else ""))
        if self.subscriptions_refused:
            # a link that cannot read its topics would wait for its tasks (or uploads) forever
            refused = self.subscriptions_refused
            self.stop()
            # (not BrokerUnreachable: trying again, as a device waiting for its broker does, cannot help)
            raise EdgeflError(f"the broker at {self.address} refused {self.client_id}'s subscription(s) to {'; '.join(refused)}",
                              hint="the broker's ACL must let this client read those topics "
                                   "(edgefl broker-config writes one that does)")
        self._started = True
        return self

    def publish(self, topic: str, payload: bytes, retain: bool = False, qos: int = 1) -> None:
        if len(payload) + len(topic) + 64 > self.max_packet_bytes:
            raise EdgeflError(f"refusing to publish {len(payload)} bytes: the broker's limit is {self.max_packet_bytes}",
                              hint="lower the chunk size or raise the broker's max_packet_size")
        self.client.publish(topic, payload, qos=qos, retain=retain)

    def get(self, timeout_s: float) -> Incoming | None:
        try:
            return self.inbox.get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            if self.taken_over.is_set():
                raise self.taken_over_error or EdgeflError(f"another process took over the MQTT client id {self.client_id!r}") from None
            return None

    def stop(self, offline: bool = True) -> None:
        """Say offline (when asked), disconnect first, then stop the loop (stopping first can hang
        on a full outgoing queue)."""
        try:
            if offline and self.presence_topic and self.connected.is_set():
                info = self.client.publish(self.presence_topic, b"offline", qos=1, retain=True)
                info.wait_for_publish(2.0)
            self.client.disconnect()
        finally:
            self.client.loop_stop()
